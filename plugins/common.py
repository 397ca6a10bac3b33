"""What every V4 custom op shares: its ONNX domain, the plugin attributes, and how it enters an export.

In eager PyTorch an op runs its reference code. Under `torch.onnx.export` it becomes one node of domain
`v4` carrying `plugin_namespace="v4"` and `plugin_version="1"` (so TensorRT's parser picks the plugin of
the same name), and the exported model gets the op's ONNX function (standard ops) as a local function, so
ONNX Runtime and MIGraphX inline it.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from onnxscript import opset23
from onnxscript.values import Opset

DOMAIN = "v4"
PLUGIN_VERSION = "1"
OPSET = 23                          # the default-domain opset of exported graphs and of every function body
V4 = Opset(DOMAIN, 1)
op = opset23
NEG_INF = float("-inf")


def exporting() -> bool:
    return torch.onnx.is_in_onnx_export()


def plugin_attrs(**attrs: int | float | str) -> dict[str, int | float | str]:
    return {**attrs, "plugin_namespace": DOMAIN, "plugin_version": PLUGIN_VERSION}


def symbolic(name: str, inputs: Sequence[torch.Tensor], attrs: dict, dtypes: Sequence[torch.dtype],
             shapes: Sequence[Sequence[int | torch.SymInt]], plugin: bool = True) -> list[torch.Tensor]:
    """The op as one `v4::name` node of the exported graph (outputs described by dtypes and shapes); with the
    plugin attributes unless plugin=False (an op that is only ever its ONNX function)."""
    outputs = torch.onnx.ops.symbolic_multi_out(f"{DOMAIN}::{name}", list(inputs),
                                                plugin_attrs(**attrs) if plugin else attrs,
                                                dtypes=list(dtypes), shapes=[list(s) for s in shapes], version=1)
    return [t.to(inputs[0].device) for t in outputs]     # symbolic outputs are made on the CPU
