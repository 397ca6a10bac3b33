"""The user-facing API: load an engine directory and generate, drafting with the MTP layer.

    gen = Generator.from_engine_dir("out/engine")
    [result] = gen.generate(["def fib(n):"], SamplingParams(max_new_tokens=32))
    print(result.text, result.metrics["mean_acceptance_length"])
    for token_ids in gen.stream("def fib(n):", SamplingParams(max_new_tokens=32)): ...

Any number of threads may share one Generator (see the class's docstring).
"""
from __future__ import annotations

import reprlib
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from v4engine.chat.encoding import DEFAULT_PROFILE, ChatError, declare_tools, encode_messages
from v4engine.chat.parsing import AssistantMessage, parse_answer
from v4engine.contract.backends import BACKENDS
from v4engine.contract.engine import EngineManifest
from v4engine.contract.engine_folder import EngineFolder, EngineFormatError
from v4engine.contract.stages import check_devices
from v4engine.contract.untrusted import first_line

from .budget import Limits
from .detokenize import IncrementalDetokenizer, SpecialTokensKept, final_text
from .drafters import DRAFTERS, Drafter
from .metrics import RequestMetrics
from .sampling import DRAFT_SAMPLE_METHODS, RequestError, SamplingParams, TokenLogprob, is_integer
from .scheduler import Request, Scheduler
from .sessions import EngineSession, open_session, open_target
from .verify_schedule import VerifyPlanner, profile_key, profile_step_costs, recorded_costs

Prompt = str | Sequence[int]
TOKENIZER = "tokenizer.json"


def load_tokenizer(engine_dir: str | Path):
    """The engine directory's tokenizer.json as a `tokenizers.Tokenizer`, or None when it has none. Read through
    the engine folder's checks (a link out of the folder is refused), then parsed from memory."""
    folder = EngineFolder(engine_dir)
    if not folder.exists(TOKENIZER):
        return None
    from tokenizers import Tokenizer

    data = folder.read_bytes(TOKENIZER, "tokenizer", "tokenizer")
    try:
        return Tokenizer.from_str(data.decode("utf-8"))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:      # noqa: BLE001 - plain Exceptions, or a Rust panic (a BaseException)
        raise EngineFormatError(f"{folder.directory / TOKENIZER}: not a tokenizer file ({first_line(e)})") from None


def longest_prompt_bytes(tokenizer, max_tokens: int) -> int:
    """The most UTF-8 bytes a text of at most `max_tokens` tokens can hold (each token is at most the longest
    entry of the vocabulary): a longer text is refused before it is tokenized, which takes seconds for megabytes.
    Exact for tokenizers whose tokens each cover their own characters (byte-level BPE, V4's; the tiny models'
    characters); not for a normalizer that drops characters or a word-level model's <unk>."""
    return max_tokens * max(len(token.encode("utf-8")) for token in tokenizer.get_vocab(with_added_tokens=True))


