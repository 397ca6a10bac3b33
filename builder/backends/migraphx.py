"""MIGraphX (ROCm): the portable graphs rewritten into what MIGraphX's ONNX parser reads, then compiled for the GPU.

MIGraphX's parser (read from its sources: migraphx_ops.json names the release) dispatches on op_type alone, never
reads model-local functions, documents opsets up to 19 and rejects FLOAT8E4M3FN tensors. So for each graph:
1. the v4 op functions are inlined (onnx.inliner): the engine runs their standard-op bodies, all of them ops
   the parser has (the build already made the exporter's sequence ops one Split: export.split_sequences);
2. quantized routed experts arrive as their stored bytes (int8, in place) with fp32 scales, and their nodes become
   the ops that take them (builder/weights.py, STORED_BYTES: Fp8RoutedExperts, Mxfp4RoutedExperts), whose
   inlined bodies gather the chosen experts' bytes and decode only those at run time: nothing to fold, so the
   experts stay as stored in device memory too (MIGraphX's own MoE, parse_moe.cpp, is in no release: ROCm 7.2.4
   has none). Every other quantized weight arrives dequantized (the registry keeps no format quantized in place
   for MIGraphX), so no FLOAT8E4M3FN tensor and no blocked DequantizeLinear remain;
3. the opset is lowered to 19 (`lower_opset`), and onnx.checker and strict shape inference prove it;
4. `check` compares every op, tensor type and the opset with the allowlist and fails the build with one line
   naming every offender.
Then, where the `migraphx` module imports, each graph is compiled once per bucket of its optimization profiles
(static shapes, contract/buckets.py: MIGraphX's releases compile a graph of several dynamic dimensions only behind
a development option, and take the caller's output buffers only at static shapes), with offload_copy off and the
weights as parameters (so that the buckets' programs share one copy of them on the GPU), and saved as
`{graph}.{bucket}.mxr`; elsewhere the engine folder gets `compile_migraphx.sh`, which does the same on the ROCm
machine (`python -m v4engine.builder.backends.migraphx`).
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import onnx
from onnx import inliner
from tqdm import tqdm

from v4engine.contract.backend_options import MIGraphXBuild
from v4engine.contract.backends import MIGRAPHX_SCRIPT, MIGraphXCompiled, Program, Variant
from v4engine.contract.buckets import graph_buckets
from v4engine.contract.engine import EngineManifest
from v4engine.contract.engine_folder import EngineFolder
from v4engine.contract.errors import V4EngineError
from v4engine.contract.profiles import Profile
from v4engine.runtime.sessions.migraphx import parameter_type, weight_parameters

from ..weights import use_stored_experts
from .profiles import engine_profiles

if TYPE_CHECKING:
    from ..build import BuildOptions

ALLOWLIST = Path(__file__).with_name("migraphx_ops.json")


class MIGraphXCheckError(V4EngineError):
    """A graph holds something MIGraphX's ONNX parser would reject."""


@cache
def allowlist() -> dict[str, Any]:
    """migraphx_ops.json: the parser's ops, accepted and rejected types, documented opset, and their source."""
    return json.loads(ALLOWLIST.read_text())


def lower_opset(model: onnx.ModelProto, opset: int) -> None:
    """Declare the default-domain opset `opset`. Between 19 and 23 our ops changed only by taking more types
    (bf16 Cos/Sin/Softplus at 22, 4-bit and FP8 types at 21/23) or blocked DequantizeLinear (21), which the
    variant no longer holds; onnx.checker and strict, type-checked shape inference against the older schemas then
    prove it (onnx.version_converter cannot run on graphs whose initializers are external and unloaded)."""
    for node in all_nodes(model.graph):
        onnx.defs.get_schema(node.op_type, opset)           # raises for an op that did not exist yet
    for entry in model.opset_import:
        if entry.domain in ("", "ai.onnx"):
            entry.version = opset


def all_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    """The graph's nodes and those of every subgraph in them (Loop bodies, If branches), depth first."""
    for node in graph.node:
        yield node
        for attribute in node.attribute:
            for subgraph in [attribute.g] if attribute.HasField("g") else attribute.graphs:
                yield from all_nodes(subgraph)


