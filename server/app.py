"""v4serve's HTTP application: the OpenAI API over one Generator, on FastAPI (Starlette) with SSE streams.

    GET  /v1/models                  the served model
    POST /v1/completions             text or token-id prompts, as they are (no chat encoding)
    POST /v1/chat/completions        messages through V4's chat encoding (chat/encoding.py); the answer parsed
                                     back into reasoning, content and tool calls (chat/parsing.py)
    POST /tokenize, /detokenize      vLLM's shapes; GET /tokenizer_info (lm-eval's remote tokenizer uses the three)
    GET  /health, /metrics           liveness; Prometheus series (runtime/metrics.py SERIES, as Triton's model)

Every request of every client goes to one ServingLoop, whose thread steps the Generator: concurrent requests are
batched in the scheduler as they are for Triton. A choice (n per prompt) is a request of its own. Admission is
bounded: with max_batch running and max_queue_size waiting, a request is answered 429 at once. A client that
hangs up cancels its requests at the next step: a stream by the SSE response's disconnect watch, a plain request
by a watch on the connection while it waits.

Errors have the OpenAI shape, one line naming the field: 400 (bad request), 401 (API key), 404 (model), 413 (body
too large), 429 (full), 500 (the engine failed).
"""
from __future__ import annotations

import asyncio
import bisect
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException

from v4engine.chat.encoding import ASSISTANT, DEFAULT_PROFILE, END_THINK, THINK, ChatError, encode_messages
from v4engine.chat.parsing import AnswerParser, Delta, strip_markers
from v4engine.contract.errors import V4EngineError
from v4engine.runtime.detokenize import IncrementalDetokenizer, SpecialTokensKept
from v4engine.runtime.generator import Generator, longest_prompt_bytes
from v4engine.runtime.metrics import SERIES, RequestMetrics, finished_counts
from v4engine.runtime.sampling import RequestError, SamplingParams, TokenLogprob
from v4engine.runtime.serving import QueueFullError, ServingLoop, Stream

from .protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, SamplingFields,
                       TokenizeRequest, bad_request)

MiB = 1 << 20


@dataclass(frozen=True)
class ServerOptions:
    model_name: str
    max_queue_size: int = 64
    api_key: str | None = None                # required as "Authorization: Bearer KEY" on /v1 and the tokenizer
    chat_profile: str = DEFAULT_PROFILE       # which release's reasoning efforts (chat/encoding.py)
    report_prefix_hits: bool = False          # usage.prompt_tokens_details.cached_tokens (a cross-tenant signal)
    max_body_bytes: int = 16 * MiB


# --------------------------------------------------------------------------- one choice's text
class ChoiceText:
    """A choice's text as its tokens come, as Deltas: the runtime's own decode for completions; for chat, the
    decode with special tokens kept, read by the answer parser (Generator.answer_text's text, in pieces). Streamed
    or not, the deltas join to the same message (both the detokenizer's pieces and the parser's deltas do)."""

    def __init__(self, tokenizer, params: SamplingParams, thinking: bool | None):
        self.chat = thinking is not None
        self.detokenizer = IncrementalDetokenizer(SpecialTokensKept(tokenizer) if self.chat else tokenizer,
                                                  params.stop)
        self.parser = AnswerParser(thinking) if self.chat else None
        self.ids: list[int] = []

    def add(self, tokens: Sequence[int]) -> Delta:
        self.ids += tokens
        return self._read(self.detokenizer.add(tokens))

    def finish(self) -> Delta:
        delta = self._read(self.detokenizer.finish())
        if self.parser is not None:
            rest = self.parser.finish()
            delta.reasoning, delta.content = delta.reasoning + rest.reasoning, delta.content + rest.content
            delta.tool_calls += rest.tool_calls
        return delta

    def _read(self, text: str) -> Delta:
        return self.parser.feed(strip_markers(text)) if self.parser is not None else Delta(content=text)


