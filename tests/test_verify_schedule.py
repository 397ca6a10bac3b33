"""Confidence-scheduled verification (runtime/verify_schedule.py): the widths it picks are the ones that pay, its
profile is measured once and read back, and the tokens never change."""
from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from v4engine.runtime import verify_schedule
from v4engine.runtime.budget import Limits
from v4engine.runtime.drafters import Proposal
from v4engine.runtime.generator import Generator
from v4engine.runtime.sampling import RequestError, SamplingParams
from v4engine.runtime.verify_schedule import StepCosts, VerifyPlanner, recorded_costs, survival
from v4engine.triton_repo import RenderError, render

GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)


def costs(draft: float, verify_per_token: float, widths: int = 6, switch: float = 0.0, prefill: float = 1e-3,
          catch_up: float = 0.0) -> StepCosts:
    """A hand-made profile: batches 1 and 8; a target call costs 1 ms plus verify_per_token per row and token (a
    plain decode as a verify of width 1); turning drafting on costs `switch` more at either batch; a prefill call
    `prefill` plus 1 ms a prompt (so 8 prompts one by one cost 7 `prefill` more than together); the drafter's
    catch-up on the prompts of new rows `catch_up` a call."""
    return StepCosts((1, 8), tuple(1e-3 + verify_per_token * b for b in (1, 8)), (draft, 8 * draft),
                     tuple(tuple(1e-3 + verify_per_token * b * w for w in range(1, widths + 1)) for b in (1, 8)),
                     (switch, switch), (prefill + 1e-3, prefill + 8e-3), (catch_up, catch_up))


def row(confidence: list[float], params: SamplingParams = GREEDY) -> SimpleNamespace:
    """A decoding request as the planner sees it: its proposal (with confidences), its last survivals, its
    sampling, its tokens so far."""
    return SimpleNamespace(proposal=Proposal(list(range(len(confidence))), confidence=np.array(confidence)),
                           survival=None, params=params, generated=[])


# ---------------------------------------------------------------------- the choice
def test_survival_is_the_running_product_of_the_confidences():
    assert survival(np.array([0.9, 0.5, 0.2])) == pytest.approx([0.9, 0.45, 0.09])


@pytest.mark.parametrize("draft, per_token", [(1e-4, 1e-5), (1e-4, 1e-3), (2e-3, 1e-4), (1e-5, 5e-2)])
def test_the_chosen_width_maximises_expected_tokens_per_second_by_brute_force(draft, per_token):
    rng = np.random.default_rng(0)
    planner = VerifyPlanner(costs(draft, per_token))
    for _ in range(20):
        confidences = [list(rng.uniform(0, 1, 5)) for _ in range(int(rng.integers(1, 9)))]
        S = [survival(np.array(c)) for c in confidences]
        B = len(S)
        rates = [(B + sum(s[:w].sum() for s in S)) / (planner.costs.at("draft", B) + planner.costs.verify_at(B, w + 1))
                 for w in range(6)]
        assert rates[planner.best_width(S)] == pytest.approx(max(rates))


def test_cheap_verifies_keep_every_draft_and_dear_ones_keep_none():
    sure = [survival(np.array([0.99] * 5))]
    assert VerifyPlanner(costs(1e-4, 1e-6)).best_width(sure) == 5
    doubtful = [survival(np.array([0.05] * 5))]
    assert VerifyPlanner(costs(1e-4, 1e-2)).best_width(doubtful) == 0


def test_trim_keeps_the_best_prefix_of_every_row_and_records_the_survivals():
    planner = VerifyPlanner(costs(1e-4, 2e-4))
    rows = [row([0.95, 0.9, 0.2, 0.9, 0.9]), row([0.9, 0.8, 0.1, 0.5, 0.5])]
    planner.trim(rows)
    width = planner.best_width([r.survival for r in rows])
    assert 0 < width < 5
    assert [len(r.proposal.tokens) for r in rows] == [width, width]
    assert rows[0].survival == pytest.approx(survival(np.array([0.95, 0.9, 0.2, 0.9, 0.9])))


