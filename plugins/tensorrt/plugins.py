"""The v4 ops as TensorRT "quickly deployable" Python plugins (`tensorrt.plugin`, imported as trtp).

One table, OPS, says everything op-specific: the op's PyTorch function in plugins/ (its tensor parameters are the
plugin's inputs, its keyword-only parameters the plugin's attributes, with their types and order), its Triton
torch launcher (the JIT implementation), its shapes and types (shapes.py) and how to build its launch plan
(plugins/kernels, the AOT implementation). `define(trtp, trt)` turns every row into the functions trtp asks
for; nothing here imports tensorrt, so tests hand in stand-ins for both modules.

Generated signatures. trtp reads each decorated function's signature with `inspect.signature`: `@trtp.register`
needs every input annotated `trtp.TensorDesc`, every attribute annotated with its type and a return annotation
(`TensorDesc` or a tuple of them), and the other three must name their parameters exactly (inputs, some
attributes, `outputs`, then `tactic` or `stream`); TensorRT 11.1's tensorrt/plugin/_validate.py compares the
names as a string. Python cannot spell a def whose parameters come from a table, so `_generated` builds the
`inspect.Signature` from the row, sets it as the function's `__signature__` (which inspect.signature returns as
is) and gives the body the call's arguments bound by name.

How TensorRT calls them (11.1 _plugin_class.py): register(*inputs, **attributes); autotune(*inputs, *its
attributes, outputs); aot_impl(*inputs, *every attribute, outputs, tactic), all attributes whatever subset it
declares, so ours declares all; impl(*inputs, *its attributes, outputs, stream=stream). The ONNX parser passes as
attributes exactly the fields the plugin registered (not plugin_namespace, plugin_version or aot), in
registration order. Autotune offers one combination per activation type and no custom tactics: each op has one
kernel configuration per type (the plan functions choose block sizes), so aot_impl ignores `tactic`.

AOT (`aot_impl`): one PTX kernel per (types, tactic), launched by TensorRT with the inputs, the int32 scalars
we return, then the outputs: the order of `LaunchPlan`. Plugin attributes are not serialized for AOT plugins;
ours are baked into the kernel as constexprs, and so are the dims in `OpShapes.static` (head sizes, channels),
which must therefore be fixed in the graph. Attention always runs unsplit (splits=1): key splits need a second
kernel and a workspace, which an AOT plugin cannot have; the JIT path and the torch launchers do split.

Just in time only (`plan` None, no aot_impl): the routed experts, whose call is four kernels passing scratch
(plugins/kernels/moe.py); their impl runs the torch launcher on TensorRT's stream (`run_jit`), its scratch from
torch's allocator. Their four plans are AOT-ready (the GPU check launches their PTX); an engine without Python
would need them as four plugin nodes, each with its ONNX function.
"""
from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace
from typing import Any, NamedTuple

import torch

from .. import attention, compressor, indexer, moe
from ..common import DOMAIN
from ..kernels import attention as attention_kernels
from ..kernels import compressor as compressor_kernels
from ..kernels import indexer as indexer_kernels
from ..kernels import moe as moe_kernels
from ..kernels.launch import TARGETS, LaunchPlan, compile_plan, pointer_type
from . import shapes
from .shapes import ACT, OpShapes

PlanFn = Callable[[dict[str, Any], list[str], dict[str, Any]], LaunchPlan]


@dataclass(frozen=True)
class PluginOp:
    name: str
    reference: Callable            # plugins/: inputs, attributes and semantics
    launcher: Callable             # plugins/kernels/ torch launcher: the JIT implementation
    shapes: OpShapes
    plan: PlanFn | None            # (dims, input dtype names, attributes) -> the AOT kernel's launch plan; None:
                                   # just in time only (the routed experts: four launches and their scratch)

    @property
    def inputs(self) -> list[str]:
        params = inspect.signature(self.reference).parameters.values()
        return [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]

    @property
    def attributes(self) -> dict[str, type]:
        """Attribute name -> int or float, in the order of the ONNX node and of the TensorRT fields."""
        hints = typing.get_type_hints(self.reference)
        params = inspect.signature(self.reference).parameters.values()
        return {p.name: hints[p.name] for p in params if p.kind is p.KEYWORD_ONLY}