# --------------------------------------------------------------------------- metrics
class PrometheusMetrics:
    """runtime/metrics.py SERIES in a registry of the app's own, labelled with the served model's name."""

    def __init__(self, model: str, positions: int):
        self.registry, self.model, self.positions = CollectorRegistry(), model, positions
        makers = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}
        self.series: dict[str, Any] = {}
        for key, s in SERIES.items():
            labels = ["model", "position"] if s.per_position else ["model"]
            extra = {"buckets": s.buckets} if s.buckets else {}
            self.series[key] = makers[s.kind](s.name, s.doc, labels, registry=self.registry, **extra)
        self.exported: dict[str, int] = {}

    def labelled(self, key: str, position: int | None = None):
        series = self.series[key]
        return series.labels(self.model) if position is None else series.labels(self.model, str(position))

    def finished(self, metrics: RequestMetrics) -> None:
        for key, position, value in finished_counts(metrics):
            if position is None or position <= self.positions:
                self.labelled(key, position).inc(value)

    def update(self, gauges: dict[str, int]) -> None:
        """From ServingLoop.on_update (the scheduler thread): engine steps and the gauges."""
        steps = gauges.pop("engine_steps")
        self.labelled("engine_steps").inc(steps - self.exported.get("engine_steps", 0))
        self.exported["engine_steps"] = steps
        for key, value in gauges.items():
            self.labelled(key).set(value)