def encode_text(tokenizer, text: str, max_bytes: int | None = None) -> list[int]:
    """A prompt's token ids: the text as it is, no special tokens added (the prompt says what it holds).
    RequestError when it holds more than `max_bytes` (longest_prompt_bytes), and when the tokenizer fails on it: a
    tokenizer.json's regex can give up on a text (Oniguruma's retry limit), which the tokenizers library raises as
    a Rust panic, a BaseException that `except Exception` (Triton's too) would miss."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if max_bytes is not None and size > max_bytes:
        raise RequestError(f"the prompt text has {size} bytes, more than a prompt this engine serves can hold "
                           f"({max_bytes})")
    try:
        return tokenizer.encode(text, add_special_tokens=False).ids
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:      # noqa: BLE001
        raise RequestError(f"the engine's tokenizer.json failed on this prompt ({first_line(e)})") from None


def drafter_tokens(manifest: EngineManifest, name: str | None, mtp: object, max_prefill_chunk: int, source: str
                   ) -> tuple[type[Drafter] | None, int]:
    """(the drafting method asked for, its draft tokens per step), or RequestError naming the one at fault. name
    None: the engine's own draft graph's method (none when it has none); mtp None: the method's default."""
    name = manifest.drafter if name is None else name
    if name is not None and name not in DRAFTERS:
        raise RequestError(f"drafter must be one of {', '.join(DRAFTERS)} (got {reprlib.repr(name)})")
    method = DRAFTERS[name] if name is not None else None
    if method is not None and method.has_graph and name != manifest.drafter:
        raise RequestError(f"{source} has no {name} draft graph (its drafter: {manifest.drafter or 'none'}); "
                           "rebuild it from a checkpoint with one, or pick a drafter without weights")
    mtp = (method.default_tokens(manifest) if method is not None else 0) if mtp is None else mtp
    most = method.most_tokens(manifest, max_prefill_chunk) if method is not None else 0
    if not (is_integer(mtp) and 0 <= mtp <= most):
        raise RequestError(f"mtp must be an integer from 0 to {most}, the draft tokens per step "
                           f"{name or 'no drafter'} makes on {source} (got {reprlib.repr(mtp)})")
    return method, int(mtp)


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str
    metrics: dict
    logprobs: list[TokenLogprob] | None = None          # per generated token (SamplingParams.logprobs)
    prompt_logprobs: list[TokenLogprob] | None = None   # per prompt token after the first (.prompt_logprobs)


@dataclass
class ChatResult:
    prompt: str                        # the encoded prompt string (chat/encoding.py)
    result: GenerationResult
    message: AssistantMessage          # the answer parsed: reasoning, content, tool calls