OPS: tuple[PluginOp, ...] = (
    PluginOp("SlidingAttention", attention.sliding_attention, attention_kernels.sliding_attention,
             shapes.SLIDING_ATTENTION,
             lambda dims, dtypes, attrs: attention_kernels.plan_sliding_attention(dims, dtypes[0], splits=1,
                                                                                  **attrs)[0]),
    # Compressed rows and index keys reach the graphs only as the runtime's pools (plugins/paging.py), so HCA and
    # CSA attention and the indexer are plugins in their paged forms only, reading the pools through the block
    # table; the dense forms are ONNX functions (the paged functions' bodies) and kernels (the paged ones' core).
    PluginOp("HcaAttentionPaged", attention.hca_attention_paged, attention_kernels.hca_attention_paged,
             shapes.HCA_ATTENTION_PAGED,
             lambda dims, dtypes, attrs: attention_kernels.plan_hca_attention_paged(
                 dims, dtypes[0], page_rows=dims["page_rows"], splits=1, **attrs)[0]),
    PluginOp("CsaAttentionPaged", attention.csa_attention_paged, attention_kernels.csa_attention_paged,
             shapes.CSA_ATTENTION_PAGED,
             lambda dims, dtypes, attrs: attention_kernels.plan_csa_attention_paged(
                 dims, dtypes[0], page_rows=dims["page_rows"], splits=1, **attrs)[0]),
    PluginOp("IndexerTopKPaged", indexer.indexer_topk_paged, indexer_kernels.indexer_topk_paged,
             shapes.INDEXER_TOPK_PAGED,
             lambda dims, dtypes, attrs: indexer_kernels.plan_indexer_topk(
                 dims, dtypes[0], weights_dtype=dtypes[1], page_rows=dims["page_rows"], **attrs)),
    PluginOp("HcaCompress", compressor.hca_compress, compressor_kernels.hca_compress, shapes.HCA_COMPRESS,
             lambda dims, dtypes, attrs: compressor_kernels.plan_hca_compress(dims, dtypes[0], **attrs)),
    PluginOp("CsaCompress", compressor.csa_compress, compressor_kernels.csa_compress, shapes.CSA_COMPRESS,
             lambda dims, dtypes, attrs: compressor_kernels.plan_csa_compress(dims, dtypes[0], **attrs)),
    PluginOp("RoutedExperts", moe.routed_experts, moe_kernels.routed_experts, shapes.ROUTED_EXPERTS, None),
    PluginOp("Fp8RoutedExperts", moe.fp8_routed_experts, moe_kernels.fp8_routed_experts,
             shapes.FP8_ROUTED_EXPERTS, None),
    PluginOp("Mxfp4RoutedExperts", moe.mxfp4_routed_experts, moe_kernels.mxfp4_routed_experts,
             shapes.MXFP4_ROUTED_EXPERTS, None),
)


class TypeInfo(NamedTuple):
    member: str                    # trt.DataType member
    torch: str                     # torch dtype name
    typestr: str                   # __cuda_array_interface__ type of its storage (bf16 has none: read as int16)


TYPES = {"FP32": TypeInfo("FLOAT", "float32", "<f4"), "FP16": TypeInfo("HALF", "float16", "<f2"),
         "BF16": TypeInfo("BF16", "bfloat16", "<i2"), "INT64": TypeInfo("INT64", "int64", "<i8"),
         "INT8": TypeInfo("INT8", "int8", "|i1")}


def _type_info(trt: ModuleType, dtype: Any) -> TypeInfo:
    for info in TYPES.values():
        if getattr(trt.DataType, info.member) == dtype:
            return info
    raise TypeError(f"v4 plugins: no kernel takes TensorRT type {dtype}")


def device_target(capability: tuple[int, int] | None = None) -> str:
    """The kernels' compile target (a launch.TARGETS name) for a CUDA capability; default: the current GPU's.

    AOT kernels are compiled for the GPU of the machine that builds the engine, as TensorRT engines are."""
    if capability is None:
        capability = torch.cuda.get_device_capability()
    name = "sm{}{}".format(*capability)
    if name not in TARGETS:
        known = ", ".join(n for n, t in TARGETS.items() if t.backend == "cuda")
        raise ValueError(f"v4 plugins: no kernel target for sm_{name[2:]} (this GPU); the kernels are checked for "
                         f"{known} (plugins/kernels/launch.py TARGETS)")
    return name


def define(trtp: ModuleType, trt: ModuleType, target: str | None = None) -> None:
    """Register every op of OPS as `v4::<name>` with trtp (tensorrt.plugin, or a stand-in).

    trt gives the `DataType` of fixed-type outputs; target the AOT compile target (default: device_target())."""
    for op in OPS:
        _define_op(trtp, trt, op, target)


def _generated(signature: inspect.Signature, body: Callable[[dict[str, Any]], Any]) -> Callable:
    """A function with `signature` whose body receives the call's arguments by name (see module docstring)."""
    def function(*args: Any, **kwargs: Any) -> Any:
        return body(signature.bind(*args, **kwargs).arguments)
    function.__signature__ = signature
    return function


def _params(*names: str, annotations: dict[str, Any] | None = None) -> list[inspect.Parameter]:
    annotations = annotations or {}
    return [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                              annotation=annotations.get(n, inspect.Parameter.empty)) for n in names]


