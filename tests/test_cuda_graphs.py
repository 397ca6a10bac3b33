"""CUDA graphs (v4build --cuda-graphs, contract/calls.py), checked as far as a machine without a GPU allows.

1. The engine's graphs hold no control flow (no Loop, If or Scan, functions included), which a CUDA graph cannot
   hold, while a plain engine's do (Sinkhorn's Loop, the draft's conditionals); engine.json names the verify and
   draft-cycle profiles as recorded, for ONNX Runtime and TensorRT (the verify only without MTP); MIGraphX refuses
   the flag in one line.
2. On the CPU provider the recorded path runs without recording (`cuda_graphs=True`): every verify and draft cycle
   padded into buffers of a bucket's static shapes, allocated once and bound once, as ONNX Runtime's CUDA
   provider replays them. Its tokens and acceptance equal the plain engine's, greedy and sampled, on a mixed
   batch; a bucket whose pools moved is bound again to the new ones (an old binding would read the old pools);
   what a call returned survives the next replay.
3. engine.json is untrusted: recorded profiles other than the per-token calls (unknown, a prefill, twice) are
   refused in one line; a graph left without a recorded profile runs unrecorded; asking an engine built without
   the flag for recorded calls is refused in one line.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from v4engine.builder.build import BuildError, BuildOptions, build, control_flow
from v4engine.contract.backend_options import OnnxRuntimeSessionOptions
from v4engine.contract.calls import CAPTURED_CALLS
from v4engine.contract.engine import EngineManifest
from v4engine.contract.engine_folder import EngineFormatError
from v4engine.runtime.generator import Generator
from v4engine.runtime.sampling import SamplingParams
from v4engine.runtime.sessions import open_session

pytestmark = pytest.mark.xdist_group("cuda_graphs")

PROMPTS = [[5, 17, 101, 42], [9] * 11, [77, 3]]


@pytest.fixture(scope="module")
def engines(tiny_engine, tmp_path_factory) -> dict[str, Path]:
    """The plain tiny engine (mixed, --mtp 3, drafts partly accepted: rollback on every step), and the same
    checkpoint built with --cuda-graphs for ONNX Runtime and (prepared only) for TensorRT."""
    checkpoint, plain = tiny_engine("mixed", agree=0.05)
    work = tmp_path_factory.mktemp("cuda_graphs")
    for backend, extra in (("onnxruntime", {}), ("tensorrt", {"onnx_only": True})):
        build(BuildOptions(checkpoint=checkpoint, output=work / backend, mtp=3, backend=backend, dtype="fp32",
                           backend_options={"cuda_graphs": True, **extra}, progress=False))
    return {"plain": plain, "onnxruntime": work / "onnxruntime", "tensorrt": work / "tensorrt",
            "checkpoint": checkpoint}


def graph(engine: Path, name: str) -> onnx.ModelProto:
    return onnx.load(str(engine / f"{name}.onnx"), load_external_data=False)


# --------------------------------------------------------------------------- 1. what the build writes
@pytest.mark.parametrize("backend", ["onnxruntime", "tensorrt"])
def test_the_graphs_hold_no_control_flow_and_engine_json_names_the_recorded_calls(engines, backend):
    assert control_flow(graph(engines["plain"], "target")) == {"Loop"}            # what the flag removes
    assert control_flow(graph(engines["plain"], "draft")) == {"If", "Loop"}
    for name in ("target", "draft"):
        assert control_flow(graph(engines[backend], name)) == set()
    compiled = EngineManifest.read(engines[backend]).compiled
    assert compiled.cuda_graphs == CAPTURED_CALLS
    assert [p.name for p in compiled.profiles["target"]] == ["prefill", "verify"]
    assert [p.name for p in compiled.profiles["draft"]] == ["extend", "cycle"]
    assert EngineManifest.read(engines["plain"]).compiled.cuda_graphs == ()


def test_an_engine_without_mtp_records_its_verify_only(engines, tmp_path):
    build(BuildOptions(checkpoint=engines["checkpoint"], output=tmp_path / "mtp0", mtp=0,
                       backend_options={"cuda_graphs": True},
                       progress=False))
    assert EngineManifest.read(tmp_path / "mtp0").compiled.cuda_graphs == ("verify",)
    ids = Generator.from_engine_dir(tmp_path / "mtp0", backend_options={"cuda_graphs": True}).generate(PROMPTS[1],
                                                                                  SamplingParams(max_new_tokens=6))
    plain = Generator.from_engine_dir(engines["plain"], mtp=0).generate(PROMPTS[1], SamplingParams(max_new_tokens=6))
    assert ids[0].token_ids == plain[0].token_ids


def test_migraphx_refuses_the_flag_in_one_line(tiny_engine, tmp_path):
    with pytest.raises(BuildError, match=r"^option 'cuda_graphs' is not one migraphx engines take[^\n]*$"):
        build(BuildOptions(checkpoint=tiny_engine("mixed")[0], output=tmp_path / "out", backend="migraphx",
                           backend_options={"cuda_graphs": True}, progress=False))
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- 2. the recorded path
def counts(metrics: dict) -> dict:
    """A request's metrics but its timings: drafted, accepted, per position, verify steps."""
    return {k: v for k, v in metrics.items() if not any(t in k for t in ("seconds", "time", "per_second"))}


@pytest.mark.parametrize("sampling", [SamplingParams(max_new_tokens=24),
                                      SamplingParams(max_new_tokens=24, temperature=1.0, seed=3),
                                      SamplingParams(max_new_tokens=24, temperature=0.8, top_k=20, top_p=0.9,
                                                     seed=5)], ids=["greedy", "sampled", "filtered"])