# --------------------------------------------------------------------------- the server
class Server:
    """The endpoints' work; create_app wires it to routes."""

    def __init__(self, generator: Generator, options: ServerOptions):
        if generator.tokenizer is None:
            raise V4EngineError(f"{generator.engine_dir} has no tokenizer.json, which an OpenAI server needs")
        self.generator, self.options, self.tokenizer = generator, options, generator.tokenizer
        self.metrics = PrometheusMetrics(options.model_name, generator.scheduler.mtp)
        self.serving = ServingLoop(generator, options.max_queue_size,
                                   on_update=lambda: self.metrics.update(self.serving.gauges()))
        self.created = int(time.time())
        self.max_model_len = generator.scheduler.max_seq_len
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self.prompt_bytes = longest_prompt_bytes(self.tokenizer, self.max_model_len)   # the most a prompt can hold

    # ------------------------------------------------------------------ checks
    def check_key(self, request: Request) -> None:
        key = self.options.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise APIError(401, "a valid API key is needed: Authorization: Bearer <key>", None,
                           "authentication_error")

    def check_model(self, body: SamplingFields | TokenizeRequest | DetokenizeRequest) -> None:
        if body.model is not None and body.model != self.options.model_name:
            raise APIError(404, f"model {body.model[:80]!r} is not served here (this server serves "
                           f"{self.options.model_name!r})", "model", "not_found_error")

    def encode(self, prompt: str | list[int]) -> list[int]:
        try:
            return self.generator.encode(prompt)
        except RequestError as e:
            raise bad_request(e) from None

    def sampling(self, body: SamplingFields, max_tokens: int | None, prompt: list[int], choice: int
                 ) -> SamplingParams:
        if max_tokens is None:                   # the rest of the context
            max_tokens = self.max_model_len - len(prompt)
            if max_tokens <= 0:
                raise APIError(400, f"the prompt has {len(prompt)} tokens, which leaves none of the "
                               f"{self.max_model_len} this server serves (max_model_len) to generate", "messages")
        try:
            params = body.sampling(max_tokens, choice)
            self.generator.check(prompt, params)
        except RequestError as e:
            raise bad_request(e) from None
        return params

    # ------------------------------------------------------------------ generation
    def submit(self, prompts: list[list[int]], params: list[list[SamplingParams]]) -> list[Stream]:
        """One stream per (prompt, choice), in choice index order; all or none (429 when the queue is full)."""
        streams: list[Stream] = []
        try:
            for ids, choices in zip(prompts, params):
                streams += [self.serving.submit(ids, p) for p in choices]
        except QueueFullError as e:
            for stream in streams:
                self.serving.cancel(stream)
            raise APIError(429, str(e), None, "rate_limit_error") from None
        except RequestError as e:
            for stream in streams:
                self.serving.cancel(stream)
            raise bad_request(e) from None
        return streams

    async def updates(self, streams: list[Stream]) -> AsyncIterator[tuple[int, list[int], bool]]:
        """(choice index, new tokens, finished) from every stream as they come; cancels what is left if the
        consumer stops early (a client gone)."""
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, stream: Stream) -> None:
            try:
                async for update in stream:
                    await merged.put((index, update.tokens, update.finished, None))
            except Exception as e:                      # noqa: BLE001 - the step failed: the client hears of it
                await merged.put((index, [], True, e))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        left = len(streams)
        try:
            while left:
                index, tokens, finished, error = await merged.get()
                if error is not None:
                    raise APIError(500, f"the engine failed: {str(error)[:300]}", None, "server_error")
                left -= finished
                yield index, tokens, finished
        finally:
            for stream in streams:
                if stream.request is None or stream.request.finish_reason is None:
                    self.serving.cancel(stream)
            for task in tasks:
                task.cancel()

    def finished(self, streams: list[Stream]) -> RequestMetrics:
        """The choices' acceptance figures, merged, after counting them in the metrics."""
        total = RequestMetrics(mtp=self.generator.scheduler.mtp)
        for stream in streams:
            self.metrics.finished(stream.request.metrics)
            total.merge(stream.request.metrics)
        return total

    def usage(self, prompts: list[list[int]], streams: list[Stream], texts: list[ChoiceText],
              thinking: bool | None) -> dict:
        metrics = self.finished(streams)
        completion = sum(len(t.ids) for t in texts)
        prompt = sum(len(p) for p in prompts)
        usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                                 "total_tokens": prompt + completion}
        if self.options.report_prefix_hits:
            usage["prompt_tokens_details"] = {"cached_tokens": metrics.prefix_hit_tokens}
        if thinking:
            usage["completion_tokens_details"] = {"reasoning_tokens": sum(self.reasoning_tokens(t.ids)
                                                                          for t in texts)}
        usage["speculative"] = {k: v for k, v in metrics.to_dict().items() if k in (
            "drafted", "accepted", "acceptance_rate", "mean_acceptance_length", "per_position_acceptance",
            "verify_steps")}
        return usage

    def reasoning_tokens(self, ids: list[int]) -> int:
        """Generated tokens before the one that completes </think> (all of them if none does)."""
        keep = SpecialTokensKept(self.tokenizer)
        ends = bisect.bisect_left(range(len(ids) + 1), True, key=lambda n: END_THINK in keep.decode(ids[:n]))
        return max(ends - 1, 0) if ends <= len(ids) else len(ids)

    @staticmethod
    def finish_reason(stream: Stream, text: ChoiceText) -> str:
        if text.parser is not None and text.parser.tool_calls:
            return "tool_calls"
        return "length" if stream.request.finish_reason == "length" else "stop"


def _message(delta: Delta, thinking: bool | None, include_reasoning: bool, streamed: bool) -> dict:
    """A chat message (or a streamed delta): content, the reasoning under both names in use (DeepSeek's
    reasoning_content, vLLM's reasoning), tool calls with ids of their own."""
    out: dict[str, Any] = {}
    if thinking and include_reasoning and (delta.reasoning or not streamed):
        out["reasoning_content"] = out["reasoning"] = delta.reasoning
    if delta.content or not streamed:
        out["content"] = delta.content
    if delta.tool_calls:
        out["tool_calls"] = [{"index": i, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                              "function": {"name": c.name, "arguments": c.arguments}}
                             for i, c in enumerate(delta.tool_calls)]
    return out


def _token_text(tokenizer, token: int) -> str:
    return tokenizer.decode([token], skip_special_tokens=False)


