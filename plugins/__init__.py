"""v4engine.plugins: the custom ops of DeepSeek-V4, one module each.

Every op has a PyTorch reference (what eager code runs), a `v4::Name` node under ONNX export, and an ONNX
function of standard ops (its lowering, inlined by ONNX Runtime and MIGraphX). TensorRT plugins of the same
names come with the TensorRT backend.
"""
from __future__ import annotations

import onnx

from . import attention, compressor, indexer
from .common import DOMAIN, OPSET

_MODULES = (attention, compressor, indexer)
PLUGIN_OPS: tuple[str, ...] = tuple(f.name for m in _MODULES for f in m.PLUGIN_FUNCTIONS)


def onnx_functions() -> list[onnx.FunctionProto]:
    """Every op's lowering and the helpers they call, ready for `ModelProto.functions`."""
    out = []
    for module in _MODULES:
        for fn in module.PLUGIN_FUNCTIONS:
            proto = fn.to_function_proto()
            proto.attribute.extend(["plugin_namespace", "plugin_version"])   # carried by every call node
            out.append(proto)
        out.extend(fn.to_function_proto() for fn in module.HELPER_FUNCTIONS)
    return out


__all__ = ["DOMAIN", "OPSET", "PLUGIN_OPS", "onnx_functions"]