def _define_op(trtp: ModuleType, trt: ModuleType, op: PluginOp, target: str | None) -> None:
    plugin_id = f"{DOMAIN}::{op.name}"
    inputs, attributes = op.inputs, op.attributes
    n_outputs = len(op.shapes.output_types)

    def output_descs(args: dict[str, Any]) -> Any:
        descs = [args[n] for n in inputs]
        activation = descs[op.shapes.activation_input].dtype
        out_shapes = op.shapes.outputs([d.shape_expr for d in descs], {n: args[n] for n in attributes}, trtp.min)
        out = [trtp.from_shape_expr(tuple(shape), activation if t == ACT else getattr(trt.DataType, TYPES[t].member))
               for shape, t in zip(out_shapes, op.shapes.output_types)]
        return out[0] if n_outputs == 1 else tuple(out)

    def combinations(args: dict[str, Any]) -> list:
        return [trtp.AutoTuneCombination(", ".join(types), "LINEAR") for types in op.shapes.combinations()]

    def aot(args: dict[str, Any]) -> tuple[str, str, Any, Any]:
        descs, outputs = [args[n] for n in inputs], list(args["outputs"])
        types = [_type_info(trt, d.dtype).torch for d in descs + outputs]
        plan = op.plan(_plan_dims(op, descs), types[:len(descs)], {n: args[n] for n in attributes})
        _check_types(op, plan, types)
        compiled = compile_plan(plan, target or device_target())
        launch = trtp.KernelLaunchParams()
        launch.grid_x, launch.grid_y, launch.grid_z = plan.grid
        launch.block_x = plan.num_warps * 32
        launch.shared_mem = compiled.metadata.shared
        scalars = trtp.SymIntExprs.from_tuple([trtp.SymInt32(v) for v in plan.scalars.values()])
        return compiled.metadata.name, compiled.asm["ptx"], launch, scalars

    def jit(args: dict[str, Any]) -> None:
        with torch.cuda.stream(torch.cuda.ExternalStream(args["stream"])):
            run_jit(op, [_as_torch(trt, args[n]) for n in inputs], {n: args[n] for n in attributes},
                    [_as_torch(trt, out) for out in args["outputs"]])

    returns = trtp.TensorDesc if n_outputs == 1 else tuple[(trtp.TensorDesc,) * n_outputs]
    aot_returns = tuple[str, str, trtp.KernelLaunchParams, trtp.SymIntExprs]
    described = _params(*inputs, *attributes, annotations={n: trtp.TensorDesc for n in inputs} | attributes)
    trtp.register(plugin_id)(_generated(inspect.Signature(described, return_annotation=returns), output_descs))
    trtp.autotune(plugin_id)(_generated(inspect.Signature(_params(*inputs, "outputs")), combinations))
    if op.plan is not None:
        trtp.aot_impl(plugin_id)(_generated(
            inspect.Signature(_params(*inputs, *attributes, "outputs", "tactic"), return_annotation=aot_returns),
            aot))
    trtp.impl(plugin_id)(_generated(inspect.Signature(_params(*inputs, *attributes, "outputs", "stream")), jit))


def run_jit(op: PluginOp, inputs: list[torch.Tensor], attributes: dict[str, Any], outputs: list[torch.Tensor]
            ) -> None:
    """The plugin's just-in-time implementation on torch tensors: its launcher's results into TensorRT's outputs."""
    results = op.launcher(*inputs, **attributes)
    for out, result in zip(outputs, results if isinstance(results, tuple) else (results,)):
        out.copy_(result)


def _plan_dims(op: PluginOp, descs: list) -> dict[str, Any]:
    """The plan's dims from the inputs' shape expressions; the static ones as ints."""
    dims = op.shapes.dims([d.shape_expr for d in descs])
    for name in op.shapes.static:
        dim = dims[name]
        if not isinstance(dim, int):
            if not dim.is_constant:
                raise ValueError(f"{DOMAIN}::{op.name}: dim {name} is dynamic in the graph, but the AOT kernel bakes "
                                 "it in; export it with a fixed size")
            dims[name] = dim.constant_value()
    return dims


def _check_types(op: PluginOp, plan: LaunchPlan, torch_types: list[str]) -> None:
    """The kernel's pointer types are those TensorRT chose for the I/O (inputs, then outputs): shapes.py's rules
    and the plan agree, or TensorRT would launch the kernel on buffers of other types."""
    want = [pointer_type(t) for t in torch_types]
    got = list(plan.inputs.values()) + list(plan.outputs.values())
    if got != want:
        raise TypeError(f"{DOMAIN}::{op.name}: TensorRT's I/O types {want} differ from the kernel's {got}")


def _as_torch(trt: ModuleType, tensor: Any) -> torch.Tensor:
    """A zero-copy torch view of a trtp.Tensor on the GPU (trtp's own __cuda_array_interface__ refuses BF16)."""
    info = _type_info(trt, tensor.dtype)
    dtype = getattr(torch, info.torch)
    strides = None if tensor.strides is None else tuple(s * dtype.itemsize for s in tensor.strides)
    interface = {"shape": tuple(tensor.shape), "typestr": info.typestr, "data": (tensor.data_ptr, False),
                 "strides": strides, "version": 3}
    return torch.as_tensor(SimpleNamespace(__cuda_array_interface__=interface), device="cuda").view(dtype)