def test_a_batch_whose_drafts_do_not_pay_skips_the_draft_call_but_probes_again():
    planner = VerifyPlanner(costs(draft=1e-4, verify_per_token=2e-4), probe_every=4)
    rows = [row([0.1] * 5) for _ in range(8)]
    assert planner.should_draft(rows), "a row never drafted drafts"
    planner.trim(rows)                     # that draft did not pay: the next probe waits twice probe_every
    assert [planner.should_draft(rows) for _ in range(8)] == [False] * 7 + [True]
    planner.trim(rows)                     # nor did the probe: twice as long again
    assert [planner.should_draft(rows) for _ in range(16)] == [False] * 15 + [True]
    paying = [row([0.99] * 5) for _ in range(8)]
    cheap = VerifyPlanner(costs(draft=1e-5, verify_per_token=1e-5))
    cheap.trim(paying)
    assert all(cheap.should_draft(paying) for _ in range(8))
    planner.trim(paying)                   # a probe that paid (by chance, say): half the interval, not probe_every
    assert planner.interval == 8


def test_a_greedy_request_after_sampled_ones_that_did_not_pay_is_drafted_at_once():
    """Sampled drafts that rarely survive stretch the probe interval; a greedy request arriving then is judged by
    greedy rows' estimates (none yet: it drafts), not by the sampled rows' mean."""
    planner = VerifyPlanner(costs(draft=1e-4, verify_per_token=1e-3), probe_every=4)
    sampled = [row([0.1] * 5, SamplingParams(max_new_tokens=24, temperature=1.0)) for _ in range(8)]
    planner.trim(sampled)
    planner.trim(sampled)
    assert not planner.should_draft([row([0.1] * 5, sampled[0].params)])     # a new sampled row: the sampled mean
    greedy = [row([0.99] * 5) for _ in range(8)]
    assert planner.should_draft(greedy)
    planner.trim(greedy)
    assert planner.should_draft([row([0.99] * 5)])                            # a new greedy row: the greedy mean


def test_turning_drafting_on_must_pay_its_switch_and_keeping_it_on_need_not():
    """Drafts that pay a step in a run of drafting steps, but not one that first pays the switch: a batch that is
    drafting goes on drafting, one that is not stays plain until a probe (which, not paying, doubles the wait)."""
    planner = VerifyPlanner(costs(draft=1e-5, verify_per_token=1e-5, switch=4e-3), probe_every=4)
    rows = [row([0.6] * 5) for _ in range(8)]
    planner.trim(rows)                                       # a first draft (never-drafted rows draft)
    survivals = [r.survival for r in rows]
    assert planner.pays(survivals) and not planner.pays(survivals, switching=True)
    assert all(planner.should_draft(rows) for _ in range(3)), "on: drafting goes on"
    planner.since_draft = 1                                  # a plain step came between
    assert [planner.should_draft(rows) for _ in range(3)] == [False] * 2 + [True], "off: only the probe drafts"
    assert planner.switching
    planner.trim(rows)
    assert planner.interval == 8, "the probe paid a switch its drafts did not earn"
    assert planner.should_draft(rows) and not planner.switching, "right after it, drafting goes on"
    planner.trim(doubtful := [row([0.05] * 5) for _ in range(8)])
    assert not planner.should_draft(doubtful)
    planner.observe(8, False, 1.0)                           # the first plain step after drafting carries the switch
    assert planner.scale[False] == 1.0
    assert not planner.should_draft(doubtful)
    planner.observe(8, False, 1.0)                           # the next is weighed
    assert planner.scale[False] > 1.0


def test_a_probe_whose_drafts_do_not_pay_verifies_none():
    """Rows that decode in step (a batch admitted together, of one length) stay in step through a probe whose drafts
    do not pay: it refreshes the estimates and verifies nothing."""
    planner = VerifyPlanner(costs(draft=1e-4, verify_per_token=2e-4), probe_every=2)
    rows = [row([0.1] * 5) for _ in range(8)]
    planner.trim(rows)
    assert [planner.should_draft(rows) for _ in range(4)] == [False] * 3 + [True]
    rows = [row([0.6] * 5) for _ in range(8)]          # the probe's drafts: each row's best prefix is not empty...
    assert planner.best_width([survival(np.array([0.6] * 5))] * 8, switching=True) > 0
    planner.trim(rows)                                  # ...but the step would not pay
    assert planner.width == 0 and all(r.proposal.tokens == [] for r in rows)


