"""`v4build --backend migraphx`, checked as far as a machine without ROCm allows.

1. The MIGraphX variant (functions inlined, sequences split, routed experts as their stored bytes, other quantized
   weights dequantized, opset 19) runs on ONNX Runtime's CPU provider and computes what the portable engine
   computes, within 1e-4, for target and draft.
2. The allowlist check (ops, types and opset of MIGraphX's parser, read from its sources) passes on the variant
   and names each planted offender: a standard Attention node, RMSNormalization, a FLOAT8E4M3FN initializer,
   an opset beyond 19.
3. Without MIGraphX the engine folder carries compile_migraphx.sh, and opening it fails with one clear line.
"""
from __future__ import annotations

import dataclasses
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import onnx
import pytest
from onnx import TensorProto, helper

from v4engine.builder.backends.compare import compare_with_onnxruntime
from v4engine.builder.backends.migraphx import MIGraphXCheckError, allowlist, check, offenders
from v4engine.builder.build import BuildOptions, build
from v4engine.runtime.backends import Program
from v4engine.runtime.engine import EngineManifest
from v4engine.runtime.generator import Generator
from v4engine.runtime.sessions import open_session

pytestmark = pytest.mark.xdist_group("migraphx_backend")


@pytest.fixture(scope="module")
def engines(tiny_checkpoint, tmp_path_factory):
    """(MIGraphX engine, portable ONNX Runtime engine) of one MXFP4 tiny checkpoint."""
    checkpoint = tiny_checkpoint("flash_like", quantize="mxfp4")
    work = tmp_path_factory.mktemp("migraphx")
    common = dict(checkpoint=checkpoint, mtp=2, max_batch=4, max_seq_len=256, max_prefill_chunk=16, progress=False)
    build(BuildOptions(output=work / "migraphx", backend="migraphx", **common))
    build(BuildOptions(output=work / "onnxruntime", **common))
    return work / "migraphx", work / "onnxruntime"


def graph(engine: Path, name: str) -> onnx.ModelProto:
    return onnx.load(str(engine / f"{name}.onnx"), load_external_data=False)


def test_variant_runs_on_onnxruntime_and_equals_the_portable_engine(engines):
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx

    migraphx, portable = engines
    same, verdict = compare_with_onnxruntime(
        EngineManifest.read(migraphx), portable,
        lambda name: OnnxrtRunner(SessionFromOnnx(str(migraphx / f"{name}.onnx"))), atol=1e-4)
    assert same, verdict
    assert verdict.startswith("target matches, draft matches")


def test_variant_is_what_migraphx_parses(engines):
    migraphx, _ = engines
    manifest = EngineManifest.read(migraphx)
    for name in ("target", "draft"):
        model = graph(migraphx, name)
        assert offenders(model) == []
        assert not model.functions and [(o.domain, o.version) for o in model.opset_import] == [("", 19)]
        assert {n.op_type for n in model.graph.node} <= set(allowlist()["ops"])
        assert not {"SplitToSequence", "SequenceAt", "DequantizeLinear"} & {n.op_type for n in model.graph.node}
    assert manifest.build["weights"]["fp8 in place + dequantize"] == 0 and manifest.build["weights"]["converted"] > 0
    assert manifest.build["weights"]["fp4 in place, bytes for the kernel"] > 0
    for groups in manifest.build["weight_groups"].values():
        assert list(groups["routed experts"]["resident"]) == ["as stored + float32 scales"], "no expert converted"
    assert manifest.compiled.allowlist["migraphx"] == allowlist()["migraphx_version"]
    assert [p.name for p in manifest.compiled.profiles["draft"]] == ["extend", "cycle"]
    assert manifest.compiled.variant["draft"].opset == 19


def test_allowlist_names_the_migraphx_sources_it_was_read_from():
    allowed = allowlist()
    assert re.fullmatch(r"[0-9a-f]{40}", allowed["source"]["commit"]) and allowed["max_opset"] == 19
    assert "RMSNormalization" not in allowed["ops"] and "FLOAT8E4M3FN" in allowed["types_rejected"]
    assert "FLOAT8E4M3FNUZ" in allowed["types_accepted"]


def test_allowlist_check_names_every_planted_offender(engines):
    migraphx, _ = engines
    model = graph(migraphx, "draft")
    x = model.graph.input[0].name
    model.graph.node.extend([
        helper.make_node("Attention", [x, x, x], ["planted.attention"], name="planted_attention"),
        helper.make_node("RMSNormalization", [x, "planted.scale"], ["planted.norm"], name="planted_norm")])
    model.graph.initializer.append(helper.make_tensor("planted.fp8", TensorProto.FLOAT8E4M3FN, [2], [1.0, 2.0]))
    model.opset_import[0].version = 23
    found = offenders(model)
    assert "opset 23 (MIGraphX documents up to 19)" in found
    assert any(f.startswith("op Attention (node 'planted_attention'): MIGraphX reads it as the contrib op")
               for f in found)
    assert "op RMSNormalization (node 'planted_norm')" in found
    assert "type FLOAT8E4M3FN (initializer 'planted.fp8')" in found
    assert len(found) == 4
    with pytest.raises(MIGraphXCheckError) as failure:
        check(model, migraphx / "draft.onnx")
    message = str(failure.value)
    assert "\n" not in message and message.startswith(f"{migraphx / 'draft.onnx'}: MIGraphX 2.15.0")


def test_without_migraphx_the_engine_carries_its_compile_script_and_does_not_open(engines):
    migraphx, _ = engines
    manifest = EngineManifest.read(migraphx)
    script = migraphx / "compile_migraphx.sh"
    assert script.stat().st_mode & 0o111 and "v4engine.builder.backends.migraphx" in script.read_text()
    assert manifest.compiled.programs is None
    with pytest.raises(Exception, match="MIGraphX") as failure:
        Generator.from_engine_dir(migraphx)
    assert "\n" not in str(failure.value)


def test_the_session_loads_one_program_per_profile_in_their_order(engines, tmp_path, monkeypatch):
    """MIGraphX's module stood in for: a graph's session loads the programs engine.json's compile record names for
    it, one per optimization profile, in the profiles' order, each checked by the engine folder first."""
    from v4engine.runtime.sessions import migraphx as session_module

    engine = Path(shutil.copytree(engines[0], tmp_path / "engine", symlinks=True))
    manifest = EngineManifest.read(engine)
    programs = {graph: tuple(Program(p.name, f"{graph}.{p.name}.mxr") for p in profiles)
                for graph, profiles in manifest.compiled.profiles.items()}
    for program in (p for graph_programs in programs.values() for p in graph_programs):
        (engine / program.file).write_bytes(b"program")
    manifest.compiled = dataclasses.replace(manifest.compiled, migraphx="stand-in", programs=programs)
    manifest.write(engine)
    loaded = []
    monkeypatch.setattr(session_module, "_migraphx", lambda: SimpleNamespace(load=loaded.append))
    open_session(engine, EngineManifest.read(engine), "draft")
    assert [Path(path).name for path in loaded] == ["draft.extend.mxr", "draft.cycle.mxr"]
