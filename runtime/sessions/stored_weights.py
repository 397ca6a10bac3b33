"""Dense projections and routed experts that read their weights as the checkpoint stores them, on ONNX Runtime's CPU
provider.

An engine's graph widens an FP8 projection's weight with a blocked DequantizeLinear and a bf16 one with a Cast,
then multiplies by it (MatMul of its transpose, or Gemm with transB). ONNX Runtime folds the widening at load and
its GEMMs read float32: 4 bytes a weight, resident and read every token, where the checkpoint stores 1 (e4m3) or 2
(bf16). Its routed experts run in QMoE over int8 codes made at load from the MXFP4 bytes (1.125 bytes a weight
against 0.53), whose exact path widens each chosen expert to float32 per call. Here, before a CPU session is made,
each projection chain becomes one node of v4engine's kernels (stored_weights.cc: `E4m3MatMul`, `Bf16MatMul`; V4's
grouped wo_a too, G weights stacked in one, with the attribute `groups`) and each QMoE one `Mxfp4MoE`, reading the
stored bytes in place, memory-mapped from the checkpoint's files, and widening them inside: a value of e4m3 times
its power-of-two block scale, of bf16, or of e2m1 times 2^(e-127), is a float32 exactly, the one DequantizeLinear,
Cast or QMoE's codes make, so only the order of the float32 sums changes. The same library takes mHC's Sinkhorn
(`HcSinkhorn`), whose ONNX function ONNX Runtime runs as a Loop at a cost per round far above its arithmetic, and
the embedding's rows (`StoredRows`), read from the weight file by row: through the map, each row a token touched
faulted in the 64 KiB around it, and most of the table became resident.

The kernels are an ONNX Runtime custom-op library, compiled on first use with the machine's C++ compiler against
ONNX Runtime's C API headers (`make setup` puts them in the virtual environment: scripts/ort_headers.py), and kept
in the cache folder under a name that hashes the source, the headers and the compiler. Where either is missing the
graph is left as it is (stock kernels, float32 weights), with one warning naming what is missing.
"""
from __future__ import annotations

import hashlib
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from onnx import ModelProto, NodeProto, TensorProto, helper, numpy_helper
from onnx.external_data_helper import ExternalDataInfo

from v4engine.contract.engine_folder import OpenedFile

from .projections import attribute, graph_shapes, only_reader, projection
from .widening import stored_nbytes

DOMAIN = "v4engine.cpu"
SOURCE = Path(__file__).with_name("stored_weights.cc")
HEADERS = "V4ENGINE_ORT_INCLUDE"        # the folder of onnxruntime_cxx_api.h (default: sys.prefix/include/onnxruntime)
CACHE_DIR = "V4ENGINE_CACHE_DIR"        # where the compiled library is kept (default ~/.cache/v4engine)
FLAGS = ("-O3", "-march=native", "-std=c++17", "-fPIC", "-shared", "-fvisibility=hidden",
         "-Wno-psabi")                   # the ABI note for 64-byte vectors without AVX-512: internal functions only
LANES = 16                              # columns the kernels widen at once: an FP8 scale block must hold whole ones
SMALLEST = 1 << 18                      # weights a projection needs for its kernel: below 256K (1 MiB as float32, half
                                        # a core's L2 here; tiny-v4's projections, not its head) MLAS over float32 is
                                        # faster and its float32 is little; above (the slice's 0.5-2M, tiny-v4's head)
                                        # a decode is as fast or faster and the float32 copies held 76 MiB on the
                                        # slice (benchmarks/RESULTS.md)
SINKHORN = ("v4", "HcSinkhorn")         # the engine graphs' mHC Sinkhorn node (domain, op: plugins/sinkhorn.py)
STORED = {TensorProto.FLOAT8E4M3FN: ("E4m3MatMul", TensorProto.UINT8),
          TensorProto.BFLOAT16: ("Bf16MatMul", TensorProto.UINT16)}    # stored type -> kernel, the bytes' type
_lock = threading.Lock()
_built: dict[str, Path | str] = {}     # cache key -> the library, or why there is none


@dataclass
class Rewritten:
    """What `rewrite` did: the nodes it made, by kernel, and the stored bytes they read."""

    projections: dict[str, int]
    stored_bytes: int