def offenders(model: onnx.ModelProto) -> list[str]:
    """Everything in `model` MIGraphX's parser would reject, one short phrase each (empty: it parses)."""
    allowed = allowlist()
    ops, rejected = set(allowed["ops"]), set(allowed["types_rejected"])
    found: list[str] = []
    opset = max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0)
    if opset > allowed["max_opset"]:
        found.append(f"opset {opset} (MIGraphX documents up to {allowed['max_opset']})")
    if model.functions:
        found.append(f"{len(model.functions)} model-local function(s) such as {model.functions[0].name} "
                     "(never parsed)")
    for node in all_nodes(model.graph):
        where = f"node '{node.name or node.output[0]}'"
        if node.op_type not in ops:
            found.append(f"op {node.op_type} ({where})")
        elif node.op_type in allowed["contrib_semantics"] and node.domain in ("", "ai.onnx"):
            found.append(f"op {node.op_type} ({where}): MIGraphX reads it as the contrib op, "
                         f"{allowed['contrib_semantics'][node.op_type]}")
        for a in node.attribute:
            if a.name == "to" and onnx.TensorProto.DataType.Name(a.i) in rejected:
                found.append(f"type {onnx.TensorProto.DataType.Name(a.i)} ({where} casts to it)")
    typed = [(t.name, t.data_type, "initializer") for t in model.graph.initializer]
    typed += [(v.name, v.type.tensor_type.elem_type, "value") for v in
              [*model.graph.input, *model.graph.output, *model.graph.value_info]]
    for name, data_type, kind in typed:
        type_name = onnx.TensorProto.DataType.Name(data_type)
        if type_name in rejected:
            found.append(f"type {type_name} ({kind} '{name}')")
    return found


def check(model: onnx.ModelProto, name: str | Path) -> None:
    """MIGraphXCheckError naming every offender, in one line (`name`: the graph's, or its file)."""
    found = offenders(model)
    if found:
        allowed = allowlist()
        raise MIGraphXCheckError(f"{name}: MIGraphX {allowed['migraphx_version']}'s ONNX parser would reject: "
                                 + "; ".join(found))


def preflight(options: MIGraphXBuild) -> None:
    """Nothing to check: without MIGraphX the build leaves compile_migraphx.sh instead of programs."""


def prepare_graph(model: onnx.ModelProto, name: str, options: MIGraphXBuild | None = None
                  ) -> tuple[onnx.ModelProto, Variant]:
    """The portable graph `name` as the MIGraphX variant (steps 1-4 of the module doc; the build then runs the
    checker and strict shape inference on it, step 3's proof): (variant, what to record of it)."""
    use_stored_experts(model)
    model = inliner.inline_local_functions(model)
    del model.functions[:]
    kept = [o for o in model.opset_import if o.domain in ("", "ai.onnx")]
    del model.opset_import[:]
    model.opset_import.extend(kept)
    lower_opset(model, allowlist()["max_opset"])
    check(model, name)
    return model, Variant(len(model.graph.node), allowlist()["max_opset"])


