"""Every drafting method behind the drafter seam (runtime/drafters/) keeps what speculative decoding promises,
held here for each entry of DRAFTERS, so a new method is held to it by being registered: greedy tokens equal those
of no drafting, solo or batched; a prefix-cache fork gives the cold tokens and acceptance; a preempted request
recomputes exactly; nothing is held once requests end. Each method with a draft graph is complete: a DraftSpec,
an export and a runtime drafter."""
from __future__ import annotations

import pytest

from v4engine.builder.export import DRAFT_FORWARDS
from v4engine.contract.drafting import DRAFT_SPECS
from v4engine.runtime.budget import Limits
from v4engine.runtime.drafters import DRAFTERS
from v4engine.runtime.generator import Generator
from v4engine.runtime.sampling import SamplingParams

GREEDY = SamplingParams(max_new_tokens=32, ignore_eos=True)
TOKENS = {"mtp": (1, 3), "prompt_lookup": (1, 3, 5), "dspark": (1, 3, 7)}       # k per method on its engine


@pytest.fixture
def engine_of(request, trained_engine):
    """engine_of(method): an engine the method drafts on: the trained tiny V4 (built --mtp 3), or for DSpark a tiny
    DSpark checkpoint whose drafts are often accepted (make-tiny --drafter dspark --agree 0.1, built --mtp 7)."""
    def get(method: str):
        if method == "dspark":
            return request.getfixturevalue("tiny_engine")("mixed", mtp=7, drafter="dspark", agree=0.1)[1]
        return trained_engine

    return get


def test_every_drafting_method_with_a_graph_is_complete():
    for method, spec in DRAFT_SPECS.items():
        assert spec.method == method and method in DRAFT_FORWARDS, f"{method}: no export"
        assert method in DRAFTERS and DRAFTERS[method].has_graph, f"{method}: no runtime drafter"
    assert {m for m, d in DRAFTERS.items() if d.has_graph} == set(DRAFT_SPECS)
    assert set(TOKENS) == set(DRAFTERS), "every registered drafter is exercised below"


def prompts(engine) -> list[list[int]]:
    """Held-out-like Python that repeats its own context (every drafter has something to draft)."""
    tokenizer = Generator.from_engine_dir(engine, mtp=0).tokenizer
    texts = ["class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n    def "
             "__repr__(self):\n        return f'Point({self.x}, {self.y})'\n\n    def __eq__(self, other):\n",
             "for i in range(10):\n    print(i)\nfor j in range(10):\n    print(", "import os\n"]
    return [tokenizer.encode(t).ids for t in texts]


@pytest.mark.parametrize("drafter, k", [(d, k) for d in sorted(TOKENS) for k in TOKENS[d]])
def test_greedy_tokens_equal_no_drafting_solo_and_batched(engine_of, drafter, k):
    engine = engine_of(drafter)
    ps = prompts(engine)
    plain = [r.token_ids for r in Generator.from_engine_dir(engine, mtp=0).generate(ps, GREEDY)]
    # every draft verified: rollback is what this exercises (confidence scheduling may rightly verify none at k = 1;
    # tests/test_verify_schedule.py checks its tokens)
    generator = Generator.from_engine_dir(engine, drafter=drafter, mtp=k, confidence_scheduling=False)
    assert [r.token_ids for r in generator.generate(ps, GREEDY)] == plain
    assert [generator.generate([p], GREEDY)[0].token_ids for p in ps] == plain
    assert generator.totals.accepted > 0, "its drafts are accepted: rollback is exercised"
    assert generator.scheduler.used_bytes == 0 and not generator.scheduler.active, "nothing held afterwards"


# every draft verified: confidence scheduling's widths depend on the batch, which the preemption changes
FIXED = {"confidence_scheduling": False}


@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
def test_a_prefix_fork_and_a_preemption_give_the_cold_tokens(engine_of, drafter):
    engine = engine_of(drafter)
    ps = prompts(engine)
    long = ps[0] * 3                       # past a cache block: prefix entries are taken
    params = [SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=t, seed=i)
              for i, t in enumerate((0.0, 1.0, 1.0))]
    cold = Generator.from_engine_dir(engine, drafter=drafter, prefix_cache=False, **FIXED)
    want = [cold.generate([p], s)[0] for p, s in zip([long] + ps[1:], params)]
    warm = Generator.from_engine_dir(engine, drafter=drafter, **FIXED)
    warm.generate([long + ps[2]], params[0])
    for sampling in params[:2]:                          # greedy, and sampled
        got, alone = warm.generate([long], sampling)[0], cold.generate([long], sampling)[0]
        assert got.metrics["prefix_hit_tokens"] > 0
        assert (got.token_ids, got.metrics["accepted_per_step"]) == \
            (alone.token_ids, alone.metrics["accepted_per_step"])
    probe = cold.scheduler
    # three batch rows, and blocks for the longest request alone at its longest: the others wait or are preempted
    budget = 3 * probe.cache_bytes(0) + probe.blocks_for(len(long) + 24 + 4) * probe.pools["target"].block_bytes
    small = Generator.from_engine_dir(engine, drafter=drafter, prefix_cache=False, **FIXED,
                                      limits=Limits(max_batch=3, max_cache_bytes=budget))
    results = small.generate([long] + ps[1:], params)
    assert sum(r.metrics["preemptions"] for r in results) > 0, "the pool ran out"
    assert [(r.token_ids, r.metrics["accepted_per_step"]) for r in results] == \
        [(r.token_ids, r.metrics["accepted_per_step"]) for r in want]


@pytest.mark.parametrize("method", ["mtp", "dspark"])
def test_a_long_prompt_leaves_a_draft_graph_only_the_rows_its_rings_read(engine_of, method):
    """A drafter with a graph keeps, of a prompt's target rows, only those a draft cycle can still read (R + 1 for
    rings of R rows, at most twice that between cycles), copied out of the target's outputs: not the rows of every
    prompt position until its first draft cycle. Its tokens are those of no drafting."""
    engine = engine_of(method)
    generator = Generator.from_engine_dir(engine, drafter=method, limits=Limits(max_prefill_chunk=16))
    layout = generator.scheduler.drafter.parts["draft"]
    read = max(g.rows_fixed for g in layout.groups) + 1
    prompt = prompts(engine)[0] * 4                                   # longer than twice the rows read
    assert len(prompt) > 2 * read
    request = generator.submit(prompt, GREEDY)
    while not request.generated:                                      # the prefill, in chunks of 16
        generator.advance([request])
    state = request.draft_state
    assert read <= sum(len(p) for p in state.pending) <= 2 * read
    assert all(p.base is None for p in state.pending[:1]), "the kept rows are copies, not views of an output"
    assert state.cache.length + sum(len(p) for p in state.pending) == len(prompt)
    while not generator.advance([request]):
        pass
    plain = Generator.from_engine_dir(engine, mtp=0).generate([prompt], GREEDY)[0].token_ids
    assert request.tokens[len(prompt):] == plain