def headers() -> Path | None:
    """The folder of ONNX Runtime's C++ API header, or None where it is not."""
    folder = Path(os.environ.get(HEADERS) or Path(sys.prefix) / "include" / "onnxruntime")
    return folder if (folder / "onnxruntime_cxx_api.h").is_file() else None


def library() -> Path | str:
    """The compiled kernels (built now if this source, these headers and this compiler have none yet), or a line
    saying why there are none."""
    include, compiler = headers(), os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if include is None:
        return (f"no ONNX Runtime C API headers in {os.environ.get(HEADERS) or Path(sys.prefix) / 'include'} "
                "(make setup fetches them: scripts/ort_headers.py)")
    if compiler is None:
        return "no C++ compiler (g++) on the PATH"
    digest = hashlib.sha256(SOURCE.read_bytes())
    for part in (*sorted(p.read_bytes() for p in include.glob("*.h")), compiler.encode(), " ".join(FLAGS).encode()):
        digest.update(part)
    key = digest.hexdigest()[:16]
    with _lock:
        if key not in _built:
            _built[key] = _compile(compiler, include, key)
        return _built[key]


def _compile(compiler: str, include: Path, key: str) -> Path | str:
    folder = Path(os.environ.get(CACHE_DIR) or Path.home() / ".cache" / "v4engine")
    target = folder / f"stored_weights-{key}.so"
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:         # compiled aside, then renamed: atomic for readers
        built = Path(tmp) / target.name
        run = subprocess.run([compiler, *FLAGS, f"-I{include}", str(SOURCE), "-o", str(built)],
                             capture_output=True, encoding="utf-8", errors="replace")    # (GCC quotes in UTF-8,
                                                                                         # whatever the locale)
        if run.returncode != 0:
            return f"{compiler} could not compile {SOURCE.name}: {(run.stderr.strip().splitlines() or ['?'])[0]}"
        os.replace(built, target)
    return target


