"""ServingLoop: concurrent asyncio callers share one scheduler stepped by a background thread; each still gets
exactly its solo tokens; a full queue refuses at once; a cancelled request leaves the scheduler at the next step."""
from __future__ import annotations

import asyncio

import pytest

from v4engine.runtime.budget import Limits
from v4engine.runtime.generator import Generator
from v4engine.runtime.sampling import RequestError, SamplingParams
from v4engine.runtime.serving import QueueFullError, ServingLoop

PROMPTS = ["def fib(n):", "import os", "class Stack:", "for i in range(10):"]
PARAMS = SamplingParams(max_new_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def generator(trained_engine) -> Generator:
    return Generator.from_engine_dir(trained_engine, limits=Limits(max_batch=4))


async def collect(serving: ServingLoop, prompt, params=PARAMS) -> tuple[list[int], int, str]:
    stream = serving.submit(prompt, params)
    tokens, updates = [], 0
    async for update in stream:
        tokens += update.tokens
        updates += 1
    return tokens, updates, stream.request.finish_reason


def serve(generator: Generator, coroutine, max_queue_size: int = 4):
    async def run():
        serving = ServingLoop(generator, max_queue_size=max_queue_size)
        try:
            return await coroutine(serving)
        finally:
            serving.close()
    return asyncio.run(run())


def test_concurrent_requests_share_steps_and_get_their_solo_tokens(generator):
    before = generator.scheduler.engine_steps
    solo = [generator.generate([p], PARAMS)[0].token_ids for p in PROMPTS]
    one_after_another = generator.scheduler.engine_steps - before
    before = generator.scheduler.engine_steps
    results = serve(generator, lambda s: asyncio.gather(*(collect(s, p) for p in PROMPTS)))
    assert [tokens for tokens, _, _ in results] == solo
    assert all(reason == "length" and updates > 1 for _, updates, reason in results)
    assert generator.scheduler.engine_steps - before < one_after_another / 2, "the requests shared engine calls"


def test_a_full_queue_refuses_at_once_and_the_rest_is_served(generator):
    async def flood(serving):
        return await asyncio.gather(*(collect(serving, p) for p in PROMPTS * 2), return_exceptions=True)
    results = serve(generator, flood, max_queue_size=1)                # 4 running + 1 waiting
    refused = [r for r in results if isinstance(r, QueueFullError)]
    assert len(refused) == 3 and "max_queue_size" in str(refused[0])
    assert all(isinstance(r, tuple) and len(r[0]) == PARAMS.max_new_tokens for r in results if r not in refused)


def test_cancelled_requests_stop_at_the_next_step(generator):
    long = SamplingParams(max_new_tokens=500, ignore_eos=True)
    flag = {"cancelled": False}

    async def cancel_both(serving):
        by_call = serving.submit(PROMPTS[0], long)
        by_callback = serving.submit(PROMPTS[1], long, is_cancelled=lambda: flag["cancelled"])
        async for _ in by_call:
            serving.cancel(by_call)
            flag["cancelled"] = True
        async for _ in by_callback:
            pass
        return by_call.request, by_callback.request

    requests = serve(generator, cancel_both)
    assert [r.finish_reason for r in requests] == ["cancelled", "cancelled"]
    assert all(len(r.generated) < 40 for r in requests) and not generator.scheduler.busy


def test_a_bad_request_is_refused_at_submit(generator):
    async def bad(serving):
        with pytest.raises(RequestError, match="num_draft_tokens"):
            serving.submit(PROMPTS[0], SamplingParams(num_draft_tokens=9))
        return await collect(serving, PROMPTS[0])
    tokens, _, _ = serve(generator, bad)
    assert len(tokens) == PARAMS.max_new_tokens
