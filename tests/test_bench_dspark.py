"""bench_dspark's intervals: the acceptance figure they bracket is the runtime's own mean acceptance length, and a
comparison pairs the prompts, so a prompt's difficulty cancels and only the drafters' difference is left; a speed
ratio pairs the rounds, so a machine slow for a whole round moves every system alike."""
import numpy as np
import pytest

from benchmarks.bench_dspark import acceptance_intervals, speed_intervals
from benchmarks.bench_generate import Tally
from v4engine.runtime.metrics import RequestMetrics


def tally_of(requests: list[list[int]], drafted: int = 3) -> Tally:
    """A system's tally from each request's accepted drafts per verify step, as run_v4engine fills it."""
    tally, totals = Tally(), RequestMetrics(mtp=drafted)
    for accepted_per_step in requests:
        metrics = RequestMetrics(mtp=drafted)
        for accepted in accepted_per_step:
            metrics.record_verify(drafted, accepted)
        totals.merge(metrics)
        tally.verifies.append((len(accepted_per_step), sum(accepted_per_step)))
    tally.metrics = totals
    return tally


def prompts_of_varied_difficulty(shift: int, count: int = 24, draws: int = 4, seed: int = 0) -> list[list[int]]:
    """Requests prompt by prompt: prompt i's drafts accepted around i % 3, plus `shift` on some steps."""
    rng = np.random.default_rng(seed)
    return [[int(min(3, i % 3 + (rng.random() < 0.5) * shift)) for _ in range(20)]
            for i in range(count) for _ in range(draws)]


def test_the_length_is_the_runtimes_pooled_mean_acceptance_length_inside_its_interval():
    tallies = {"MTP 3": tally_of(prompts_of_varied_difficulty(0)),
               "DSpark 5": tally_of(prompts_of_varied_difficulty(1))}
    owners = [i for i in range(24) for _ in range(4)]
    for name, (length, low, high, *_) in acceptance_intervals(tallies, owners).items():
        assert length == pytest.approx(tallies[name].metrics.mean_acceptance_length)
        assert low < length < high


def test_a_system_against_itself_differs_by_exactly_nothing():
    tallies = {"MTP 3": tally_of(prompts_of_varied_difficulty(1))}
    *_, difference, low, high = acceptance_intervals(tallies, [i for i in range(24) for _ in range(4)])["MTP 3"]
    assert difference == low == high == 0


def test_paired_prompts_make_the_difference_tighter_than_either_length():
    tallies = {"MTP 3": tally_of(prompts_of_varied_difficulty(0)),
               "DSpark 5": tally_of(prompts_of_varied_difficulty(1, seed=1))}
    _, low, high, difference, dlow, dhigh = acceptance_intervals(tallies, [i for i in range(24) for _ in range(4)])[
        "DSpark 5"]
    assert 0 < dlow < difference < dhigh
    assert dhigh - dlow < (high - low) / 2


def test_systems_that_draft_nothing_are_left_out():
    tallies = {"MTP 0": Tally(verifies=[(0, 0)] * 4, metrics=RequestMetrics(mtp=0)),
               "MTP 3": tally_of([[1, 2], [0, 3], [2, 2], [1, 1]])}
    assert list(acceptance_intervals(tallies, [0, 1, 2, 3])) == ["MTP 3"]


def test_a_round_the_whole_machine_ran_slow_in_leaves_the_speed_ratio_as_it_was():
    machine = np.array([1.0, 0.7, 1.1, 0.9, 1.3, 0.8])                  # each round's speed of the machine
    per_round = {"MTP 0": list(450 * machine), "DSpark 5 scheduled": list(441 * machine)}
    assert speed_intervals(per_round)["DSpark 5 scheduled"] == pytest.approx((0.98, 0.98, 0.98))
    assert speed_intervals(per_round)["MTP 0"] == pytest.approx((1.0, 1.0, 1.0))


def test_the_speed_interval_brackets_the_mean_ratio_and_narrows_with_more_rounds():
    rng = np.random.default_rng(0)

    def width(rounds: int) -> float:
        per_round = {"MTP 0": [450.0] * rounds, "DSpark 5": list(450 * (0.97 + 0.03 * rng.standard_normal(rounds)))}
        mean, low, high = speed_intervals(per_round)["DSpark 5"]
        assert low < mean < high
        return high - low

    assert width(24) < width(4) / 1.5
