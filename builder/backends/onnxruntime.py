"""ONNX Runtime: the exported graphs are the engine; compiling means loading each one through the same links
and memory maps the runtime uses, so that a graph ONNX Runtime cannot resolve fails the build. The weights stay
in their memory-mapped files during the check, so the build's memory does not grow with the checkpoint.

The CPU execution provider has no bfloat16 kernels: a bf16 engine is checked on the CUDA provider when
onnxruntime-gpu is installed, and otherwise recorded as not loaded here (the graphs still passed onnx.checker
and strict shape inference).

`--device cuda` builds the CUDA variant (onnxruntime_cuda.py): every node on the CUDA provider, weights read as
stored, its verify and draft-cycle calls recorded as CUDA graphs; engine.json says so (`build.compile.device`).

An engine built with --cuda-graphs also records its graphs' calls as profiles (as TensorRT's), and the verify
and draft-cycle ones as those the CUDA provider records (contract/calls.py)."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from v4engine.contract.backend_options import ORT_DEVICES, OnnxRuntimeBuild, OnnxRuntimeSessionOptions
from v4engine.contract.backends import OnnxRuntimeCompiled
from v4engine.contract.calls import captured_calls
from v4engine.contract.engine import EngineManifest
from v4engine.contract.errors import V4EngineError
from v4engine.plugins import DOMAIN
from v4engine.plugins.moe import NAME as ROUTED_EXPERTS
from v4engine.runtime.sessions.onnxruntime import OnnxRuntimeSession

from . import onnxruntime_cuda
from .profiles import engine_profiles

if TYPE_CHECKING:
    from ..build import BuildOptions

MICROSOFT = "com.microsoft"


def preflight(options: OnnxRuntimeBuild) -> None:
    """The device must be one ONNX Runtime engines are built for (ONNX Runtime itself is a dependency of ours)."""
    if options.device not in ORT_DEVICES:
        raise V4EngineError(f"--device must be one of {', '.join(ORT_DEVICES)} for onnxruntime engines "
                            f"(got {options.device!r})")


def prepare_graph(model: onnx.ModelProto, name: str, options: OnnxRuntimeBuild = OnnxRuntimeBuild()
                  ) -> tuple[onnx.ModelProto, Any]:
    """The exported graph with every v4::RoutedExperts node run by ONNX Runtime's own grouped MoE (grouped_moe),
    and how many were; for --device cuda, the CUDA variant and what its preparation found."""
    if options.device == "cuda":
        return onnxruntime_cuda.prepare(model, name)
    return model, grouped_moe(model)


def compile_engine(engine_dir: Path, manifest: EngineManifest, build: BuildOptions, options: OnnxRuntimeBuild,
                   prepared: dict[str, Any]) -> OnnxRuntimeCompiled:
    """Load every graph on the provider that runs it (the module doc says how)."""
    moe = "int8" if options.int8_moe_activations else "fp32"
    profiles = engine_profiles(manifest) if options.cuda_graph_ready else None
    record = OnnxRuntimeCompiled(ort.__version__, (), moe_activations=moe, device=options.device, profiles=profiles,
                                 cuda_graphs=captured_calls(profiles) if profiles else ())
    if manifest.dtype == "bf16" or options.device == "cuda":
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            why = "built for the CUDA execution provider" if options.device == "cuda" else \
                "the CPU execution provider has no bfloat16 kernels"
            return dataclasses.replace(record, not_loaded=f"{why}; this engine runs on the CUDA execution provider "
                                       "(onnxruntime-gpu), which this ONNX Runtime has not")
        providers = ("CUDAExecutionProvider",)
    else:
        providers = ("CPUExecutionProvider",)
    manifest.compiled = record           # what the session reads of the engine (its device) while checking it
    for graph in manifest.graphs:
        OnnxRuntimeSession(engine_dir, manifest, graph, options=OnnxRuntimeSessionOptions(providers), load_check=True)
    return dataclasses.replace(record, providers_checked=providers)


# ---------------------------------------------------------------------- the routed experts
# Checked on onnxruntime 1.32.0's CPU kernels (tests/test_onnxruntime_moe.py holds them to the reference):
# - QMoE takes uint8 codes with the implicit zero point 128 and fp32 scales per 32 inputs ([E, out, in] and
#   [E, out, in/32]): MXFP4's c * 2^(e-127) is exactly (128 + 2c - 128) * 2^(e-128) (builder/weights.py writes
#   them). It is exact only on its fp32 path (ORT_QMOE_CPU_QNBIT_GEMM=fp32 when a session is made, which
#   runtime/sessions/onnxruntime.py sets); by default it quantizes activations to int8 (1e-2 off), which an engine
#   built --int8-moe-activations asks for (1.5x the slice's decode speed, lossy).
# - fc1 holds gate and up rows interleaved (swiglu_fusion=1, the only fusion the CPU kernel takes); swiglu with
#   alpha 1, beta 0 and swiglu_limit is V4's silu(min(gate, limit)) * clamp(up, -limit, limit).
# - The experts run are the top k of router_probs (ties to the higher index), so our choice goes in as 1 at the
#   chosen experts and 0 elsewhere, the mixing weights as router_weights [T, E]: a hash layer's repeated pick gets
#   its weights' sum, and the spare pick (an unchosen expert, weight 0) is skipped. So is a weight <= 1e-8.
# - MoE (float experts) has no router_weights: it takes the softmax of router_probs over the experts, so it gets
#   log(weight) at the chosen experts and -inf elsewhere (weight / sum), and its output is scaled by the sum.
MOE_ATTRIBUTES = {"activation_type": "swiglu", "swiglu_fusion": 1, "activation_alpha": 1.0, "activation_beta": 0.0,
                  "normalize_routing_weights": 0}
INT8_ATTRIBUTES = {"expert_weight_bits": 8, "block_size": 32, "quant_type": "int"}


def grouped_moe(model: onnx.ModelProto) -> int:
    """Replace each v4::RoutedExperts node by com.microsoft QMoE (its experts as int8 codes and scales, the
    `.codes`/`.scales` values builder/weights.py made of MXFP4 experts) or MoE (float experts); returns how many."""
    graph = model.graph
    produced = {out for node in graph.node for out in node.output}
    values = {v.name: v.type.tensor_type for v in graph.value_info}
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        if node.domain != DOMAIN or node.op_type != ROUTED_EXPERTS:
            nodes.append(node)
            continue
        x, indices, weights, w1, w2, w3 = node.input
        name, out = node.name or node.output[0], node.output[0]
        narrow = values[x].elem_type != onnx.TensorProto.FLOAT      # 16-bit activations: the experts run in fp32
        if narrow:
            x = _to_fp32(nodes, x)
        shape = values[indices].shape.dim
        if len(shape) != 2 or not shape[1].dim_value:
            raise V4EngineError(f"{name}: the exporter gave {indices!r} no static number of picks per token")
        attributes = {**MOE_ATTRIBUTES, "k": shape[1].dim_value,
                      "swiglu_limit": next(a.f for a in node.attribute if a.name == "limit")}
        fc1 = w1.removesuffix(".w1") + ".fc1"
        if f"{fc1}.codes" in produced:
            mixing = _router(nodes, x, indices, weights, f"{w2}.codes", name)
            chosen = _chosen(nodes, indices, name)
            inputs = [x, chosen, f"{fc1}.codes", f"{fc1}.scales", "", f"{w2}.codes", f"{w2}.scales"] + [""] * 7 + [mixing]
            nodes.append(helper.make_node("QMoE", inputs, [out], name=name, domain=MICROSOFT, **attributes,
                                          **INT8_ATTRIBUTES))
        else:
            if narrow:
                w1, w2, w3 = (_to_fp32(nodes, w) for w in (w1, w2, w3))
            mixing = _router(nodes, x, indices, weights, w2, name)
            nodes += [helper.make_node("Log", [mixing], [f"{name}.log_mixing"]),
                      helper.make_node("MoE", [x, f"{name}.log_mixing", _fc1(nodes, w1, w3), "", w2],
                                       [f"{name}.shares"], name=name, domain=MICROSOFT, **attributes),
                      helper.make_node("ReduceSum", [mixing, "v4.moe.last_axis"], [f"{name}.mixing_sum"]),
                      helper.make_node("Mul", [f"{name}.shares", f"{name}.mixing_sum"], [out])]
    count = sum(1 for n in graph.node if n.domain == DOMAIN and n.op_type == ROUTED_EXPERTS)
    if count:
        del graph.node[:]
        graph.node.extend(nodes)
        graph.initializer.extend([numpy_helper.from_array(np.array([-1], np.int64), "v4.moe.last_axis"),
                                  numpy_helper.from_array(np.array([2], np.int64), "v4.moe.rows_axis")])
        model.opset_import.append(helper.make_opsetid(MICROSOFT, 1))
    return count


def _made(nodes: list[onnx.NodeProto], value: str) -> bool:
    """Whether `value` is already made: the draft graph's k MTP steps share one layer's weights, widened once."""
    return any(value in node.output for node in nodes)


def _to_fp32(nodes: list[onnx.NodeProto], value: str) -> str:
    if not _made(nodes, f"{value}.fp32"):
        nodes.append(helper.make_node("Cast", [value], [f"{value}.fp32"], to=onnx.TensorProto.FLOAT))
    return f"{value}.fp32"


def _fc1(nodes: list[onnx.NodeProto], w1: str, w3: str) -> str:
    """fc1 of ONNX Runtime's float MoE from the gate and up weights [E, inter, in]: their rows interleaved, gate
    first ([E, 2 inter, in]; builder/weights.py does the same for int8 experts, on their packed bytes)."""
    out = f"{w1}.fc1"
    if _made(nodes, out):
        return out
    nodes += [helper.make_node("Unsqueeze", [w, "v4.moe.rows_axis"], [f"{w}.rows"]) for w in (w1, w3)]
    nodes += [helper.make_node("Concat", [f"{w1}.rows", f"{w3}.rows"], [f"{out}.pairs"], axis=2),
              helper.make_node("Shape", [w1], [f"{out}.experts"], end=1),
              helper.make_node("Shape", [w1], [f"{out}.columns"], start=2),
              helper.make_node("Concat", [f"{out}.experts", "v4.moe.last_axis", f"{out}.columns"], [f"{out}.shape"],
                               axis=0),
              helper.make_node("Reshape", [f"{out}.pairs", f"{out}.shape"], [out])]
    return out


def _router(nodes: list[onnx.NodeProto], x: str, indices: str, weights: str, experts: str, name: str) -> str:
    """Our router's mixing weights as ONNX Runtime's MoE takes them: [T, E], a repeated pick's weights added, 0 at
    unchosen experts (`{name}.zeros`, [T, E], stays for _chosen); `experts` is any [E, ...] weight."""
    nodes += [helper.make_node("Shape", [x], [f"{name}.tokens"], end=1),
              helper.make_node("Shape", [experts], [f"{name}.experts"], end=1),
              helper.make_node("Concat", [f"{name}.tokens", f"{name}.experts"], [f"{name}.route_shape"], axis=0),
              helper.make_node("ConstantOfShape", [f"{name}.route_shape"], [f"{name}.zeros"],
                               value=numpy_helper.from_array(np.zeros(1, np.float32))),
              helper.make_node("ScatterElements", [f"{name}.zeros", indices, weights], [f"{name}.mixing"], axis=1,
                               reduction="add")]
    return f"{name}.mixing"


def _chosen(nodes: list[onnx.NodeProto], indices: str, name: str) -> str:
    """QMoE's router_probs: 1 at each token's chosen experts, 0 elsewhere (after _router, whose zeros it reuses)."""
    nodes += [helper.make_node("Shape", [indices], [f"{name}.picks_shape"]),
              helper.make_node("ConstantOfShape", [f"{name}.picks_shape"], [f"{name}.ones"],
                               value=numpy_helper.from_array(np.ones(1, np.float32))),
              helper.make_node("ScatterElements", [f"{name}.zeros", indices, f"{name}.ones"], [f"{name}.chosen"],
                               axis=1, reduction="max")]
    return f"{name}.chosen"