def test_recorded_calls_give_the_plain_engines_tokens_and_acceptance(engines, sampling):
    plain = Generator.from_engine_dir(engines["plain"]).generate(PROMPTS, sampling)
    generator = Generator.from_engine_dir(engines["onnxruntime"], backend_options={"cuda_graphs": True})
    recorded = generator.generate(PROMPTS, sampling)
    for a, b in zip(plain, recorded):
        assert a.token_ids == b.token_ids
        assert counts(a.metrics) == counts(b.metrics)    # acceptance step by step, per position
    scheduler = generator.scheduler
    target = scheduler.target_session._captured.bound()
    draft = scheduler.draft_session._captured.bound()
    assert target and all(name.startswith("verify.b") for name in target)     # the per-token calls ran recorded
    assert draft and all(name.startswith("cycle.b") for name in draft)


def test_a_draft_cycle_over_fewer_positions_takes_a_smaller_bucket(engines):
    """Drafts mostly rejected (one prompt, greedy): each cycle runs over the one or two positions a verify
    committed, in a bucket of that many positions, not padded to k + 1 (at width the MoE would run them)."""
    generator = Generator.from_engine_dir(engines["onnxruntime"], backend_options={"cuda_graphs": True})
    generator.generate(PROMPTS[0], SamplingParams(max_new_tokens=16))
    assert any(name.endswith((".s1", ".s2")) for name in generator.scheduler.draft_session._captured.bound())


def test_a_bucket_whose_pools_moved_is_bound_again(engines):
    """One verify call's feeds, run again on copies of its pools: bound to the copies (a new recording), so the
    results are the same, and follow the copies when those change (an old binding would read the old pools)."""
    generator = Generator.from_engine_dir(engines["onnxruntime"], backend_options={"cuda_graphs": True})
    session = generator.scheduler.target_session
    calls = []
    run = session.run
    session.run = lambda feeds: calls.append(dict(feeds)) or run(feeds)
    generator.generate(PROMPTS[0], SamplingParams(max_new_tokens=6))
    feeds = calls[-1]                                       # the last verify: it reads the prompt's cache rows
    assert feeds["input_ids"].shape[1] == 4 and feeds["positions"].min() > 0
    first, recordings = run(feeds), session._captured.bindings
    moved = {name: value.clone() if isinstance(value, torch.Tensor) else value for name, value in feeds.items()}
    again = run(moved)
    assert session._captured.bindings == recordings + 1
    np.testing.assert_array_equal(again["logits"], first["logits"])
    for name, value in moved.items():
        if name.startswith("pool") and value.dtype.is_floating_point:
            value.zero_()
    assert not np.array_equal(run(moved)["logits"], first["logits"])
    assert session._captured.bindings == recordings + 1


def test_outputs_already_returned_survive_the_next_call(engines):
    """The next replay writes the same buffers: what a call returned was copied out of them."""
    generator = Generator.from_engine_dir(engines["onnxruntime"], backend_options={"cuda_graphs": True})
    session = generator.scheduler.draft_session
    calls = []
    run = session.run
    session.run = lambda feeds: calls.append(dict(feeds)) or run(feeds)
    generator.generate(PROMPTS[0], SamplingParams(max_new_tokens=8, temperature=1.0, seed=1))
    first = run(calls[-1])
    kept = {name: np.array(value) for name, value in first.items() if isinstance(value, np.ndarray)}
    run({**calls[-1], "uniforms": np.full_like(calls[-1]["uniforms"], 0.999)})     # other drafts drawn
    for name, value in kept.items():
        np.testing.assert_array_equal(first[name], value)


# --------------------------------------------------------------------------- 3. untrusted engine.json
def edited(engine: Path, tmp_path: Path, cuda_graphs: list[str]) -> Path:
    copy = Path(shutil.copytree(engine, tmp_path / "engine", symlinks=True))
    data = json.loads((copy / "engine.json").read_text())
    data["build"]["compile"]["cuda_graphs"] = cuda_graphs
    (copy / "engine.json").write_text(json.dumps(data))
    return copy


@pytest.mark.parametrize("names", [["verify", "secret"], ["prefill"], ["verify", "verify"]])
def test_recorded_profiles_other_than_the_per_token_calls_are_refused_in_one_line(engines, tmp_path, names):
    with pytest.raises(EngineFormatError, match=r"'build.compile.cuda_graphs'[^\n]*must name profiles among"):
        EngineManifest.read(edited(engines["onnxruntime"], tmp_path, names))


def test_a_graph_without_a_recorded_profile_runs_unrecorded(engines, tmp_path):
    engine = edited(engines["onnxruntime"], tmp_path, ["cycle"])
    generator = Generator.from_engine_dir(engine, backend_options={"cuda_graphs": True})
    plain = Generator.from_engine_dir(engines["plain"]).generate(PROMPTS, SamplingParams(max_new_tokens=8))
    assert [r.token_ids for r in generator.generate(PROMPTS, SamplingParams(max_new_tokens=8))] == \
        [r.token_ids for r in plain]
    assert generator.scheduler.target_session._captured is None
    assert generator.scheduler.draft_session._captured.bound()


def test_recorded_calls_need_an_engine_built_for_them(engines):
    with pytest.raises(EngineFormatError, match=r"built without --cuda-graphs[^\n]*$"):
        open_session(engines["plain"], EngineManifest.read(engines["plain"]), "target",
                     options=OnnxRuntimeSessionOptions(cuda_graphs=True))