def test_what_drafting_costs_once_is_spread_over_the_tokens_left():
    """Rows never drafted cost the drafter's catch-up on their prompts; rows in step (as many tokens left each) with
    requests queued behind them cost their successors' prompts prefilled one by one, not in one call."""
    planner = VerifyPlanner(costs(draft=1e-4, verify_per_token=2e-4, prefill=5e-3, catch_up=2e-3))
    in_step = [row([0.9] * 5) for _ in range(8)]                      # 24 tokens left each
    apart = 8 * (5e-3 + 1e-3) - (5e-3 + 8e-3)                          # eight prefill calls against one
    assert planner.once_per_token(in_step, queued=0) == pytest.approx(2e-3 / 192)
    assert planner.once_per_token(in_step, queued=8) == pytest.approx((2e-3 + apart) / 192)
    assert planner.once_per_token(in_step, queued=3) == pytest.approx((2e-3 + 3 * 6e-3 - (5e-3 + 3e-3)) / 192)
    planner.trim(in_step)                                              # drafted: no catch-up left to pay
    assert planner.once_per_token(in_step, queued=8) == pytest.approx(apart / 192)
    in_step[0].generated = [7]                                         # out of step: its successor comes apart anyway
    assert planner.once_per_token(in_step, queued=8) == 0.0
    survivals = [survival(np.array([0.95] * 5))] * 8                  # 1.2x plain decoding's tokens/s
    assert planner.pays(survivals) and not planner.pays(survivals, once=apart / 192)


def test_drafting_must_beat_plain_decoding_by_the_margin():
    planner = VerifyPlanner(costs(draft=1e-4, verify_per_token=2e-4))
    plain = 8 / planner.step_seconds(8, None)
    for confidence in np.linspace(0.3, 0.99, 30):
        survivals = [survival(np.array([confidence] * 5))] * 8
        best = planner.expected_rate(survivals, planner.best_width(survivals))
        assert planner.pays(survivals) == (best > verify_schedule.MARGIN * plain)
    marginal = [survival(np.array([0.86] * 5))] * 8            # 1.03 times plain decoding's tokens/s
    assert VerifyPlanner(planner.costs, margin=1.0).pays(marginal) and not planner.pays(marginal)


def test_steps_as_measured_correct_a_profile_that_no_longer_holds():
    """A profile taken on a quieter machine: plain decodes really cost three times what it says. Once steps have
    measured that, drafting pays where by the profile alone it did not; one slow step is not taken at its word."""
    planner = VerifyPlanner(costs(draft=2e-3, verify_per_token=1e-3))
    rows = [survival(np.array([0.5] * 5)) for _ in range(8)]
    assert not planner.pays(rows)
    for _ in range(300):
        planner.observe(8, False, 3 * planner.profiled_seconds(8, None))
    assert planner.scale[False] == pytest.approx(3, rel=1e-3) and planner.scale[True] == 1.0
    assert planner.pays(rows)
    planner.observe(8, True, 1000.0)                 # the host paused: the ratio is clipped, then weighed in
    assert planner.scale[True] == pytest.approx(1 + verify_schedule.SCALE_RATE * (4 - 1))


