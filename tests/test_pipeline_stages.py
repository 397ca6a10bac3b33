"""Pipeline stages (v4build --pipeline-stages N, Generator devices=[...]): the target cut into N graphs of about
equal resident bytes behaves exactly like the one graph, on FP8 and MXFP4 checkpoints."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from v4engine.builder.build import BuildError, BuildOptions, build
from v4engine.builder.load import open_checkpoint
from v4engine.builder.stages import ModelBytes, StageError, model_bytes, plan_stages
from v4engine.contract.backend_options import OnnxRuntimeSessionOptions
from v4engine.contract.backends import BACKENDS
from v4engine.contract.engine import EngineManifest
from v4engine.contract.engine_folder import EngineFormatError
from v4engine.contract.errors import V4EngineError
from v4engine.contract.layout import STAGE_INPUT, CacheLayout
from v4engine.runtime.cache import CachePool, SequenceCache
from v4engine.runtime.drafters import MtpDrafter
from v4engine.runtime.generator import Generator
from v4engine.runtime.pool_arrays import DeviceArrays, HostArrays
from v4engine.runtime.sampling import RequestError, SamplingParams
from v4engine.runtime.scheduler import Scheduler
from v4engine.runtime.sessions import open_session, open_target
from v4engine.runtime.sessions.onnxruntime import OnnxRuntimeSession
from v4engine.runtime.sessions.pipeline import PipelineSession
from v4engine.testkit.compare import compare_with_onnxruntime

pytestmark = pytest.mark.xdist_group("pipeline")       # one worker builds the engines once

STAGE_COUNTS = (1, 2, 3)
PROMPTS = [[1, 5, 9, 33, 7, 100, 3] * 3, [4, 200, 17], list(range(40, 90))]


@pytest.fixture(scope="session")
def engines(tiny_checkpoint, tmp_path_factory):
    """(quantize, stages) -> engine folder: flash_like (4 layers), MTP layer agreeing in part, --mtp 3. Built once
    per worker (session scope: a module fixture was seen set up twice in one run)."""
    out = {}
    for stages in STAGE_COUNTS:                 # stage count outermost: both formats share each export
        for quantize in ("fp8", "mxfp4"):
            checkpoint = tiny_checkpoint("flash_like", quantize=quantize, agree=0.05)
            folder = tmp_path_factory.mktemp("pipeline") / f"{quantize}-{stages}"
            build(BuildOptions(checkpoint=checkpoint, output=folder, mtp=3, pipeline_stages=stages, progress=False))
            out[quantize, stages] = folder
    return out


def _generate(engine, **options) -> list[tuple[list[int], dict]]:
    generator = Generator.from_engine_dir(engine, **options)
    greedy = generator.generate(PROMPTS, SamplingParams(max_new_tokens=20))
    sampled = generator.generate(PROMPTS, SamplingParams(max_new_tokens=20, temperature=1.0, seed=7))
    keys = ("drafted", "accepted", "per_position_acceptance", "verify_steps")
    return [(r.token_ids, {k: r.metrics[k] for k in keys}) for r in greedy + sampled]


# --------------------------------------------------------------------------- where the layers are cut
def test_the_plan_minimizes_the_largest_stage():
    sizes = ModelBytes(layers=[10, 10, 10, 10, 10, 10], embedding=5, final=1, head=4, draft=8)
    stages = plan_stages(sizes, 2, draft=True)
    assert [list(s.layers) for s in stages] == [[0, 1, 2, 3], [4, 5]]
    # stage 0: 40 + 5; stage 1: 20 + 1 + 4 (head) + 8 + 5 + 4 (the draft's own layer, embedding and head again)
    assert [sizes.stage(s, draft=True) for s in stages] == [45, 42]
    assert [list(s.layers) for s in plan_stages(sizes, 2, draft=False)] == [[0, 1, 2], [3, 4, 5]]
    assert [list(s.layers) for s in plan_stages(sizes, 6, draft=True)] == [[i] for i in range(6)]


def test_more_stages_than_layers_is_refused():
    with pytest.raises(StageError, match="--pipeline-stages 7: the model has 6 layers, so from 1 to 6 stages"):
        plan_stages(ModelBytes(layers=[1] * 6), 7, draft=False)


@pytest.mark.parametrize("quantize", ["fp8", "mxfp4"])
def test_the_plan_counts_what_the_build_attached(engines, quantize):
    """The cut is made before export from the checkpoint's headers; engine.json's bytes are what attach_weights
    counted in the graphs. They agree to the byte."""
    for stages in STAGE_COUNTS:
        manifest = EngineManifest.read(engines[quantize, stages])
        cfg, ckpt = open_checkpoint(manifest.checkpoint["path"], mtp=True)
        sizes = model_bytes(cfg, ckpt, BACKENDS["onnxruntime"], torch.float32, draft=True)
        assert [e.bytes for e in manifest.stages] == [sizes.stage(e.stage, draft=True) for e in manifest.stages]
        if stages > 1:
            assert [e.stage.layers for e in manifest.stages] == \
                [s.layers for s in plan_stages(sizes, stages, draft=True)]


# --------------------------------------------------------------------------- the engine directory
def test_engine_json_lists_the_stages(engines):
    manifest = EngineManifest.read(engines["mxfp4", 3])
    raw = json.loads((engines["mxfp4", 3] / "engine.json").read_text())["pipeline"]["stages"]
    assert [s["graph"] for s in raw] == ["target.0", "target.1", "target.2"]
    assert sum((s["layers"] for s in raw), []) == [0, 1, 2, 3]
    assert [s["draft"] for s in raw] == [None, None, "draft"]
    layout = CacheLayout.target(manifest.model)
    assert sum((s["cache_groups"] for s in raw), []) == [g.pool for g in layout.groups]
    assert all(s["bytes"] > 0 for s in raw)
    assert sorted(manifest.graphs) == ["draft", "target.0", "target.1", "target.2"]
    names = {graph: ([s.name for s in e.inputs], [s.name for s in e.outputs]) for graph, e in manifest.graphs.items()}
    assert names["target.0"][0][:2] == ["input_ids", "positions"] and "logits" not in names["target.0"][1]
    assert names["target.1"][0][0] == STAGE_INPUT and "logits" not in names["target.1"][1]
    assert names["target.2"][1][:2] == ["logits", "hidden"]
    for graph in manifest.stage_graphs:      # each reads and writes only its own layers' pools
        stage = next(e.stage for e in manifest.stages if e.stage.graph == graph)
        pools = [n for n in names[graph][0] if n.startswith("pool.")]
        assert pools == [g.pool for g in CacheLayout.target(manifest.model, layers=stage.layers).groups]


@pytest.mark.parametrize("damage, message", [
    (lambda s: s[1].update(layers=[3]), "must be the layers from 2 on"),
    (lambda s: s[2].update(layers=[3, 4]), "must be the layers from 3 on"),
    (lambda s: (s.pop(), s[1].update(draft="draft")), "covers layers 0 to 2 of the model's 4"),
    (lambda s: s[0]["cache_groups"].pop(), "is not the stage of layers 0 to 1"),
    (lambda s: s[2].update(draft=None), "is not the stage of layers 3 to 3"),
    (lambda s: s[0].update(bytes=-1), "bytes' must be an integer from 0"),
    (lambda s: s.clear(), "must list 1 to 4 stages"),
])
def test_a_damaged_pipeline_is_refused_in_one_line(engines, tmp_path, damage, message):
    engine = shutil.copytree(engines["fp8", 3], tmp_path / "engine", symlinks=True)
    raw = json.loads((engine / "engine.json").read_text())
    damage(raw["pipeline"]["stages"])
    (engine / "engine.json").write_text(json.dumps(raw))
    with pytest.raises(EngineFormatError, match=message) as error:
        EngineManifest.read(engine)
    assert "\n" not in str(error.value)


# --------------------------------------------------------------------------- numerics and generation
def test_the_stages_compute_what_the_one_graph_computes(engines):
    """One call over two rows with committed context: logits, streams and every new row of the 3 stages against
    the single target graph, fp32 on the CPU."""
    one, three = engines["fp8", 1], engines["fp8", 3]
    manifest = EngineManifest.read(one)
    single = open_session(one, manifest, "target")
    staged = open_target(three, EngineManifest.read(three))
    layout = manifest.caches["target"]
    pool = CachePool(layout, 2, 8, HostArrays("fp32"))
    rng = np.random.default_rng(0)
    for array in pool.arrays.values():
        array[...] = rng.standard_normal(array.shape, np.float32)
    # two sequences of 37 and 5 committed positions: their slots (0, 1) and blocks
    first, second = SequenceCache(pool), SequenceCache(pool)
    first.blocks, second.blocks = [0, 1, 2], [3]
    feeds = pool.feeds([first, second])
    lengths = np.array([37, 5])
    feeds["positions"] = lengths[:, None] + np.arange(4)
    feeds["input_ids"] = rng.integers(0, manifest.model.vocab_size, (2, 4))
    want, got = single.run(feeds), staged.run(feeds)
    assert sorted(want) == sorted(got)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("quantize", ["fp8", "mxfp4"])
def test_one_two_and_three_stages_generate_the_same(engines, quantize):
    """Greedy and sampled tokens, and acceptance step by step, whatever the cut; slicing a call's rows into
    micro-batches in flight on different stages changes nothing either."""
    runs = [_generate(engines[quantize, n]) for n in STAGE_COUNTS]
    runs.append(_generate(engines[quantize, 3], microbatches=2))
    assert all(run == runs[0] for run in runs[1:])
    assert sum(m["accepted"] for _, m in runs[0]) > 0, "drafts are accepted: rollback is exercised"


def test_each_stage_keeps_its_pools_where_its_session_reads_them(engines):
    """Stage 0 reads host numpy pools, stage 1 torch tensors (the device path, on the CPU here): each stage's cache
    groups are allocated where that stage reads them, and the tokens do not change."""
    engine = engines["fp8", 2]
    manifest = EngineManifest.read(engine)
    host, device = (OnnxRuntimeSession(engine, manifest, graph, options=OnnxRuntimeSessionOptions(device_pools=flag))
                    for graph, flag in zip(manifest.stage_graphs, (False, True)))
    target = PipelineSession([host, device])
    draft = open_session(engine, manifest, "draft", options=OnnxRuntimeSessionOptions(device_pools=True))
    scheduler = Scheduler(manifest, target, MtpDrafter(manifest, draft, 3, max_prefill_chunk=512), max_batch=4,
                          max_seq_len=256)
    pool = scheduler.pools["target"]
    for entry, storage in zip(manifest.stages, (HostArrays, DeviceArrays)):
        for group in entry.layout(manifest.model, 4).groups:
            assert isinstance(pool.storage_of[group.pool], storage), group.pool
    want = Generator.from_engine_dir(engines["fp8", 1]).generate(PROMPTS, SamplingParams(max_new_tokens=12))
    generator = Generator(engine, manifest, scheduler)
    got = generator.generate(PROMPTS, SamplingParams(max_new_tokens=12))
    assert [r.token_ids for r in got] == [r.token_ids for r in want]


def test_stages_of_static_shapes_take_one_pool_size():
    """MIGraphX's programs fix their pools' sizes: the pipeline asks the scheduler for the sizes every stage takes
    (a stage of sliding layers only has no blocks of its own) and refuses stages that disagree."""
    def stage(pool_shape):
        return SimpleNamespace(inputs=(), outputs=(), pool_device=None, pool_shape=pool_shape)

    assert PipelineSession([stage({"pool_slots": 4, "pool_blocks": 36}), stage({"pool_slots": 4})]).pool_shape == \
        {"pool_slots": 4, "pool_blocks": 36}
    assert PipelineSession([stage(None), stage(None)]).pool_shape is None
    with pytest.raises(V4EngineError, match="pools of different sizes"):
        PipelineSession([stage({"pool_slots": 4}), stage({"pool_slots": 8})])


# --------------------------------------------------------------------------- bad input, one line
def test_fewer_devices_than_stages_is_one_line(engines):
    with pytest.raises(RequestError, match=r"has 3 pipeline stage\(s\), which need 3 GPU number\(s\)"):
        Generator.from_engine_dir(engines["fp8", 3], devices=[0, 1])
    with pytest.raises(RequestError, match="one per stage"):
        Generator.from_engine_dir(engines["fp8", 2], devices=[0, -1])


@pytest.mark.skipif("CUDAExecutionProvider" in __import__("onnxruntime").get_available_providers(),
                    reason="this ONNX Runtime has a GPU provider")
def test_devices_on_a_machine_without_a_gpu_provider_are_refused_not_run_on_the_cpu(engines):
    with pytest.raises(RequestError, match=r"devices: GPU 0 was asked for, but this ONNX Runtime has no "
                                           r"CUDAExecutionProvider \(its providers: .*CPUExecutionProvider\)"):
        Generator.from_engine_dir(engines["fp8", 2], devices=[0, 1])


def test_the_clis_refuse_bad_stage_counts_in_one_line(engines, tiny_checkpoint, tmp_path):
    bin_dir = Path(sys.executable).parent
    out = tmp_path / "engine"
    run = subprocess.run([bin_dir / "v4build", "--checkpoint", str(tiny_checkpoint("flash_like", quantize="fp8",
                          agree=0.05)), "--output", str(out), "--mtp", "3", "--pipeline-stages", "5", "--quiet"],
                         capture_output=True, text=True)
    assert run.returncode != 0 and not out.exists()
    assert run.stderr.strip().splitlines() == ["v4build: error: --pipeline-stages 5: the model has 4 layers, so "
                                               "from 1 to 4 stages"]
    with pytest.raises(BuildError, match="--pipeline-stages must be 1 or more"):
        build(BuildOptions(checkpoint=tiny_checkpoint("flash_like"), output=out, pipeline_stages=0))
    run = subprocess.run([bin_dir / "v4generate", str(engines["fp8", 2]), "--prompt-ids", "1,2", "--devices", "0"],
                         capture_output=True, text=True)
    assert run.returncode == 1 and len(run.stderr.strip().splitlines()) == 1
    assert "has 2 pipeline stage(s), which need 2 GPU number(s)" in run.stderr


@pytest.mark.parametrize("backend", ["tensorrt", "migraphx"])
def test_every_backend_builds_the_stages(engines, tiny_checkpoint, tmp_path, backend):
    """The GPU backends' stage graphs (TensorRT's prepared graphs, MIGraphX's variant) compute, on ONNX Runtime,
    what the portable stages compute; each has its own optimization profiles, the later stage's over its streams."""
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx

    out = tmp_path / backend
    build(BuildOptions(checkpoint=tiny_checkpoint("flash_like", quantize="mxfp4", agree=0.05), output=out, mtp=3,
                       pipeline_stages=2, backend=backend, dtype="fp32",
                       backend_options={"onnx_only": True} if backend == "tensorrt" else {}, progress=False))
    manifest = EngineManifest.read(out)
    assert manifest.stage_graphs == ["target.0", "target.1"]
    profiles = manifest.compiled.profiles
    assert sorted(profiles) == ["draft", "target.0", "target.1"]
    assert [p.name for p in profiles["target.1"]] == ["prefill", "verify"]
    assert all(STAGE_INPUT in p.shapes for p in profiles["target.1"])
    assert not any(STAGE_INPUT in p.shapes for p in profiles["target.0"])
    cfg, ckpt = open_checkpoint(manifest.checkpoint["path"], mtp=True)      # each backend's own resident form
    sizes = model_bytes(cfg, ckpt, BACKENDS[backend], torch.float32, draft=True)
    assert [e.bytes for e in manifest.stages] == [sizes.stage(e.stage, draft=True) for e in manifest.stages]
    same, verdict = compare_with_onnxruntime(manifest, engines["mxfp4", 2],
                                             lambda g: OnnxrtRunner(SessionFromOnnx(str(out / f"{g}.onnx"))), atol=1e-4)
    assert same, verdict
