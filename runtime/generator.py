"""The user-facing API: load an engine directory and generate, drafting with the MTP layer.

    gen = Generator.from_engine_dir("out/engine")
    [result] = gen.generate(["def fib(n):"], SamplingParams(max_new_tokens=32))
    print(result.text, result.metrics["mean_acceptance_length"])
    for token_ids in gen.stream("def fib(n):", SamplingParams(max_new_tokens=32)): ...
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .detokenize import final_text
from .engine import EngineManifest
from .metrics import RequestMetrics
from .sampling import RequestError, SamplingParams
from .scheduler import Request, Scheduler
from .sessions import open_session

Prompt = str | Sequence[int]


def load_tokenizer(engine_dir: str | Path):
    """The engine directory's tokenizer.json as a `tokenizers.Tokenizer`, or None when it has none."""
    path = Path(engine_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def encode_text(tokenizer, text: str) -> list[int]:
    """A prompt's token ids: the text as it is, no special tokens added (the prompt says what it holds)."""
    return tokenizer.encode(text, add_special_tokens=False).ids


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str
    metrics: dict


SHAPE_SPECIALIZED = ("tensorrt", "migraphx")       # engines built for shapes up to engine.json's limits


class Generator:
    def __init__(self, engine_dir: Path, manifest: EngineManifest, scheduler: Scheduler, tokenizer=None):
        self.engine_dir, self.manifest, self.scheduler, self.tokenizer = engine_dir, manifest, scheduler, tokenizer
        self.totals = RequestMetrics(mtp=scheduler.mtp)

    @classmethod
    def from_engine_dir(cls, path: str | Path, backend: str | None = None, mtp: int | None = None,
                        max_batch: int | None = None, max_seq_len: int | None = None,
                        max_cache_bytes: int | None = None,
                        max_prefill_chunk: int | None = None, threads: int | None = None,
                        providers: list[str] | None = None) -> "Generator":
        """Open an engine directory. mtp (<= the engine's k, 0 disables drafting) defaults to the engine's.

        providers: ONNX Runtime execution providers, e.g. ["CUDAExecutionProvider", "CPUExecutionProvider"] with
        onnxruntime-gpu installed (default: the CPU). max_batch, max_seq_len and max_prefill_chunk (prompt tokens per
        engine call) default to the engine's; TensorRT and MIGraphX engines were built for shapes up to those, so
        larger values are refused here rather than in the middle of a generation."""
        path = Path(path)
        manifest = EngineManifest.read(path)
        if backend is not None and backend != manifest.backend:
            raise RequestError(f"{path} is a {manifest.backend} engine; it cannot run on backend {backend!r}")
        built = manifest.limits
        asked = {"max_batch": max_batch or built["max_batch"], "max_seq_len": max_seq_len or built["max_seq_len"],
                 "max_prefill_chunk": max_prefill_chunk or built["max_prefill_chunk"]}
        if manifest.backend in SHAPE_SPECIALIZED:
            for name, value in asked.items():
                if value > built[name]:
                    raise RequestError(f"{path}: {name} {value} exceeds the {built[name]} this {manifest.backend} "
                                       "engine was built for (rebuild with a larger one)")
        mtp = manifest.mtp if mtp is None else mtp
        if not 0 <= mtp <= manifest.mtp:
            raise RequestError(f"mtp must be between 0 and the engine's {manifest.mtp} (got {mtp})")
        options = {k: v for k, v in (("threads", threads), ("providers", providers)) if v}
        if mtp:
            options["alternating"] = True                  # target and draft calls take turns on the same cores
        target = open_session(path, manifest, "target", **options)
        draft = open_session(path, manifest, "draft", **options) if mtp else None
        scheduler = Scheduler(manifest, target, draft, mtp, max_cache_bytes=max_cache_bytes, **asked)
        return cls(path, manifest, scheduler, load_tokenizer(path))

    # ------------------------------------------------------------------ prompts and text
    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError(f"{self.engine_dir} has no tokenizer.json; pass token ids instead of text")
            return encode_text(self.tokenizer, prompt)
        return [int(t) for t in prompt]

    def submit(self, prompt: Prompt, sampling: SamplingParams) -> Request:
        """Queue one request in the scheduler (stop strings included); the caller steps the scheduler."""
        request = self.scheduler.submit(self.encode(prompt), sampling)
        if sampling.stop and self.tokenizer is not None:
            request.stop_check = lambda ids: any(s in self.tokenizer.decode(ids) for s in sampling.stop)
        return request

    def _result(self, r: Request) -> GenerationResult:
        ids = r.generated
        text = final_text(self.tokenizer, ids, r.params.stop) if self.tokenizer is not None else None
        self.totals.merge(r.metrics)
        return GenerationResult(r.prompt, ids, text, r.finish_reason or "", r.metrics.to_dict())

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None) -> list[GenerationResult]:
        """Generate for every prompt (text or token ids), batched together; results in prompt order.

        `sampling` is one SamplingParams for all prompts or one per prompt. A bad prompt raises RequestError
        before anything is queued."""
        if isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]
        if sampling is None or isinstance(sampling, SamplingParams):
            sampling = [sampling or SamplingParams()] * len(prompts)
        if len(sampling) != len(prompts):
            raise RequestError(f"{len(prompts)} prompts but {len(sampling)} sampling parameter sets")
        encoded = [self.encode(p) for p in prompts]
        for ids, s in zip(encoded, sampling):       # everything checked before anything is queued
            self.scheduler.validate(ids, s)
        requests = [self.submit(ids, s) for ids, s in zip(encoded, sampling)]
        try:
            while any(r.finish_reason is None for r in requests):
                self.scheduler.step()
        finally:                                   # an error mid-way must not leave requests holding caches
            for r in requests:
                if r.finish_reason is None:
                    self.scheduler.cancel(r)
        return [self._result(r) for r in requests]

    def stream(self, prompt: Prompt, sampling: SamplingParams | None = None) -> Iterator[list[int]]:
        """Yield the token ids each step accepts (one to k+1 at a time) until the request finishes."""
        request = self.submit(prompt, sampling or SamplingParams())
        try:
            while request.finish_reason is None:
                step = self.scheduler.step()
                if step.new_tokens.get(request.id):
                    yield step.new_tokens[request.id]
        finally:
            if request.finish_reason is None:
                self.scheduler.cancel(request)
            else:
                self.totals.merge(request.metrics)