def test_survivals_are_calibrated_by_the_drafts_verifies_kept_apart_for_greedy_and_sampled_rows():
    """Sampled rows kept 80% of the drafts their confidences promised, greedy ones all: a sampled row's survivals
    are taken at 0.8 of the running product from then on, a greedy row's as they are (capped at 1), and drafting
    that paid by the head's word no longer does."""
    planner = VerifyPlanner(costs(draft=1e-4, verify_per_token=2e-4))
    sampled = SamplingParams(max_new_tokens=24, temperature=1.0)
    confidence = np.array([0.88] * 5)
    assert planner.calibration(False) == planner.calibration(True) == 1.0
    for _ in range(2000):
        planner.verified(False, confidence, 0.8 * float(survival(confidence).sum()))
        planner.verified(True, np.array([0.5] * 5), float(survival(np.array([0.5] * 5)).sum()))
    assert planner.calibration(False) == pytest.approx(0.8, rel=1e-3)
    assert planner.calibration(True) == pytest.approx(1.0, rel=1e-3)
    rows = [row(list(confidence), sampled) for _ in range(8)] + [row([0.99] * 5)]
    planner.trim(rows)
    assert rows[0].survival == pytest.approx(0.8 * survival(confidence))
    assert rows[-1].survival == pytest.approx(survival(np.array([0.99] * 5)))
    flips = [c for c in np.linspace(0.3, 0.99, 70)             # where the head's word pays and 0.8 of it does not
             if planner.pays([survival(np.array([c] * 5))] * 8)
             and not planner.pays([0.8 * survival(np.array([c] * 5))] * 8)]
    assert flips
    rows = [row([flips[0]] * 5, sampled) for _ in range(8)]
    planner.trim(rows)
    planner.since_draft, planner.interval = 1, 100               # a decision, not a probe
    assert not planner.should_draft(rows)


# ---------------------------------------------------------------------- the record
def test_a_recorded_profile_is_read_back_and_a_bad_one_is_measured_again(tmp_path):
    measured = []

    def measure():
        measured.append(1)
        return costs(1e-4, 1e-4)

    first = recorded_costs("key", 6, measure, tmp_path)
    assert recorded_costs("key", 6, measure, tmp_path) == first and len(measured) == 1
    assert recorded_costs("key", 4, measure, tmp_path) is not None and len(measured) == 2, "another k: measured"
    good = {"batches": [1], "decode": [1e-3], "draft": [1e-3], "verify": [[1e-3] * 4], "switch": [0.0],
            "prefill": [1e-2], "catch_up": [0.0]}
    bad_records = [good | {"draft": [float("nan")]}, good | {"batches": [8, 1], "decode": [1e-3] * 2,
                                                             "draft": [1e-3] * 2, "verify": [[1e-3] * 4] * 2},
                   good | {"draft": [-1.0]}, good | {"decode": [0.0]}, good | {"batches": ["1"]},
                   good | {"switch": [-1e-3]}, good | {"switch": [1e-3, 1e-3]}, good | {"prefill": [0.0]},
                   good | {"catch_up": [float("inf")]}, {k: v for k, v in good.items() if k != "catch_up"},
                   {k: v for k, v in good.items() if k != "decode"}, [], "x"]
    for bad in bad_records:
        (tmp_path / "key.json").write_text(json.dumps(bad))
        recorded_costs("key", 4, measure, tmp_path)
    (tmp_path / "key.json").write_bytes(b"\xff not json")
    assert recorded_costs("key", 4, measure, tmp_path) is not None
    assert len(measured) == 2 + len(bad_records) + 1, "every bad record was measured again"
    (tmp_path / "key.json").write_text(json.dumps(good))
    assert recorded_costs("key", 4, measure, tmp_path) == \
        StepCosts((1,), (1e-3,), (1e-3,), ((1e-3,) * 4,), (0.0,), (1e-2,), (0.0,))


# ---------------------------------------------------------------------- on an engine
@pytest.fixture(scope="module")
def dspark_engine(tiny_engine):
    """A DSpark engine built --mtp 7 whose drafts are often accepted (make-tiny --agree 0.1)."""
    return tiny_engine("mixed", mtp=7, drafter="dspark", agree=0.1)[1]


def prompts(n: int) -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [[int(t) for t in rng.integers(2, 60, 12)] for _ in range(n)]


def test_greedy_tokens_are_the_same_with_and_without_it_solo_and_batched(dspark_engine):
    ps = prompts(5)
    off = Generator.from_engine_dir(dspark_engine, confidence_scheduling=False)
    on = Generator.from_engine_dir(dspark_engine, confidence_scheduling=True)
    assert on.scheduler.planner is not None and off.scheduler.planner is None
    want = [r.token_ids for r in off.generate(ps, GREEDY)]
    assert [r.token_ids for r in on.generate(ps, GREEDY)] == want
    assert [on.generate([p], GREEDY)[0].token_ids for p in ps] == want
    assert on.totals.accepted > 0
    assert on.scheduler.planner.scale[True] != 1.0, "its steps were timed against the profile"


