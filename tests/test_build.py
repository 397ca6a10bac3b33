"""v4build: weights referenced in place (never copied), quantized weights kept quantized, and bad input
refused with one clear line, a non-zero exit and OUT untouched."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from hostile import env_without_export_cache
from v4engine.builder.build import BuildOptions, build, exported_config
from v4engine.builder.checkpoint import Checkpoint
from v4engine.builder.load import load_model
from v4engine.builder.model import ModelState
from v4engine.contract.config import V4Config
from v4engine.contract.engine import EngineManifest
from v4engine.runtime.sessions import open_session


def v4build(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "v4engine.builder.cli", *map(str, args), "--quiet"],
                          capture_output=True, text=True, timeout=600)


def external_refs(path: Path) -> dict[str, dict[str, str]]:
    model = onnx.load(path, load_external_data=False)
    return {t.name: {e.key: e.value for e in t.external_data} for t in model.graph.initializer
            if t.data_location == onnx.TensorProto.EXTERNAL}


@pytest.fixture(scope="module")
def bf16_engine(tiny_checkpoint, tmp_path_factory):
    checkpoint = tiny_checkpoint("split_groups", dtype="bfloat16")
    out = tmp_path_factory.mktemp("eng") / "bf16"
    return checkpoint, out, build(BuildOptions(checkpoint=checkpoint, output=out, mtp=1, progress=False))


def test_weights_are_referenced_not_copied(bf16_engine):
    checkpoint, out, manifest = bf16_engine
    ckpt = Checkpoint.open(checkpoint)
    for w in manifest.weights:      # each checkpoint file is linked, not copied: the same inode or a symlink
        assert w.link in ("hardlink", "symlink")
        assert os.path.samefile(out / w.file, w.source)
    refs = external_refs(out / "target.onnx")
    info = ckpt.info("layers.0.attn.wq_a.weight")
    stored = refs["model.layers.0.attn.wq_a.weight.stored"]          # bf16 as stored, a Cast follows in the graph
    assert stored["location"] == f"weights/{info.file.name}"
    assert (int(stored["offset"]), int(stored["length"])) == (info.offset, info.nbytes)
    assert not (out / "weights" / "converted.bin").exists(), "nothing needed converting"
    engine_bytes = sum(f.stat().st_size for f in out.rglob("*") if f.is_file() and f.parent.name != "weights")
    checkpoint_bytes = sum(f.stat().st_size for f in checkpoint.glob("*.safetensors"))
    assert manifest.build["weights"]["in place + cast"] > 0 and manifest.build["weights"]["converted"] == 0
    print(f"graphs + manifest: {engine_bytes} bytes beside {checkpoint_bytes} bytes of referenced weights")


def test_an_embedding_stays_as_stored_and_only_its_gathered_rows_are_cast(bf16_engine):
    """A bf16 table the graph only gathers from is not widened at load: the Gather reads the stored table, a Cast
    follows it; engine.json says the embedding is resident as stored."""
    checkpoint, out, manifest = bf16_engine
    nodes = onnx.load(out / "target.onnx", load_external_data=False).graph.node
    gather = next(n for n in nodes if n.op_type == "Gather" and n.input[0] == "model.embed.weight.stored")
    assert [n.op_type for n in nodes if gather.output[0] in n.input] == ["Cast"]
    assert not any("model.embed.weight.stored" in n.input for n in nodes if n.op_type == "Cast")
    assert manifest.build["weight_groups"]["target"]["embedding"]["resident"] == {
        "as stored": manifest.build["weight_groups"]["target"]["embedding"]["stored"]["bf16"]}


def test_fp32_weights_are_referenced_without_a_cast(tiny_checkpoint, tmp_path):
    checkpoint = tiny_checkpoint("split_groups")
    manifest = build(BuildOptions(checkpoint=checkpoint, output=tmp_path / "e", mtp=0, progress=False))
    refs = external_refs(tmp_path / "e" / "target.onnx")
    assert "model.layers.0.attn.wq_a.weight" in refs and manifest.build["weights"]["in place + cast"] == 0
    assert set(manifest.graphs) == {"target"}


@pytest.mark.parametrize("quantize", ["fp8", "mxfp4"])
def test_quantized_checkpoint_engine_equals_the_model(tiny_checkpoint, tmp_path, quantize):
    checkpoint = tiny_checkpoint("flash_like", quantize=quantize)
    manifest = build(BuildOptions(checkpoint=checkpoint, output=tmp_path / "e", mtp=3, progress=False))
    refs = external_refs(tmp_path / "e" / "target.onnx")
    fp8 = refs["model.layers.0.attn.wq_a.weight.fp8"]
    assert fp8["location"].startswith("weights/model-"), "FP8 bytes stay in the checkpoint file"
    assert manifest.build["weights"]["fp8 in place + dequantize"] > 0
    assert manifest.build["weights"]["converted"] == 0, "no copy of any weight, MXFP4 experts included"
    assert (manifest.build["weights"]["fp4 in place + int8 codes"] > 0) == (quantize == "mxfp4")
    ops = {n.op_type for n in onnx.load(tmp_path / "e" / "target.onnx", load_external_data=False).graph.node}
    assert ("QMoE" if quantize == "mxfp4" else "MoE") in ops and "RoutedExperts" not in ops
    model = load_model(checkpoint, mtp=False)
    state = ModelState(model.cfg, 1)
    ids = torch.randint(0, model.cfg.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids, state.positions(40), state.views()).logits.numpy()
    session = open_session(tmp_path / "e", EngineManifest.read(tmp_path / "e"), "target")
    feeds = {"input_ids": ids.numpy(), "positions": state.positions(40).numpy(), **state.pool_feeds()}
    assert np.abs(session.run(feeds)["logits"] - want).max() <= 1e-4


# --------------------------------------------------------------------------- bad input
def assert_refused(result: subprocess.CompletedProcess, out: Path, *needles: str) -> None:
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert not out.exists() or out.is_dir() and (out / "keep").exists(), "OUT untouched"
    assert not list(out.parent.glob(f".{out.name}.building-*")), "no partial files"


def test_missing_or_truncated_shard(tiny_checkpoint, tmp_path):
    broken = Path(shutil.copytree(tiny_checkpoint("mixed"), tmp_path / "ckpt"))
    shard = sorted(broken.glob("*.safetensors"))[0]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 64)
    assert_refused(v4build("--checkpoint", broken, "--output", tmp_path / "out"), tmp_path / "out", shard.name)
    shard.unlink()
    assert_refused(v4build("--checkpoint", broken, "--output", tmp_path / "out"), tmp_path / "out", shard.name)


def test_output_that_exists_without_force(tiny_checkpoint, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("mine")
    assert_refused(v4build("--checkpoint", tiny_checkpoint("mixed"), "--output", out), out, "--force")
    assert (out / "keep").read_text() == "mine"


def test_unwritable_output_folder(tiny_checkpoint, tmp_path):
    out = tmp_path / "no-such-folder" / "out"
    assert_refused(v4build("--checkpoint", tiny_checkpoint("mixed"), "--output", out), out, "no-such-folder")
    if os.geteuid() != 0:          # root writes anywhere; the read-only case needs an ordinary user
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        assert_refused(v4build("--checkpoint", tiny_checkpoint("mixed"), "--output", locked / "out"),
                       locked / "out", "locked")


def test_mtp_without_mtp_weights(tiny_checkpoint, tmp_path):
    checkpoint = tiny_checkpoint("mixed", mtp=False)
    assert_refused(v4build("--checkpoint", checkpoint, "--output", tmp_path / "out", "--mtp", "2"),
                   tmp_path / "out", "mtp.0")


def test_ctrl_c_in_the_middle_of_a_build(tiny_checkpoint, tmp_path):
    out = tmp_path / "out"
    # As from a terminal: a run started in the background (nohup, `&`) inherits an ignored SIGINT, and Python then
    # installs no KeyboardInterrupt handler, so the child installs it first. Not with preexec_fn: that forks this
    # process, and a worker that has loaded gRPC (the Triton tests) then logs an epoll error into the child.
    start = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
             "sys.argv[0] = 'v4build'; runpy.run_module('v4engine.builder.cli', run_name='__main__')")
    proc = subprocess.Popen([sys.executable, "-c", start, "--checkpoint", str(tiny_checkpoint("mixed")),
                             "--output", str(out), "--quiet"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env_without_export_cache())      # it exports: tens of seconds
    deadline = time.time() + 120
    while not list(tmp_path.glob(".out.building-*")) and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)                  # the staging folder is there: its export follows at once
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert err.strip().splitlines()[-1].startswith("v4build: interrupted")
    assert not out.exists() and not list(tmp_path.glob(".out.building-*"))


def test_bf16_engine_keeps_bf16_weights_in_place_without_casts(bf16_engine, tmp_path):
    checkpoint, _, _ = bf16_engine
    manifest = build(BuildOptions(checkpoint=checkpoint, output=tmp_path / "e", mtp=1, dtype="bf16", progress=False))
    assert manifest.build["weights"]["in place + cast"] == 0 and manifest.build["weights"]["in place"] > 0
    assert manifest.caches["target"].groups[0].value_bytes == 2
    graph = onnx.load(tmp_path / "e" / "target.onnx", load_external_data=False)
    assert graph.graph.input[0].name == "input_ids"
    assert {i.type.tensor_type.elem_type for i in graph.graph.input if i.name.startswith("pool.")} == {
        onnx.TensorProto.BFLOAT16}
    if manifest.compiled.not_loaded is not None:
        assert "bfloat16" in manifest.compiled.not_loaded


def test_fp16_engine_matches_the_fp32_model_within_fp16_rounding(bf16_engine, tmp_path):
    checkpoint, _, _ = bf16_engine
    manifest = build(BuildOptions(checkpoint=checkpoint, output=tmp_path / "e", mtp=0, dtype="fp16", progress=False))
    model = load_model(checkpoint, mtp=False)
    state = ModelState(model.cfg, 1)
    ids = torch.randint(0, model.cfg.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids, state.positions(40), state.views()).logits.numpy()
    feeds = {"input_ids": ids.numpy(), "positions": state.positions(40).numpy(), **state.pool_feeds("fp16")}
    got = open_session(tmp_path / "e", manifest, "target").run(feeds)["logits"]
    assert np.abs(got - want).max() <= 2e-2 * max(1.0, np.abs(want).max())


def test_a_target_graph_that_serves_no_dspark_drafter_is_exported_from_the_config_without_it(tiny_checkpoint):
    """The target model reads no dspark_* field; only a DSpark drafter's captured layers shape a target graph. So a
    DSpark checkpoint built --mtp 0 (or for MTP) shares the target export of the same model without the drafter
    (checked once by exporting both: 2,650 nodes each, identical but for node names)."""
    plain = V4Config.from_file(tiny_checkpoint("mixed"))
    with_dspark = V4Config.from_file(tiny_checkpoint("mixed", drafter="dspark"))
    assert with_dspark.dspark is not None
    assert exported_config(with_dspark, reads_drafter=False) == exported_config(plain, reads_drafter=False)
    assert exported_config(with_dspark).dspark == with_dspark.dspark, "a graph that reads the drafter keeps it"