class Generator:
    """An engine directory's scheduler, its tokenizer, and the metrics totals of the requests it served.

    Thread safety, by a lock (no thread of its own): every public method may be called from any thread. One
    lock guards the scheduler and the totals. A caller that needs progress takes the lock, runs one scheduler
    step and lets it go; the step moves every request in flight, other callers' too, so concurrent calls share
    engine calls. Each caller reads its own requests' progress from them, under the lock, never from a step's
    result: each gets exactly the tokens it would get alone. ServingLoop steps through the same lock, so it may
    serve alongside direct calls. A failed step ends every request in flight with its error, which each caller
    raises: no one is left waiting. `scheduler` itself is not thread-safe: go through these methods.
    """

    def __init__(self, engine_dir: Path, manifest: EngineManifest, scheduler: Scheduler, tokenizer=None):
        self.engine_dir, self.manifest, self.scheduler, self.tokenizer = engine_dir, manifest, scheduler, tokenizer
        self.totals = RequestMetrics(mtp=scheduler.mtp)
        self._lock = threading.RLock()          # re-entrant for `cancel` during a step on the same thread
        self._stepping = False
        self._cancelled_in_step: list[Request] = []
        self._prompt_bytes: int | None = None        # longest_prompt_bytes, once a text prompt comes

    @classmethod
    def from_engine_dir(cls, path: str | Path, *, drafter: str | None = None, mtp: int | None = None,
                        limits: Limits | None = None, prefix_cache: bool = True,
                        devices: Sequence[int] | None = None, microbatches: int | None = None,
                        own_process: bool = False, backend_options: Mapping[str, Any] | None = None,
                        draft_sample_method: str = "probabilistic", confidence_scheduling: bool | None = None,
                        step_costs: str | Path | None = None) -> "Generator":
        """Open an engine directory.

        drafter: the drafting method (runtime/drafters/ DRAFTERS: by default the engine's own draft graph's;
        "prompt_lookup" on any engine). mtp: draft tokens per step, from 0 (no drafting) to what the drafter makes
        on this engine (the engine's k for its own draft graph); default the engine's k (prompt lookup on an
        engine without a draft graph: 3). limits: max_batch, max_seq_len and max_prefill_chunk (prompt tokens per
        engine call), by default the engine's (a prefill chunk at most 256 tokens on ONNX Runtime's CPU provider,
        where a larger one keeps more memory for no speed; a TensorRT or MIGraphX engine was built for shapes up to
        those, so larger ones are refused here rather than in the middle of a generation), and max_cache_bytes
        (all of the cache's memory, the pools and the prefix snapshots; default: runtime/budget.py). prefix_cache:
        a prompt that starts like an earlier one reuses that prefix's caches (runtime/prefix_cache.py); the tokens
        are those of a cold run either way. devices: the GPU of each of the engine's pipeline stages (v4build
        --pipeline-stages; one per stage, the draft beside the last; default:
        every stage where the backend runs by default). microbatches: a call's rows cut into this many slices in
        flight on different stages at once (default: one per stage when each stage has a GPU of its own; 1:
        none). own_process: this process is a program of its own (v4generate, the demo, the benchmarks), so the
        backend may take process-wide resources (ONNX Runtime: one spinning thread pool for all its sessions,
        which changes every later ONNX Runtime session of the process). backend_options: the options of the
        engine's backend (contract/backend_options.py; ONNX Runtime: providers, threads, device_pools,
        cuda_graphs, runtime_widening, stored_weights); one it does not take is refused in one line.
        draft_sample_method: how a draft graph draws the drafts of sampling requests that name none
        ("probabilistic", or "greedy": vLLM's option).
        confidence_scheduling: verify only the drafts that pay, and draft only when it pays
        (runtime/verify_schedule.py), from costs profiled on this machine the first time an engine is opened with
        these options (a few seconds) and recorded in `step_costs` (a folder; default
        $V4ENGINE_CACHE_DIR/step-costs or ~/.cache/v4engine/step-costs); default on for a drafter whose drafts
        carry a confidence (DSpark), which it needs. Greedy tokens are the same either way; sampled ones follow the
        target's distribution either way."""
        path = Path(path)
        if draft_sample_method not in DRAFT_SAMPLE_METHODS:
            raise RequestError(f"draft_sample_method must be one of {', '.join(DRAFT_SAMPLE_METHODS)} "
                               f"(got {reprlib.repr(draft_sample_method)})")
        if confidence_scheduling not in (None, True, False):
            raise RequestError(f"confidence_scheduling must be true, false or None (got "
                               f"{reprlib.repr(confidence_scheduling)})")
        manifest = EngineManifest.read(path)
        backend = BACKENDS[manifest.backend]
        options = backend.session_options.read(backend_options, manifest.backend, RequestError)
        asked = limits or Limits()
        limits = asked.resolved(manifest, str(path))
        preferred = backend.session_class().prefill_chunk(options, devices, manifest)
        if asked.max_prefill_chunk is None and preferred:
            limits = replace(limits, max_prefill_chunk=min(preferred, limits.max_prefill_chunk))
        method, mtp = drafter_tokens(manifest, drafter, mtp, limits.max_prefill_chunk, str(path))
        if devices is not None:
            devices = check_devices(devices, len(manifest.stages), str(path), RequestError)
        if microbatches is not None and not (is_integer(microbatches) and 1 <= microbatches <= limits.max_batch):
            raise RequestError(f"microbatches must be an integer from 1 to max_batch {limits.max_batch} "
                               f"(got {reprlib.repr(microbatches)})")
        if own_process:
            backend.session_class().own_process(options)
        # sessions that take turns on the cores: target and draft graph, pipeline stages
        alternating = bool(mtp and method.has_graph) or len(manifest.stages) > 1
        target = open_target(path, manifest, devices, microbatches, options=options, alternating=alternating)

        def open_graph(graph: str) -> EngineSession:       # a draft graph runs beside the last stage
            return open_session(path, manifest, graph, device=devices[-1] if devices else None, options=options,
                                alternating=alternating)

        drafts = method.open(manifest, mtp, limits.max_prefill_chunk, open_graph) if mtp else None
        if drafts is not None:
            drafts.sample_method = draft_sample_method
        scheduler = Scheduler(manifest, target, drafts, limits.max_batch, limits.max_seq_len,
                              max_cache_bytes=limits.max_cache_bytes, max_prefill_chunk=limits.max_prefill_chunk,
                              prefix_cache=prefix_cache)
        confident = drafts is not None and drafts.gives_confidence
        if confidence_scheduling and not confident:
            raise RequestError(f"confidence_scheduling needs drafts with a confidence (DSpark's); "
                               f"{method.method if drafts is not None else 'no drafter'} gives none")
        if confident and confidence_scheduling is not False:
            costs = recorded_costs(profile_key(path, (options, devices, microbatches), scheduler), mtp + 1,
                                   lambda: profile_step_costs(scheduler), Path(step_costs) if step_costs else None)
            scheduler.planner = VerifyPlanner(costs) if costs is not None else None
        return cls(path, manifest, scheduler, load_tokenizer(path))

    # ------------------------------------------------------------------ prompts and requests
    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError(f"{self.engine_dir} has no tokenizer.json; pass token ids instead of text")
            if self._prompt_bytes is None:
                self._prompt_bytes = longest_prompt_bytes(self.tokenizer, self.scheduler.max_seq_len - 1)
            return encode_text(self.tokenizer, prompt, self._prompt_bytes)
        if not isinstance(prompt, (Sequence, np.ndarray)):
            raise RequestError(f"a prompt is text or token ids (got {reprlib.repr(prompt)})")
        for t in prompt:
            if not is_integer(t):
                raise RequestError(f"a prompt is text or token ids; {reprlib.repr(t)} is not a token id")
        return [int(t) for t in prompt]

    def check(self, ids: list[int], sampling: SamplingParams) -> None:
        """Raise RequestError (one line) if the request cannot be served; reads only fixed limits: no lock."""
        self.scheduler.validate(ids, sampling)
        if sampling.stop and self.tokenizer is None:
            raise RequestError(f"{self.engine_dir} has no tokenizer.json, which stop strings need")

    def submit(self, prompt: Prompt, sampling: SamplingParams) -> Request:
        """Queue one request (RequestError, and nothing queued, if it cannot be served). Its owner drives it with
        `advance` and reads it with `progress`; `cancel` ends it early."""
        ids = self.encode(prompt)
        self.check(ids, sampling)
        with self._lock:
            request = self.scheduler.submit(ids, sampling)
            if sampling.stop:                               # before any step can see the request
                request.stop_text = IncrementalDetokenizer(self.tokenizer, sampling.stop)
        return request

    def cancel(self, request: Request) -> None:
        """End `request` now and free its caches; one that already ended keeps its finish reason.

        A stream that the garbage collector closes during a step on this very thread (the lock is re-entrant)
        must not change the scheduler in mid-step: its request ends right after the step."""
        with self._lock:
            self.scheduler.check_owned(request)
            if self._stepping:
                self._cancelled_in_step.append(request)
            else:
                self.scheduler.cancel(request)

    def advance(self, requests: Sequence[Request]) -> bool:
        """Run one scheduler step, for every request in flight, unless each of `requests` has ended (another
        caller's step may have ended them); whether each has ended now. A failed step ends every request in
        flight with its error (Request.error), which their owners raise: it is not raised here."""
        with self._lock:
            if any(r.finish_reason is None for r in requests):
                self._stepping = True
                try:
                    self.scheduler.step()
                except Exception:                          # noqa: BLE001 - it ended every request in flight,
                    pass                                   # whose owners raise it (Request.error)
                finally:
                    self._stepping = False
                    while self._cancelled_in_step:
                        self.scheduler.cancel(self._cancelled_in_step.pop())
            return all(r.finish_reason is not None for r in requests)

    def progress(self, request: Request, seen: int = 0) -> tuple[list[int], bool]:
        """(the tokens `request` generated after its first `seen`, whether it has ended), as of one moment."""
        with self._lock:
            return request.tokens[len(request.prompt) + seen:], request.finish_reason is not None

    def _result(self, r: Request) -> GenerationResult:
        self._count(r)
        ids = r.generated
        text = final_text(self.tokenizer, ids, r.params.stop) if self.tokenizer is not None else None
        return GenerationResult(r.prompt, ids, text, r.finish_reason or "", r.metrics.to_dict(),
                                r.logprobs if r.params.logprobs is not None else None,
                                r.prompt_logprobs if r.params.prompt_logprobs is not None else None)

    def _count(self, r: Request) -> None:
        """Add an ended request to the totals, or raise the error of the failed step that ended it."""
        if r.error is not None:
            raise r.error
        with self._lock:
            self.totals.merge(r.metrics)

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None) -> list[GenerationResult]:
        """Generate for every prompt (text or token ids), batched together; results in prompt order.

        `sampling` is one SamplingParams for all prompts or one per prompt. A bad prompt raises RequestError
        before anything is queued."""
        if isinstance(prompts, str) or (len(prompts) > 0 and is_integer(prompts[0])):
            prompts = [prompts]
        if sampling is None or isinstance(sampling, SamplingParams):
            sampling = [sampling or SamplingParams()] * len(prompts)
        if len(sampling) != len(prompts):
            raise RequestError(f"{len(prompts)} prompts but {len(sampling)} sampling parameter sets")
        encoded = [self.encode(p) for p in prompts]
        for ids, s in zip(encoded, sampling):       # everything checked before anything is queued
            self.check(ids, s)
        requests = [self.submit(ids, s) for ids, s in zip(encoded, sampling)]
        try:
            while not self.advance(requests):
                pass
        finally:                                   # an interrupt mid-way must not leave requests holding caches
            for r in requests:
                self.cancel(r)
        return [self._result(r) for r in requests]

    def chat(self, messages: Sequence[Mapping[str, Any]], sampling: SamplingParams | None = None, *,
             tools: list | None = None, thinking: bool = False, reasoning_effort: str | None = None,
             profile: str | None = None) -> ChatResult:
        """One assistant turn: the messages through DeepSeek-V4's chat encoding (thinking or chat mode, the
        release's reasoning efforts: `profile`, by default the chat_profile property), the answer parsed into
        reasoning, content and tool calls. RequestError names a message the encoder cannot render."""
        profile = profile or self.chat_profile
        try:
            prompt = encode_messages(declare_tools(messages, tools), thinking=thinking,
                                     reasoning_effort=reasoning_effort, profile=profile)
        except ChatError as e:
            raise RequestError(str(e)) from None
        sampling = sampling or SamplingParams()
        [result] = self.generate([prompt], sampling)
        return ChatResult(prompt, result, parse_answer(self.answer_text(result.token_ids, sampling),
                                                       thinking=thinking))

    @property
    def chat_profile(self) -> str:
        """The release whose chat encoding the engine's checkpoint ships (engine.json), or DEFAULT_PROFILE."""
        return self.manifest.chat_profile or DEFAULT_PROFILE

    def answer_text(self, ids: Sequence[int], sampling: SamplingParams) -> str:
        """The text of generated ids as the chat parser reads it: special tokens kept, cut at the first stop
        string (the token that ended a request is never among its ids)."""
        return final_text(SpecialTokensKept(self.tokenizer), ids, sampling.stop)

    def stream(self, prompt: Prompt, sampling: SamplingParams | None = None) -> Iterator[list[int]]:
        """Yield the token ids the request gains until it ends: one to k+1 per step (more when other callers'
        steps came in between). The lock is never held across a yield; a stream closed or dropped before its
        end cancels its request."""
        request = self.submit(prompt, sampling or SamplingParams())
        seen, ended = 0, False
        try:
            while not ended:
                self.advance([request])
                tokens, ended = self.progress(request, seen)
                seen += len(tokens)
                if tokens and request.error is None:
                    yield tokens
        finally:
            self.cancel(request)
        self._count(request)