def completion_logprobs(tokenizer, tokens: Sequence[int], entries: Sequence[TokenLogprob | None], offset: int = 0
                        ) -> dict:
    """The completions API's logprobs object: each token's text, logprob (None for the prompt's first token,
    which nothing scores), its most likely alternatives by text, and where its text starts."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, entry in zip(tokens, entries):
        text = _token_text(tokenizer, token)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        out["token_logprobs"].append(entry.logprob if entry is not None else None)
        out["top_logprobs"].append({_token_text(tokenizer, t): v for t, v in entry.top} if entry is not None
                                   else None)
    return out


def chat_logprobs(tokenizer, entries: Sequence[TokenLogprob]) -> dict:
    """The chat API's logprobs object: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""
    def item(token: int, logprob: float) -> dict:
        text = _token_text(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(t, v) for t, v in e.top]}
                        for e in entries]}


def create_app(generator: Generator, options: ServerOptions) -> FastAPI:
    """The ASGI app serving `generator` (its ServingLoop starts now and stops with the app)."""
    server = Server(generator, options)

    async def lifespan(app: FastAPI):
        yield
        server.serving.close()

    app = FastAPI(title="v4serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    app.add_middleware(BodyLimit, limit=options.max_body_bytes)

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        field = ".".join(str(p) for p in first.get("loc", ())[1:]) or "body"
        return await api_error(request, APIError(400, f"{field}: {first.get('msg', 'invalid')}", field))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        return await api_error(request, APIError(error.status_code, str(error.detail)))

    @app.get("/health")
    async def health() -> Response:
        alive = server.serving.alive
        return Response(status_code=200 if alive else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        server.check_key(request)
        name = options.model_name
        return {"object": "list", "data": [{"id": name, "object": "model", "created": server.created,
                                            "owned_by": "v4engine", "root": name, "parent": None,
                                            "max_model_len": server.max_model_len}]}

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request) -> dict:
        """The special tokens' texts (lm-eval's remote tokenizer reads eos_token here, then uses /tokenize)."""
        server.check_key(request)
        cfg = generator.scheduler.cfg

        def text(ids: int | list[int] | None) -> str | None:
            first = ids[0] if isinstance(ids, list) and ids else ids
            return server.tokenizer.id_to_token(first) if isinstance(first, int) else None

        return {"eos_token": text(cfg.eos_token_id), "bos_token": text(cfg.bos_token_id),
                "model_max_length": server.max_model_len}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request) -> dict:
        server.check_key(request)
        server.check_model(body)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give either prompt or messages", "prompt")
        if body.prompt is not None:
            size, most = len(body.prompt.encode("utf-8", "surrogatepass")), server.prompt_bytes
            if size > most:                # tokenizing megabytes would hold the event loop for seconds
                raise APIError(400, f"the prompt text has {size} bytes, more than a prompt this server serves can "
                               f"hold ({most})", "prompt")
            try:
                tokens = server.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens).ids
            except BaseException as e:         # noqa: BLE001 - a tokenizer panic is a BaseException
                if isinstance(e, (KeyboardInterrupt, SystemExit)):
                    raise
                raise APIError(400, "the tokenizer failed on this prompt", "prompt") from None
        else:
            chat = ChatCompletionRequest(model=options.model_name, messages=body.messages, tools=body.tools,
                                         reasoning_effort=body.reasoning_effort, thinking=body.thinking,
                                         chat_template_kwargs=body.chat_template_kwargs)
            text, _ = chat_prompt(chat, options.chat_profile)
            if not body.add_generation_prompt:
                text = _without_generation_prompt(text)
            tokens = server.encode(text)
        return {"count": len(tokens), "max_model_len": server.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
        server.check_key(request)
        server.check_model(body)
        if len(body.tokens) > server.max_model_len:
            raise APIError(400, f"tokens holds {len(body.tokens)} ids, more than a sequence of this server "
                           f"({server.max_model_len}, max_model_len)", "tokens")
        for i, t in enumerate(body.tokens):
            if not 0 <= t < server.vocab_size:
                raise APIError(400, f"tokens[{i}] = {t} is not a token id of this tokenizer (0.."
                               f"{server.vocab_size - 1})", "tokens")
        return {"prompt": server.tokenizer.decode(body.tokens)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        server.check_key(request)
        server.check_model(body)
        body.refuse_unserved()
        given = body.prompts()
        prompts = [server.encode(p) for p in given]
        params = [[server.sampling(body, body.max_tokens if body.max_tokens is not None else 16, ids, j)
                   for j in range(body.n)] for ids in prompts]
        echo = [p if isinstance(p, str) else server.tokenizer.decode(p) for p in given] if body.echo else None
        return await respond(request, body, prompts, params, thinking=None, kind="text_completion", echo=echo)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        server.check_key(request)
        server.check_model(body)
        body.refuse_unserved()
        text, thinking = chat_prompt(body, options.chat_profile)
        ids = server.encode(text)
        params = [[server.sampling(body, body.token_limit, ids, j) for j in range(body.n)]]
        return await respond(request, body, [ids], params, thinking=thinking, kind="chat.completion")

    def logprobs_of(stream: Stream, text: ChoiceText, prompt: list[int], echo: bool, start: int = 0,
                    offset: int = 0) -> dict | None:
        """A choice's logprobs object for its tokens from `start` (and, echoing, its prompt's first)."""
        request = stream.request
        if request.params.logprobs is None:
            return None
        entries = request.logprobs[start: len(text.ids)]
        if text.chat:
            return chat_logprobs(server.tokenizer, entries)
        tokens = text.ids[start:]
        if echo:
            tokens, entries = prompt + tokens, [None, *request.prompt_logprobs, *entries]
        return completion_logprobs(server.tokenizer, tokens, entries, offset)

    async def respond(request: Request, body: SamplingFields, prompts: list[list[int]],
                      params: list[list[SamplingParams]], thinking: bool | None, kind: str,
                      echo: list[str] | None = None):
        streams = server.submit(prompts, params)
        prompt_of = [ids for ids, choices in zip(prompts, params) for _ in choices]       # each choice's prompt
        echo_of = [e for e, choices in zip(echo, params) for _ in choices] if echo is not None else None
        include_reasoning = getattr(body, "include_reasoning", True)
        texts = [ChoiceText(server.tokenizer, p, thinking) for choices in params for p in choices]
        name = ("chatcmpl-" if thinking is not None else "cmpl-") + uuid.uuid4().hex
        head = {"id": name, "created": int(time.time()), "model": options.model_name}
        if body.stream:
            return EventSourceResponse(stream_events(streams, texts, prompts, prompt_of, echo_of, thinking,
                                                     include_reasoning, head, body.include_usage), ping=15)
        deltas = await collect(request, streams, texts)
        choices = []
        for i, (stream, text, delta) in enumerate(zip(streams, texts, deltas)):
            choice: dict[str, Any] = {"index": i, "logprobs": logprobs_of(stream, text, prompt_of[i], bool(echo)),
                                      "finish_reason": server.finish_reason(stream, text), "stop_reason": None}
            if thinking is None:
                choice["text"] = (echo_of[i] if echo_of is not None else "") + delta.content
            else:
                choice["message"] = {"role": "assistant", **_message(delta, thinking, include_reasoning, False)}
                if not delta.content and text.parser.tool_calls:
                    choice["message"]["content"] = None
                if thinking and text.parser.mode == "reasoning":     # never left its reasoning (max_tokens)
                    choice["message"]["content"] = None
            choices.append(choice)
        return {**head, "object": kind, "choices": choices, "usage": server.usage(prompts, streams, texts, thinking)}

    async def collect(request: Request, streams: list[Stream], texts: list[ChoiceText]) -> list[Delta]:
        """Every choice's whole message; a client that hangs up meanwhile cancels them (then 499, unanswered)."""
        deltas = [Delta() for _ in streams]

        async def gather() -> None:
            async for index, tokens, finished in server.updates(streams):
                for piece in (texts[index].add(tokens), *((texts[index].finish(),) if finished else ())):
                    deltas[index].reasoning += piece.reasoning
                    deltas[index].content += piece.content
                    deltas[index].tool_calls += piece.tool_calls

        work = asyncio.ensure_future(gather())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not work.done():                       # the client left: its requests end at the next step
            work.cancel()
            raise APIError(499, "the client closed the connection", None, "client_closed")
        work.result()
        return deltas

    async def stream_events(streams: list[Stream], texts: list[ChoiceText], prompts: list[list[int]],
                            prompt_of: list[list[int]], echo_of: list[str] | None, thinking: bool | None,
                            include_reasoning: bool, head: dict, include_usage: bool):
        """Server-sent events as OpenAI streams them: a first chunk per choice (chat: the role), deltas, a last
        chunk with its finish_reason, the usage chunk if asked, then [DONE]. An engine failure mid-stream is an
        error event before [DONE]."""
        chat = thinking is not None
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(index: int, delta: Delta | None = None, finish: str | None = None, first: bool = False,
                  logprobs: dict | None = None) -> dict:
            if chat:
                body = {"role": "assistant", "content": ""} if first else (
                    _message(delta, thinking, include_reasoning, True) if delta is not None else {})
                choice = {"index": index, "delta": body, "logprobs": logprobs, "finish_reason": finish}
            else:
                choice = {"index": index, "text": delta.content if delta is not None else "", "logprobs": logprobs,
                          "finish_reason": finish}
            if finish is not None:
                choice["stop_reason"] = None
            return {"data": json.dumps({**head, "object": kind, "choices": [choice]}, ensure_ascii=False)}

        try:
            if chat:
                for i in range(len(streams)):
                    yield chunk(i, first=True)
            offsets = [0] * len(streams)                  # text_offset of each choice's next token
            async for index, tokens, finished in server.updates(streams):
                text, start = texts[index], len(texts[index].ids)
                echo = echo_of is not None and start == 0 and bool(tokens or finished)
                delta = text.add(tokens)
                if finished:
                    rest = text.finish()
                    delta = Delta(delta.reasoning + rest.reasoning, delta.content + rest.content,
                                  delta.tool_calls + rest.tool_calls)
                if echo:
                    delta.content = echo_of[index] + delta.content
                logprobs = logprobs_of(streams[index], text, prompt_of[index], echo, start, offsets[index]) \
                    if tokens or echo else None
                if logprobs is not None and not chat:
                    offsets[index] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1]) \
                        if logprobs["tokens"] else offsets[index]
                if delta or logprobs is not None:
                    yield chunk(index, delta, logprobs=logprobs)
                if finished:
                    yield chunk(index, finish=server.finish_reason(streams[index], texts[index]))
            if include_usage:
                yield {"data": json.dumps({**head, "object": kind, "choices": [],
                                           "usage": server.usage(prompts, streams, texts, thinking)})}
            else:
                server.finished(streams)
        except APIError as e:
            yield {"data": json.dumps(e.body())}
        yield {"data": "[DONE]"}

    return app