def test_verifies_shrink_where_the_confidence_says_drafts_will_not_survive(dspark_engine):
    """With verifies made dear (a profile of this shape), the planner keeps short prefixes; with them free, all."""
    ps = prompts(4)
    generator = Generator.from_engine_dir(dspark_engine, confidence_scheduling=True)
    generator.scheduler.planner = VerifyPlanner(costs(1e-4, 3e-4, widths=8))
    dear = generator.generate(ps, GREEDY)
    generator.scheduler.planner = VerifyPlanner(costs(1e-4, 1e-9, widths=8))
    free = generator.generate(ps, GREEDY)
    assert [r.token_ids for r in dear] == [r.token_ids for r in free]
    per_verify = [sum(r.metrics["drafted"] for r in rs) / max(1, sum(r.metrics["verify_steps"] for r in rs))
                  for rs in (dear, free)]
    assert per_verify[0] < per_verify[1] == 7


def test_the_profile_is_measured_once_and_reused_by_the_next_open(dspark_engine, tmp_path, monkeypatch):
    Generator.from_engine_dir(dspark_engine, step_costs=tmp_path, limits=Limits(max_batch=4))
    [record] = tmp_path.iterdir()
    profile = StepCosts.from_json(json.loads(record.read_text()), 8)
    assert profile.batches == (1, 2, 4) and all(s > 0 for s in profile.draft + profile.decode)

    def no_second_profile(scheduler):
        raise AssertionError("profiled again")

    monkeypatch.setattr(verify_schedule, "profile_step_costs", no_second_profile)
    import v4engine.runtime.generator as generator_module
    monkeypatch.setattr(generator_module, "profile_step_costs", no_second_profile)
    again = Generator.from_engine_dir(dspark_engine, step_costs=tmp_path, limits=Limits(max_batch=4))
    assert again.scheduler.planner.costs == profile
    assert not again.scheduler.active and not again.scheduler.waiting and again.scheduler.used_bytes == 0


def test_it_is_refused_in_one_line_where_the_drafts_carry_no_confidence(tiny_engine, dspark_engine, tmp_path):
    mtp_engine = tiny_engine("mixed")[1]
    with pytest.raises(RequestError, match="confidence_scheduling needs drafts with a confidence.*mtp"):
        Generator.from_engine_dir(mtp_engine, confidence_scheduling=True)
    with pytest.raises(RequestError, match="confidence_scheduling must be"):
        Generator.from_engine_dir(dspark_engine, confidence_scheduling="yes")
    assert Generator.from_engine_dir(mtp_engine).scheduler.planner is None, "off by default without confidence"
    with pytest.raises(RenderError, match="confidence_scheduling.*dspark"):
        render(mtp_engine, tmp_path / "repo", confidence_scheduling=True)
    assert not (tmp_path / "repo").exists()



def test_the_triton_repository_and_v4generate_carry_the_switch(dspark_engine, tmp_path):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    from v4engine.builder.cli import main as v4build

    def parameters(repo) -> dict[str, str]:
        config = text_format.Parse((repo / "v4_generate" / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
        return {k: v.string_value for k, v in config.parameters.items()}

    assert v4build(["triton-repo", str(dspark_engine), str(tmp_path / "off"), "--confidence-scheduling", "off"]) == 0
    assert parameters(tmp_path / "off")["confidence_scheduling"] == "off"
    assert "confidence_scheduling" not in parameters(render(dspark_engine, tmp_path / "auto")), "the default: on"
    outputs = []
    for switch in ("on", "off"):        # in a process of its own: v4generate takes ONNX Runtime's global pool
        run = subprocess.run([sys.executable, "-m", "v4engine.runtime.cli", str(dspark_engine), "--prompt-ids",
                              "5,17,99", "--max-new-tokens", "12", "--json", "--confidence-scheduling", switch],
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        outputs.append(json.loads(run.stdout)["token_ids"])
    assert outputs[0] == outputs[1]
