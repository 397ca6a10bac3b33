"""Continuous batching: rows in different phases share engine calls and every request still gets exactly the
tokens of running it alone; caches are allocated exactly as engine.json accounts for them."""
from __future__ import annotations

import json

from pathlib import Path

import pytest
import torch

from v4engine.contract.backend_options import OnnxRuntimeSessionOptions
from v4engine.contract.calls import Call
from v4engine.runtime.budget import Limits
from v4engine.runtime.generator import Generator
from v4engine.runtime.sampling import RequestError, SamplingParams
from v4engine.runtime.scheduler import CapacityError, Phase
from v4engine.runtime.sessions.onnxruntime import ARENA_KEPT_ROWS, SHRINK_ARENA, OnnxRuntimeSession

GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)


def prompts(vocab: int, lengths: list[int]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module")
def engine(tiny_engine):
    return tiny_engine("mixed", agree=0.05)[1]


def test_mixed_phases_in_one_call_and_requests_joining_and_leaving(engine):
    solo = Generator.from_engine_dir(engine, mtp=3)
    cfg = solo.manifest.model
    ps = prompts(cfg.vocab_size, [7, 3, 11, 5, 9])
    lengths = [4, 12, 7, 12, 3]
    alone = [solo.generate([p], SamplingParams(max_new_tokens=n, ignore_eos=True))[0].token_ids
             for p, n in zip(ps, lengths)]

    gen = Generator.from_engine_dir(engine, mtp=3, limits=Limits(max_prefill_chunk=3))
    scheduler = gen.scheduler
    requests, mixed_call_seen = [], False
    arrivals = {0: [0, 1], 2: [2], 4: [3], 7: [4]}                   # step -> requests that join then
    step = 0
    while step < 200 and (scheduler.busy or any(s >= step for s in arrivals)):
        for i in arrivals.get(step, []):
            requests.append((i, scheduler.submit(ps[i], SamplingParams(max_new_tokens=lengths[i], ignore_eos=True))))
        phases = {r.phase for _, r in requests if r.phase in (Phase.PREFILL, Phase.DECODE)}
        mixed_call_seen |= phases == {Phase.PREFILL, Phase.DECODE}
        scheduler.step()
        step += 1
    assert mixed_call_seen, "a prefill chunk ran beside verify rows in one target call"
    for i, r in requests:
        assert r.generated == alone[i], f"request {i}"


def test_chunks_longer_than_a_verify_run_in_calls_of_their_own(engine):
    """Beside a 16-token chunk every verify row would be padded to 16 positions; so would every draft cycle beside
    the drafter's catch-up on a prompt (engine_calls.apart_by_length). The tokens are those of running alone."""
    solo = Generator.from_engine_dir(engine, mtp=3)
    ps = prompts(solo.manifest.model.vocab_size, [5, 40])
    longer = SamplingParams(max_new_tokens=40, ignore_eos=True)
    alone = [solo.generate([p], longer)[0].token_ids for p in ps]

    gen = Generator.from_engine_dir(engine, mtp=3, limits=Limits(max_prefill_chunk=16))
    scheduler, calls = gen.scheduler, []
    first = scheduler.submit(ps[0], longer)
    while first.phase != Phase.DECODE:
        scheduler.step()
    scheduler.calls.on_call = lambda kind, shape, seconds: calls.append((kind, shape))
    second = scheduler.submit(ps[1], longer)
    while scheduler.busy:
        scheduler.step()
    assert [shape for kind, shape in calls if kind == Call.PREFILL] == [(1, 16), (1, 16), (1, 8)]
    assert all(shape[0] == 1 for kind, shape in calls if kind in (Call.PREFILL, Call.EXTEND)), \
        "the drafter's catch-ups on the prompts ran apart from the other row's cycle"
    assert (Call.VERIFY, (2, 4)) in calls and (Call.CYCLE, (2, 4)) in calls, "decoding together, they share calls"
    assert [first.generated, second.generated] == alone


def test_a_request_holds_a_slot_and_only_the_blocks_its_positions_need(engine):
    gen = Generator.from_engine_dir(engine, mtp=3, limits=Limits(max_batch=8))
    manifest, scheduler = gen.manifest, gen.scheduler
    written = json.loads((engine / "engine.json").read_text())["caches"]["groups"]
    pool = scheduler.pools["target"]
    assert pool.slot_bytes == sum(g["fixed_bytes"] for g in written["target"])
    assert pool.block_bytes == sum(g["block_rows"] * g["width"] * g["value_bytes"] for g in written["target"])
    requests = [scheduler.submit(p, GREEDY) for p in prompts(manifest.model.vocab_size, [10] * 8)]
    scheduler.step()                                                   # admitted, prefilled: 10 positions held
    block_tokens = manifest.caches["target"].block_tokens
    for r in requests:
        assert r.target.length == 10 and len(r.target.blocks) == -(-10 // block_tokens)
        assert r.target.nbytes == pool.slot_bytes + len(r.target.blocks) * pool.block_bytes
    assert scheduler.used_bytes == sum(c.nbytes for r in requests for c in scheduler.caches(r))
    # eight short requests hold a small part of a budget sized for eight of max_seq_len
    assert scheduler.used_bytes * 20 < scheduler.budget
    while scheduler.busy:
        scheduler.step()
    assert scheduler.used_bytes == 0 and pool.free_blocks + int((pool.refs > 0).sum()) == len(pool.refs)


def test_a_request_that_does_not_draft_gets_no_draft_cache_and_is_charged_none(engine):
    gen = Generator.from_engine_dir(engine, mtp=3)
    scheduler = gen.scheduler
    plain = scheduler.submit(prompts(gen.manifest.model.vocab_size, [10])[0], SamplingParams(num_draft_tokens=0))
    scheduler.step()
    assert scheduler.caches(plain) == [plain.target] and plain.target.nbytes == scheduler.used_bytes


def budget_for(gen: Generator, batch: int, blocks: int) -> int:
    """A cache budget of `batch` slots and `blocks` blocks."""
    return batch * gen.scheduler.cache_bytes(0) + blocks * gen.scheduler.pools["target"].block_bytes


def test_a_request_that_cannot_fit_is_refused_before_anything_runs(engine):
    probe = Generator.from_engine_dir(engine, mtp=3)
    one = budget_for(probe, 2, probe.scheduler.blocks_for(40 + 12 + 4))
    gen = Generator.from_engine_dir(engine, mtp=3, prefix_cache=False, limits=Limits(max_batch=2, max_cache_bytes=one))
    cfg = gen.manifest.model
    running = gen.scheduler.submit(prompts(cfg.vocab_size, [40])[0], GREEDY)
    gen.scheduler.step()
    steps = gen.scheduler.engine_steps
    with pytest.raises(CapacityError, match="bytes of cache"):
        gen.scheduler.submit(prompts(cfg.vocab_size, [400])[0], SamplingParams(max_new_tokens=300))
    assert gen.scheduler.engine_steps == steps and len(gen.scheduler.waiting) == 0
    second = gen.scheduler.submit(prompts(cfg.vocab_size, [40])[0], GREEDY)    # fits, but only after the first
    while gen.scheduler.busy:
        gen.scheduler.step()
        assert gen.scheduler.used_bytes <= one
    assert len(running.generated) == len(second.generated) == GREEDY.max_new_tokens


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_when_the_pool_runs_out_the_newest_requests_are_preempted_and_recompute_exactly(engine, temperature):
    solo = Generator.from_engine_dir(engine, mtp=3, prefix_cache=False)
    cfg = solo.manifest.model
    ps = prompts(cfg.vocab_size, [30, 21, 35, 9])
    params = [SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=temperature, seed=i) for i in range(4)]
    alone = [solo.generate([p], s)[0] for p, s in zip(ps, params)]
    # four batch rows, blocks for about two of the requests at their longest
    budget = budget_for(solo, 4, 2 * solo.scheduler.blocks_for(35 + 28))
    small = Generator.from_engine_dir(engine, mtp=3, prefix_cache=False, limits=Limits(max_batch=4, max_cache_bytes=budget))
    results = small.generate(ps, params)
    assert sum(r.metrics["preemptions"] for r in results) > 0, "the pool ran out"
    assert results[0].metrics["preemptions"] == 0, "the oldest request always progresses"
    for got, want in zip(results, alone):
        assert got.token_ids == want.token_ids
        assert got.metrics["accepted_per_step"] == want.metrics["accepted_per_step"]
    assert small.scheduler.used_bytes == 0


def test_streaming_yields_accepted_tokens_as_they_come(engine):
    gen = Generator.from_engine_dir(engine, mtp=3)
    p = prompts(gen.manifest.model.vocab_size, [8])[0]
    chunks = list(gen.stream(p, GREEDY))
    assert sum(chunks, []) == gen.generate([p], GREEDY)[0].token_ids
    assert len(chunks) < GREEDY.max_new_tokens, "several tokens per step when drafts are accepted"


@pytest.mark.parametrize("bad, message", [
    (dict(prompt=[]), "empty"),
    (dict(prompt=[5, 10_000]), "outside the vocabulary"),
    (dict(prompt=[1] * 5000), "at most"),
    (dict(params=SamplingParams(max_new_tokens=0)), "max_new_tokens"),
    (dict(params=SamplingParams(temperature=-1.0)), "temperature"),
])
def test_bad_requests_are_refused_and_others_keep_running(engine, bad, message):
    gen = Generator.from_engine_dir(engine, mtp=3)
    good = gen.scheduler.submit([3, 4, 5, 6], GREEDY)
    gen.scheduler.step()
    with pytest.raises(RequestError, match=message):
        gen.generate([bad.get("prompt", [7, 8, 9])], bad.get("params", GREEDY))
    while gen.scheduler.busy:
        gen.scheduler.step()
    assert len(good.generated) == GREEDY.max_new_tokens


def test_stop_token_ids_and_eos_end_a_request(engine):
    gen = Generator.from_engine_dir(engine, mtp=3)
    p = prompts(gen.manifest.model.vocab_size, [9])[0]
    free = gen.generate([p], GREEDY)[0].token_ids
    stop_at = free[5]
    first = free.index(stop_at)
    stopped = gen.generate([p], SamplingParams(max_new_tokens=12, ignore_eos=True, stop_token_ids=(stop_at,)))[0]
    assert stopped.token_ids == free[:first] and stopped.finish_reason == "stop"
    eos = gen.manifest.model.eos_token_id
    with_eos = gen.generate([p], SamplingParams(max_new_tokens=12))[0]
    assert eos not in with_eos.token_ids
    assert with_eos.token_ids == free[:free.index(eos)] if eos in free else with_eos.token_ids == free


def test_stop_strings_cut_the_text(engine, tmp_path):
    import shutil

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = {f"w{i}": i for i in range(Generator.from_engine_dir(engine).manifest.model.vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    with_text = Path(shutil.copytree(engine, tmp_path / "engine", symlinks=True))
    tokenizer.save(str(with_text / "tokenizer.json"))
    gen = Generator.from_engine_dir(with_text, mtp=3)
    free = gen.generate(["w3 w4 w5 w6"], GREEDY)[0]
    stop = f"w{free.token_ids[4]}"
    cut = gen.generate(["w3 w4 w5 w6"], SamplingParams(max_new_tokens=12, ignore_eos=True, stop=(stop,)))[0]
    assert free.text.startswith(cut.text) and stop not in cut.text and cut.finish_reason == "stop"
    assert len(cut.token_ids) <= 5


def test_a_request_that_reaches_max_seq_len_ends_with_length(engine):
    gen = Generator.from_engine_dir(engine, mtp=3, limits=Limits(max_seq_len=16))
    [r] = gen.generate([list(range(3, 15))], SamplingParams(max_new_tokens=20, ignore_eos=True))
    assert r.finish_reason == "length" and len(r.prompt_token_ids) + len(r.token_ids) == 16


def test_sampling_without_drafting_and_prompt_forms(engine):
    import numpy as np

    gen = Generator.from_engine_dir(engine, mtp=0)
    params = SamplingParams(max_new_tokens=5, temperature=0.8, seed=3, ignore_eos=True)
    [a] = gen.generate([np.array([3, 4, 5])], params)
    [b] = gen.generate([[np.int64(3), np.int64(4), np.int64(5)]], params)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 5
    with pytest.raises(RequestError, match="sampling parameter sets"):
        gen.generate([[3, 4], [5, 6]], [params])
    assert not gen.scheduler.busy


def test_each_request_drafts_its_own_number_of_tokens_in_one_batch(engine):
    """num_draft_tokens per request: 0..k drafts side by side in the same calls, tokens unchanged (lossless)."""
    gen = Generator.from_engine_dir(engine, mtp=3)
    p = prompts(gen.manifest.model.vocab_size, [9])[0]
    alone = gen.generate([p], GREEDY)[0].token_ids
    results = gen.generate([p] * 4, [SamplingParams(max_new_tokens=12, ignore_eos=True, num_draft_tokens=k)
                                     for k in range(4)])
    for k, r in enumerate(results):
        assert r.token_ids == alone, f"num_draft_tokens={k}"
        assert len(r.metrics["per_position_acceptance"]) == k
        assert r.metrics["drafted"] <= k * r.metrics["verify_steps"]
    assert results[0].metrics["drafted"] == 0 and results[3].metrics["drafted"] > results[1].metrics["drafted"]
    with pytest.raises(RequestError, match="num_draft_tokens must be an integer from 0 to 3"):
        gen.generate([p], SamplingParams(num_draft_tokens=4))


def test_prompts_run_in_chunks_of_at_most_256_tokens_on_the_cpu_unless_asked_otherwise(engine):
    """ONNX Runtime's arena on the CPU keeps what a 512-token prefill chunk needed, for as good as no speed over
    256 (RESULTS.md): 256 is the default there, within the engine's limit; a chunk the caller names is kept, and
    other devices get the engine's."""
    assert Generator.from_engine_dir(engine).manifest.limits["max_prefill_chunk"] == 512
    assert Generator.from_engine_dir(engine).scheduler.max_prefill_chunk == 256
    assert Generator.from_engine_dir(engine, limits=Limits(max_prefill_chunk=512)).scheduler.max_prefill_chunk == 512
    assert Generator.from_engine_dir(engine, limits=Limits(max_prefill_chunk=100)).scheduler.max_prefill_chunk == 100
    gpu = OnnxRuntimeSessionOptions(providers=("CUDAExecutionProvider", "CPUExecutionProvider"))
    assert OnnxRuntimeSession.prefill_chunk(gpu, None) is None
    assert OnnxRuntimeSession.prefill_chunk(OnnxRuntimeSessionOptions(), [0]) is None


class RunOptionsSeen:
    """An ONNX Runtime session that notes, per call, its token rows and whether it gave its arena back."""

    def __init__(self, session):
        self.session, self.calls = session, []

    def run(self, names, feeds, options=None):
        try:
            shrink = options.get_run_config_entry(SHRINK_ARENA)
        except (AttributeError, RuntimeError):          # no options, or none of that entry
            shrink = None
        self.calls.append((feeds["input_ids"].size, shrink))
        return self.session.run(names, feeds, options)


def test_on_the_cpu_what_a_prompt_grew_in_the_arena_is_given_back_after_it_and_decodes_keep_their_own(engine):
    """ONNX Runtime's CPU arena keeps the most any call needed, so the first call of at most ARENA_KEPT_ROWS token
    rows after longer ones (a prompt's chunks) frees at its end what they grew; the chunks before it and the decodes
    or verifies after it keep their regions (RESULTS.md)."""
    generator = Generator.from_engine_dir(engine, mtp=3, limits=Limits(max_prefill_chunk=ARENA_KEPT_ROWS + 1))
    seen = generator.scheduler.target_session._session = RunOptionsSeen(generator.scheduler.target_session._session)
    generator.generate(prompts(64, [3 * ARENA_KEPT_ROWS]), GREEDY)
    chunks = [i for i, (rows, _) in enumerate(seen.calls) if rows > ARENA_KEPT_ROWS]
    assert len(chunks) == 2 and chunks[-1] + 1 < len(seen.calls) - 2
    assert [i for i, (_, shrink) in enumerate(seen.calls) if shrink == "cpu:0"] == [chunks[-1] + 1]
