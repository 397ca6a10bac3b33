"""v4engine.plugins: the custom ops of DeepSeek-V4, one module each.

Every op has a PyTorch reference (what eager code runs), a `v4::Name` node under ONNX export, and an ONNX
function of standard ops (its lowering, inlined by ONNX Runtime and MIGraphX). TensorRT plugins of the same
names come with the TensorRT backend (plugins/tensorrt): AOT_OPS run an ahead-of-time Triton kernel there, the
routed experts (moe.py) run their kernels' torch launcher just in time (four launches and their scratch, which
one AOT plugin cannot have). The export marks the routed experts as no plugin: ONNX Runtime replaces them by its
own grouped MoE, the TensorRT preparation makes them plugin nodes, and MIGraphX inlines their functions (over
the experts' stored bytes, as TensorRT's plugin takes them). One op is only ever
its function: mHC's Sinkhorn rounds (sinkhorn.py), an op so that the export does not trace them layer by layer.
"""
from __future__ import annotations

import onnx

from . import attention, compressor, indexer, moe, paging
from .common import DOMAIN, OPSET
from .sinkhorn import sinkhorn_function

_MODULES = (attention, compressor, indexer, moe)
PLUGIN_OPS: tuple[str, ...] = tuple(f.name for m in _MODULES for f in m.PLUGIN_FUNCTIONS)
AOT_OPS: tuple[str, ...] = tuple(name for name in PLUGIN_OPS if name not in {f.name for f in moe.PLUGIN_FUNCTIONS})


def onnx_functions(sinkhorn_rounds: int | None = None) -> list[onnx.FunctionProto]:
    """Every op's lowering and the helpers they call, ready for `ModelProto.functions`. `sinkhorn_rounds`: the
    Sinkhorn's rounds written out, no Loop (an engine for CUDA graphs; sinkhorn.py)."""
    out = [sinkhorn_function(sinkhorn_rounds), *(fn.to_function_proto() for fn in paging.HELPER_FUNCTIONS)]
    for module in _MODULES:
        for fn in module.PLUGIN_FUNCTIONS:
            proto = fn.to_function_proto()
            proto.attribute.extend(["plugin_namespace", "plugin_version"])   # carried by every call node
            out.append(proto)
        out.extend(fn.to_function_proto() for fn in module.HELPER_FUNCTIONS)
    return out


__all__ = ["DOMAIN", "OPSET", "PLUGIN_OPS", "AOT_OPS", "onnx_functions"]
