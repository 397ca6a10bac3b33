"""The OpenAI API's request bodies as v4serve reads them, and how each becomes a runtime request.

Pydantic checks the JSON's shape in strict mode (a number sent as text is refused, as the runtime refuses it);
SamplingParams.validate then checks the values. Fields the runtime cannot honour exactly yet (logit_bias, a
required or named tool_choice, structured output) are refused in one line instead of being ignored: a client that asked for them would get a different answer than it thinks. Fields no answer
depends on (user, ...) are accepted and ignored.

Thinking, in a chat request: off (chat mode) unless the request asks for it, as DeepSeek's reference encoder,
TensorRT-LLM and vLLM before its V4 API alignment do: `thinking: {"type": "enabled"}` (DeepSeek's API),
`chat_template_kwargs: {"thinking": true}` or `{"enable_thinking": true}` (vLLM), or a `reasoning_effort` other
than "none". Effort names map onto the release's encoder (EFFORTS): minimal, low and medium are 0731's low (no
prefix), xhigh is max.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from v4engine.chat.encoding import ChatError, declare_tools
from v4engine.runtime.sampling import RequestError, SamplingParams

MAX_N = 16                      # choices per request (each is a request of its own in the scheduler)
# the API's effort names -> each encoder profile's (chat/encoding.py EFFORT_PROFILES)
EFFORTS = {"0731": {"minimal": "low", "low": "low", "medium": "low", "high": "high", "xhigh": "max", "max": "max"},
           "preview": {"minimal": "high", "low": "high", "medium": "high", "high": "high", "xhigh": "max",
                       "max": "max"}}


class APIError(Exception):
    """An answer in the OpenAI error shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class SamplingFields(BaseModel):
    """What completions and chat share."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: str
    temperature: float | None = None          # None: 1.0, V4's generation_config
    top_p: float | None = None
    top_k: int | None = None                  # vLLM's extension; -1 or 0: off
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0            # vLLM's extension
    logit_bias: dict[str, float] | None = None  # not served: refused unless empty

    def refuse_unserved(self) -> None:
        if self.logit_bias:
            raise APIError(400, "logit_bias is not served by v4serve yet; leave it out", "logit_bias")

    def sampling(self, max_tokens: int, choice: int) -> SamplingParams:
        """The runtime's parameters for choice `choice` of n: a seed of its own (seed + choice), so the n
        samples differ and each is reproducible."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        seed = None if self.seed is None else (self.seed + choice) % 2**64
        top_k = self.top_k if self.top_k is not None and self.top_k > 0 else 0
        logprobs, prompt_logprobs = self.logprob_counts()
        params = SamplingParams(max_new_tokens=max_tokens, temperature=1.0 if self.temperature is None else
                                self.temperature, top_p=1.0 if self.top_p is None else self.top_p, top_k=top_k,
                                seed=seed, stop=stop, stop_token_ids=tuple(self.stop_token_ids or ()),
                                ignore_eos=self.ignore_eos, cache_salt=self.cache_salt, logprobs=logprobs,
                                prompt_logprobs=prompt_logprobs, presence_penalty=self.presence_penalty,
                                frequency_penalty=self.frequency_penalty,
                                repetition_penalty=self.repetition_penalty)
        params.validate()
        return params

    def logprob_counts(self) -> tuple[int | None, int | None]:
        """(alternatives per generated token, per prompt token): None where not asked."""
        return None, None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False                        # the prompt before the text (and its logprobs, with logprobs)
    logprobs: int | None = None               # alternatives per token (OpenAI's legacy completions field)
    suffix: str | None = None

    def logprob_counts(self) -> tuple[int | None, int | None]:
        return self.logprobs, self.logprobs if self.echo else None

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request: a text, a list of texts, token ids, or a list of token id lists."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        if not self.prompt:
            raise APIError(400, "prompt must not be empty", "prompt")
        return list(self.prompt)

    def refuse_unserved(self) -> None:
        super().refuse_unserved()
        if self.suffix:
            raise APIError(400, "suffix is not served: V4 has no fill-in-the-middle format", "suffix")


class Thinking(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["enabled", "disabled"]


class ChatCompletionRequest(SamplingFields):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    reasoning_effort: str | None = None
    thinking: Thinking | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None

    def logprob_counts(self) -> tuple[int | None, int | None]:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None, None

    def refuse_unserved(self) -> None:
        super().refuse_unserved()
        if self.tool_choice not in (None, "none", "auto"):
            raise APIError(400, 'tool_choice must be "none" or "auto": a required or named tool needs structured '
                           "output, which v4serve does not serve", "tool_choice")
        if self.response_format is not None and self.response_format.get("type") not in (None, "text"):
            raise APIError(400, "response_format other than text needs structured output, which v4serve does not "
                           "serve", "response_format")

    def mode(self, profile: str) -> tuple[bool, str | None, bool]:
        """(thinking, the encoder's effort, drop_thinking) this request asks for (see the module's docstring)."""
        kwargs = self.chat_template_kwargs or {}
        effort = kwargs.get("reasoning_effort", self.reasoning_effort)
        asked = kwargs.get("thinking", kwargs.get("enable_thinking"))
        if self.thinking is not None:
            asked = self.thinking.type == "enabled"
        if effort == "none":
            asked, effort = False, None
        if asked is None:
            asked = effort is not None
        if not isinstance(asked, bool):
            raise APIError(400, "chat_template_kwargs.thinking must be true or false", "chat_template_kwargs")
        if effort is not None and effort not in EFFORTS[profile]:
            raise APIError(400, f"reasoning_effort must be one of none, {', '.join(EFFORTS[profile])} (got "
                           f"{str(effort)[:40]!r})", "reasoning_effort")
        drop = kwargs.get("drop_thinking", True)
        if not isinstance(drop, bool):
            raise APIError(400, "chat_template_kwargs.drop_thinking must be true or false", "chat_template_kwargs")
        return asked, EFFORTS[profile][effort] if asked and effort is not None else None, drop

    def messages_with_tools(self) -> list[dict[str, Any]]:
        """The messages with the request's tools declared (tool_choice "none" declares none)."""
        return declare_tools(self.messages, None if self.tool_choice == "none" else self.tools)

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages (then the chat fields as a chat request has them)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool = True
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    reasoning_effort: str | None = None
    thinking: Thinking | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    tokens: list[int]


def bad_request(error: RequestError | ChatError) -> APIError:
    return APIError(400, str(error))


__all__ = ["APIError", "ChatCompletionRequest", "CompletionRequest", "DetokenizeRequest", "MAX_N", "TokenizeRequest",
           "bad_request"]