def weights_as_inputs(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of a variant whose weights (the initializers held in the engine's weight files) are graph inputs
    instead: what each program is compiled from, so that it takes them by address and all of a graph's programs
    share one copy on the GPU (runtime/sessions/migraphx.py loads them; bf16 ones as float32, `parameter_type`).
    Small constants stay inside."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    moved = {t.name for t in weight_parameters(out.graph)}
    kept = [t for t in out.graph.initializer if t.name not in moved]
    out.graph.input.extend(onnx.helper.make_tensor_value_info(t.name, parameter_type(t.data_type), list(t.dims))
                           for t in weight_parameters(out.graph))
    del out.graph.initializer[:]
    out.graph.initializer.extend(kept)
    return out


def compile_programs(engine_dir: Path, manifest: EngineManifest, migraphx: Any,
                     graph_profiles: Mapping[str, Sequence[Profile]], progress: bool = True
                     ) -> dict[str, tuple[Program, ...]]:
    """Compile every graph once per bucket of its profiles (contract/buckets.py) for the GPU, static shapes, outputs
    in the caller's buffers (offload_copy off), weights as parameters; save `{graph}.{bucket}.mxr`."""
    if manifest.dtype == "bf16":
        raise MIGraphXCheckError(f"{engine_dir}: a bf16 engine, and MIGraphX's Python bindings (up to ROCm 7.2.4) "
                                 "take no bf16 buffers: build it with --dtype fp16 or fp32 for MIGraphX's programs "
                                 "(onnxruntime-migraphx runs it as it is)")
    folder = EngineFolder(engine_dir)       # compile_migraphx.sh runs on an engine folder from elsewhere
    out: dict[str, tuple[Program, ...]] = {}
    for graph, entry in manifest.graphs.items():
        model = onnx.ModelProto.FromString(folder.read_bytes(entry.file, f"graphs.{graph}.file", "graph"))
        data = weights_as_inputs(model).SerializeToString()       # no initializer left outside: parsed from bytes
        programs = []
        for bucket in tqdm(graph_buckets(graph_profiles[graph], entry.inputs), desc=f"MIGraphX {graph}",
                           unit="program", disable=not progress):
            program = migraphx.parse_onnx_buffer(data, map_input_dims={spec.name: list(bucket.shape(spec))
                                                                       for spec in entry.inputs})
            program.compile(migraphx.get_target("gpu"), offload_copy=False)
            file = f"{graph}.{bucket.name}.mxr"
            _save(migraphx, program, engine_dir / file)
            programs.append(Program(bucket.name, file))
        out[graph] = tuple(programs)
    return out


def _save(migraphx: Any, program: Any, path: Path) -> None:
    """Save a program at `path` in its engine folder: written under a fresh name, then renamed over `path`, so that
    a link planted there is replaced, never followed out of the folder."""
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        migraphx.save(program, temporary)
        os.replace(temporary, path)
    finally:
        if os.path.lexists(temporary):
            os.unlink(temporary)


def compile_engine(engine_dir: Path, manifest: EngineManifest, build: BuildOptions, options: MIGraphXBuild,
                   prepared: dict[str, Variant]
                   ) -> MIGraphXCompiled:
    """Compile every graph's variant (prepared: what prepare_graph recorded of each) where MIGraphX imports, else
    leave compile_migraphx.sh for the ROCm machine; returns engine.json's build.compile."""
    allowed = allowlist()
    graph_profiles = engine_profiles(manifest)
    try:
        import migraphx
    except ImportError:
        script = engine_dir / MIGRAPHX_SCRIPT
        script.write_text("#!/usr/bin/env bash\n# Compile this engine's MIGraphX programs (one .mxr per graph and "
                          "bucket of static shapes)\n# on a ROCm machine with MIGraphX's Python module and v4engine "
                          "installed.\nset -euo pipefail\nexec python3 -m v4engine.builder.backends.migraphx "
                          "\"$(dirname \"$0\")\"\n")
        script.chmod(0o755)
        version, programs = "not installed here: run compile_migraphx.sh on the ROCm machine", None
    else:
        version = getattr(migraphx, "__version__", "unknown")
        programs = compile_programs(engine_dir, manifest, migraphx, graph_profiles, build.progress)
    return MIGraphXCompiled({"migraphx": allowed["migraphx_version"], "source": allowed["source"]}, prepared,
                            graph_profiles, version, programs)


def main(argv: list[str] | None = None) -> int:
    """`python -m v4engine.builder.backends.migraphx ENGINE_DIR`: compile a prepared engine's programs (ROCm)."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m v4engine.builder.backends.migraphx ENGINE_DIR", file=sys.stderr)
        return 2
    import migraphx

    engine_dir = Path(argv[0])
    manifest = EngineManifest.read(engine_dir)
    if not isinstance(manifest.compiled, MIGraphXCompiled):
        print(f"{engine_dir}: a {manifest.backend} engine, not a MIGraphX one", file=sys.stderr)
        return 1
    programs = compile_programs(engine_dir, manifest, migraphx, manifest.compiled.profiles)
    manifest.compiled = dataclasses.replace(manifest.compiled, migraphx=getattr(migraphx, "__version__", "unknown"),
                                            programs=programs)
    manifest.write(engine_dir)
    print(f"compiled {engine_dir}: " + ", ".join(p.file for ps in programs.values() for p in ps))
    return 0



__all__ = ["allowlist", "offenders", "check", "preflight", "prepare_graph", "compile_engine", "MIGraphXCheckError"]

if __name__ == "__main__":
    sys.exit(main())