def rewrite(model: ModelProto, files: Mapping[str, np.ndarray] | None = None, experts: bool = True,
            smallest: int | None = None, opened: Mapping[str, OpenedFile] | None = None) -> Rewritten:
    """Move every dense projection over a stored FP8 or bf16 weight to the kernels, in place (the module doc): a
    DequantizeLinear (axis 1, blocked by a multiple of 16) or Cast to float of a 2-D initializer read by nothing else,
    then a Transpose read only by a MatMul's second input, or a Gemm (transB, no bias, alpha 1) reading it as B, or
    a Reshape into G groups of rows, a Transpose of the last two axes and a MatMul (V4's grouped wo_a). An FP8
    weight holding a NaN code, or with a scale of 2^100 or more, stays with the stock kernels (the e4m3 kernel reads
    neither). Each mHC Sinkhorn becomes the kernels' `HcSinkhorn`. `files`: the in-memory weight files external
    initializers point into (location -> bytes). `experts`: also move each QMoE over MXFP4 experts to `Mxfp4MoE`
    (not for an engine built for QMoE's int8 activations, which asked for that kernel). `smallest`: the fewest
    weights a projection moved has (default SMALLEST). `opened`: the weight files as the engine's checks opened them
    (location -> OpenedFile); a table of at least `smallest` values there that only Gathers read (the embedding) is
    then read by `StoredRows` from its file. A graph that already uses the kernels' domain is refused (ValueError):
    only this rewrite may place them, as only it checks what they read."""
    smallest = SMALLEST if smallest is None else smallest
    if DOMAIN in _domains(model):
        raise ValueError(f"its nodes use the domain {DOMAIN}, which only the runtime places")
    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    readers: dict[str, list[NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    inputs, outputs = {i.name for i in graph.input}, {o.name for o in graph.output}
    shapes = graph_shapes(graph)
    gone, added, done, codes, tables = set(), {}, Rewritten({}, 0), {}, set()
    for node in graph.node:
        sinkhorn = _sinkhorn(node)
        if sinkhorn is not None:
            added[id(node)] = sinkhorn
            done.projections["HcSinkhorn"] = done.projections.get("HcSinkhorn", 0) + 1
            continue
        moe = _stored_experts(node, initializers, files or {}) if experts else None
        if moe is not None:
            added[id(node)] = moe
            codes |= _codes_shapes(moe, initializers)
            done.projections["Mxfp4MoE"] = done.projections.get("Mxfp4MoE", 0) + 1
            done.stored_bytes += sum(stored_nbytes(initializers[name]) for name in moe.input[2:])
            continue
        table = _stored_table(node, initializers, readers, outputs, opened or {}, smallest) \
            if node.input and node.input[0] not in inputs else None
        if table is not None:
            rows, replaced = table
            added[id(node)] = rows
            gone.update(id(n) for n in replaced)
            tables.add(node.input[0])
            done.projections["StoredRows"] = done.projections.get("StoredRows", 0) + 1
            continue
        weight = _stored_weight(node, initializers, readers, outputs)
        if weight is None or math.prod(initializers[weight].dims) < smallest \
                or not _e4m3_kernel_reads(node, initializers, files or {}):
            continue
        found = projection(node.output[0], list(initializers[weight].dims), readers, outputs, shapes)
        if found is None:
            continue
        chain, groups = found
        stored = initializers[weight]
        op, bytes_type = STORED[stored.data_type]
        x, y = chain[-1].input[0], chain[-1].output[0]
        attributes = {"block_size": attribute(node, "block_size")} if op == "E4m3MatMul" else {}
        if groups > 1:
            attributes["groups"] = groups
        added[id(chain[-1])] = helper.make_node(op, [x, *node.input[: 2 if op == "E4m3MatMul" else 1]], [y],
                                                name=f"{y}.stored", domain=DOMAIN, **attributes)
        gone.update(id(n) for n in (node, *chain[:-1]))
        stored.data_type = bytes_type                  # the same bytes, read as what they are to the kernel
        done.projections[op] = done.projections.get(op, 0) + 1
        done.stored_bytes += stored_nbytes(stored)
    for node in graph.node:                  # the shapes of codes no longer made, as constants
        if node.op_type == "Shape" and node.domain in ("", "ai.onnx") and node.input[0] in codes:
            start, end = attribute(node, "start") or 0, attribute(node, "end")
            shape = np.array(codes[node.input[0]][start:end], np.int64)
            added[id(node)] = helper.make_node("Constant", [], list(node.output), name=f"{node.output[0]}.stored",
                                               value=numpy_helper.from_array(shape))
    if added:
        kept = [added.get(id(n), n) for n in graph.node if id(n) not in gone]
        del graph.node[:]
        graph.node.extend(_live(kept, outputs))
        tables -= set().union(*map(_reads, graph.node))       # (a table some other reader kept stays)
        for t in [t for t in graph.initializer if t.name in tables]:
            graph.initializer.remove(t)                         # StoredRows reads it from its file
        if all(o.domain != DOMAIN for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return done


QMOE = {"activation_type": b"swiglu", "swiglu_fusion": 1, "activation_alpha": 1.0, "activation_beta": 0.0,
        "expert_weight_bits": 8, "block_size": 32, "quant_type": b"int"}     # as builder/backends/onnxruntime.py


def _stored_experts(node: NodeProto, initializers: dict[str, TensorProto], files: Mapping[str, np.ndarray]
                    ) -> NodeProto | None:
    """The `Mxfp4MoE` node computing this QMoE from the experts' stored bytes, or None. The builder makes QMoE's
    int8 codes from each expert's packed bytes (`<fc1>.<part>.<e>.fp4`, part 0 the gate rows and 1 the up rows, and
    `<w2>.0.<e>.fp4`, with their E8M0 bytes `….e8m0`: builder/weights.py int8_codes); the kernel reads those. Not
    where an E8M0 byte is 0 or 255 (2^-127 and NaN, which the stock path makes a subnormal and an inf)."""
    if node.domain != "com.microsoft" or node.op_type != "QMoE" or len(node.input) != 15:
        return None
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    fc1, w2 = node.input[2], node.input[5]
    if any(attributes.get(k) != v for k, v in QMOE.items()) or "swiglu_limit" not in attributes \
            or not fc1.endswith(".codes") or not w2.endswith(".codes"):
        return None
    if any(node.input[i] for i in (4, *range(7, 14))):        # biases, zero points: none in what the builder makes
        return None
    fc1, w2 = fc1.removesuffix(".codes"), w2.removesuffix(".codes")
    weights, e = [], 0
    while f"{fc1}.0.{e}.fp4" in initializers:
        for packed in (f"{fc1}.0.{e}.fp4", f"{fc1}.1.{e}.fp4", f"{w2}.0.{e}.fp4"):
            weights += [packed, f"{packed}.e8m0"]
        e += 1
    if not weights or any(name not in initializers for name in weights):
        return None
    for exponents in weights[1::2]:
        values = _bytes(initializers[exponents], files)
        if np.any(values == 0) or np.any(values == 255):
            return None
    return helper.make_node("Mxfp4MoE", [node.input[0], node.input[14], *weights], list(node.output),
                            name=f"{node.name or node.output[0]}.stored", domain=DOMAIN,
                            swiglu_limit=float(attributes["swiglu_limit"]))


def _sinkhorn(node: NodeProto) -> NodeProto | None:
    """The kernels' `HcSinkhorn` for the engine's (whose function ONNX Runtime would inline to a Loop of six nodes a
    round: about 70 us a call at one token, where the kernel takes a few), or None for any other node."""
    if (node.domain, node.op_type) != SINKHORN or len(node.input) != 1 or len(node.output) != 1:
        return None
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if not isinstance(attributes.get("rounds"), int) or not isinstance(attributes.get("eps"), float):
        return None
    return helper.make_node("HcSinkhorn", list(node.input), list(node.output), name=f"{node.name or node.output[0]}"
                            ".kernel", domain=DOMAIN, rounds=attributes["rounds"], eps=attributes["eps"])


def _stored_table(node: NodeProto, initializers: dict[str, TensorProto], readers: dict[str, list[NodeProto]],
                  outputs: set[str], opened: Mapping[str, OpenedFile], smallest: int
                  ) -> tuple[NodeProto, list[NodeProto]] | None:
    """The `StoredRows` node reading this Gather's rows from the weight file its table lies in, in the Gather's
    place, and the nodes it also replaces (the Cast to float after a bf16 one), or None. Only for a 2-D float32 or
    bf16 table of a file in `opened` (its length its dims', not a graph output), of at least `smallest` values, that
    nothing but Gathers on axis 0 reads."""
    if (node.domain, node.op_type) not in (("", "Gather"), ("ai.onnx", "Gather")) or len(node.input) != 2 \
            or (attribute(node, "axis") or 0) != 0:
        return None
    table = initializers.get(node.input[0])
    if table is None or table.name in outputs or table.data_location != TensorProto.EXTERNAL \
            or len(table.dims) != 2 or table.data_type not in (TensorProto.FLOAT, TensorProto.BFLOAT16) \
            or math.prod(table.dims) < smallest:
        return None
    if any(r.op_type != "Gather" or r.input[0] != table.name or r.input[1] == table.name
           or (attribute(r, "axis") or 0) != 0 for r in readers[table.name]):
        return None
    entry = ExternalDataInfo(table)          # (read_graph checked where it points: contract/engine_folder.py)
    where = opened.get(entry.location)
    width = 4 if table.data_type == TensorProto.FLOAT else 2
    if where is None or max(where.device, where.inode) >= 1 << 63 or entry.length != math.prod(table.dims) * width:
        return None             # (a length other than the dims': ONNX Runtime refuses that table, as it stays)
    replaced, output = [], node.output[0]
    if table.data_type == TensorProto.BFLOAT16:
        cast = only_reader(output, readers, outputs)
        if cast is None or cast.op_type != "Cast" or attribute(cast, "to") != TensorProto.FLOAT:
            return None
        replaced, output = [cast], cast.output[0]
    rows = helper.make_node("StoredRows", [node.input[1]], [output], name=f"{output}.rows", domain=DOMAIN,
                            path=str(where.path), device=where.device, inode=where.inode, file_bytes=where.bytes,
                            offset=entry.offset or 0, rows=table.dims[0], columns=table.dims[1],
                            type=table.data_type)
    return rows, replaced


def _domains(model: ModelProto) -> set[str]:
    """Every domain a node of `model` names: its graph's, its subgraphs' and its functions'."""
    found, graphs = set(), [model.graph]
    nodes = [n for f in model.functions for n in f.node]
    while graphs or nodes:
        if graphs:
            nodes.extend(graphs.pop().node)
            continue
        node = nodes.pop()
        found.add(node.domain)
        for attr in node.attribute:
            graphs.extend([attr.g] if attr.type == attr.GRAPH else attr.graphs)
    return found


def _codes_shapes(moe: NodeProto, initializers: dict[str, TensorProto]) -> dict[str, list[int]]:
    """The shapes of the int8 codes a `Mxfp4MoE` node replaces (fc1 [E, 2I, D], w2 [E, D, I]), by name: the router
    reads the expert count off them (a Shape), which must not make them."""
    experts = (len(moe.input) - 2) // 6
    gate, down = initializers[moe.input[2]].dims, initializers[moe.input[6]].dims        # [1, I, D / 4], [1, D, I / 4]
    fc1, w2 = (moe.input[i].removesuffix(".0.0.fp4") for i in (2, 6))
    return {f"{fc1}.codes": [experts, 2 * gate[1], 4 * gate[2]], f"{w2}.codes": [experts, down[1], 4 * down[2]]}


def _live(nodes: list[NodeProto], outputs: set[str]) -> list[NodeProto]:
    """`nodes` without those whose every output nothing reads (the widening of what the kernels now read); a
    subgraph's nodes (an If's branches) read the values they name from outside too."""
    needed, kept = set(outputs), []
    for node in reversed(nodes):
        if needed.intersection(node.output):
            kept.append(node)
            needed.update(_reads(node))
    return kept[::-1]


def _reads(node: NodeProto) -> set[str]:
    """The values `node` reads, its subgraphs' included."""
    names = {i for i in node.input if i}
    for attr in node.attribute:
        for graph in [attr.g] if attr.type == attr.GRAPH else attr.graphs:
            for inner in graph.node:
                names |= _reads(inner)
    return names


def _stored_weight(node: NodeProto, initializers: dict[str, TensorProto], readers: dict[str, list[NodeProto]],
                   outputs: set[str]) -> str | None:
    """The stored weight `node` widens to float32 alone (the name of a 2-D e4m3 or bf16 initializer), or None."""
    if node.domain not in ("", "ai.onnx") or not node.input or node.output[0] in outputs:
        return None
    weight = initializers.get(node.input[0])
    if weight is None or weight.data_type not in STORED or len(weight.dims) != 2 or len(readers[weight.name]) != 1:
        return None
    if node.op_type == "Cast":
        return weight.name if weight.data_type == TensorProto.BFLOAT16 and attribute(node, "to") == TensorProto.FLOAT \
            else None
    if node.op_type != "DequantizeLinear" or weight.data_type != TensorProto.FLOAT8E4M3FN or len(node.input) != 2:
        return None
    scale = initializers.get(node.input[1])
    block = attribute(node, "block_size")
    if scale is None or scale.data_type != TensorProto.FLOAT or attribute(node, "axis") not in (1, -1) or not block \
            or block % LANES \
            or list(scale.dims) != [weight.dims[0], -(-weight.dims[1] // block)]:
        return None
    return weight.name


def _e4m3_kernel_reads(node: NodeProto, initializers: dict[str, TensorProto], files: Mapping[str, np.ndarray]
                       ) -> bool:
    """Whether the e4m3 kernel computes this widening exactly (anything else: yes): no NaN code among the weight's
    bytes (it would read as 240, not NaN), no scale at or above 2^100 (the kernel multiplies it by 2^8 first)."""
    if node.op_type != "DequantizeLinear":
        return True
    codes = _bytes(initializers[node.input[0]], files)
    scales = _bytes(initializers[node.input[1]], files).view(np.float32)
    return not np.any((codes & 0x7F) == 0x7F) and bool(np.all(np.abs(scales) < 2.0 ** 100))


def _bytes(tensor: TensorProto, files: Mapping[str, np.ndarray]) -> np.ndarray:
    """An initializer's stored bytes, in place."""
    if tensor.data_location != TensorProto.EXTERNAL:
        return np.ascontiguousarray(numpy_helper.to_array(tensor)).reshape(-1).view(np.uint8)
    entry = ExternalDataInfo(tensor)
    start = entry.offset or 0
    return files[entry.location][start:start + entry.length]


_warned = False


def warn_unavailable(reason: str) -> None:
    """Say once per process that the kernels are off, and why."""
    global _warned
    if _warned:
        return
    _warned = True
    warnings.warn(f"v4engine's stored-weight kernels are off: {reason}; dense projections read float32 weights "
                  "(exact, slower, more memory)", RuntimeWarning, stacklevel=3)