def chat_prompt(body: ChatCompletionRequest, profile: str) -> tuple[str, bool]:
    """(the prompt string, thinking) of a chat request."""
    thinking, effort, drop = body.mode(profile)
    try:
        return encode_messages(body.messages_with_tools(), thinking=thinking, reasoning_effort=effort,
                               profile=profile, drop_thinking=drop), thinking
    except ChatError as e:
        raise APIError(400, str(e), "messages") from None


def _without_generation_prompt(text: str) -> str:
    for tail in (ASSISTANT + THINK, ASSISTANT + END_THINK):
        if text.endswith(tail):
            return text[: -len(tail)]
    return text


async def _disconnected(request: Request) -> None:
    """Returns once the client has closed the connection (the body was read: what comes next is the hang-up)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class BodyLimit:
    """Refuse request bodies over `limit` bytes (413), by their Content-Length or as they arrive: nothing else
    bounds what a client may send before the JSON is parsed."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if not declared.isdigit() or int(declared) > self.limit:
            error = APIError(413, f"the request body exceeds {self.limit} bytes (max_body_bytes)")
            return await JSONResponse(error.body(), status_code=413)(scope, receive, send)
        received = 0

        async def limited():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.limit:
                raise HTTPException(413, f"the request body exceeds {self.limit} bytes (max_body_bytes)")
            return message

        await self.app(scope, limited, send)


__all__ = ["ServerOptions", "create_app"]
