"""Export our V4 to ONNX: the `target` graph (any number of new tokens on existing caches) and the `draft`
graph (the MTP layer), with flat, named inputs and outputs that follow the engine contract (runtime/layout.py).

Inputs of the target graph: `input_ids`, `positions` [batch, seq], the rows' cache `slots` and `block_table`, then
one `pool.{layer}.{cache}` per group of the cache layout (rings of per-sequence slots, blocks of compressed rows),
read through builder/model/paging.py into the dense views the layers take. Outputs:
`logits`, `hidden` (pre-head streams), then one `new.{layer}.{cache}` per group: per-position deltas, or
per-window rows for the compressed caches. The draft graph runs a whole draft cycle (builder/model/drafting.py):
`hidden`, `input_ids` (the next tokens), `positions`, `lengths`, the rows' sampling settings and uniform numbers,
and its own window's pool and slots in; `drafts`, `draft_probs` and the window's new rows out. Batch, sequence and row counts are
dynamic; k is fixed per engine.

Weights are not written here: the model is exported on the meta device and the builder attaches every
initializer afterwards (builder/weights.py), pointing into the checkpoint files.
"""
from __future__ import annotations

import logging
import warnings

import onnx
import onnx_ir as ir
import torch
from onnx import helper
from torch import nn
from torch.export import Dim

from v4engine.plugins import OPSET
from v4engine.runtime.config import SLIDING, V4Config
from v4engine.runtime.layout import CacheLayout, TensorSpec, graph_specs
from v4engine.runtime.stages import Stage, single_stage

from .model import LayerCache, Transformer
from .model.drafting import draft_cycle
from .model.paging import PoolReader
from .model.rope import inv_freq


class _Graph(nn.Module):
    """Flat tensors in and out around a pipeline stage of Transformer (target) or drafting.draft_cycle (draft)."""

    def __init__(self, model: Transformer, draft: bool, stage: Stage, conditional: bool = True):
        super().__init__()
        self.model, self.draft, self.stage, self.conditional = model, draft, stage, conditional
        layout = CacheLayout(model.cfg, draft, layers=None if draft else stage.layers)
        self.groups, self.paged = layout.groups, layout.paged

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.draft:
            hidden, input_ids, positions, lengths, temperature, top_k, top_p, uniforms, slots, *pools = args
        elif self.stage.first:
            input_ids, positions, slots, *pools = args
        else:
            hidden, input_ids, positions, slots, *pools = args
        reader = PoolReader(slots, positions[:, 0], pools.pop(0) if self.paged else None)
        caches: dict[int, LayerCache] = {}
        for group, pool in zip(self.groups, pools):
            cache = caches.setdefault(group.layer, LayerCache(window_kv=None))
            setattr(cache, group.name, reader.blocks(pool) if group.ratio else reader.ring(pool))
        layers = [caches[layer] for layer in sorted(caches)]
        if self.draft:
            cycle = draft_cycle(self.model, hidden, input_ids, positions, lengths, layers[0], temperature, top_k,
                                top_p, uniforms, self.conditional)
            return (cycle.drafts, cycle.probs, *(getattr(cycle.delta, g.name) for g in self.groups))
        stage, model = self.stage, self.model
        x = model.embedded_streams(input_ids) if stage.first else hidden
        x, deltas = model.run_layers(x, input_ids, positions, layers, stage.layers)
        new = [getattr(deltas[g.layer - stage.layers.start], g.name) for g in self.groups]
        return (*([model.logits(x)] if stage.last else []), x, *new)


def _example(spec: TensorSpec, sizes: dict[str, int]) -> torch.Tensor:
    shape = [sizes[d] if isinstance(d, str) else d for d in spec.shape]
    return torch.empty(shape, dtype=getattr(torch, spec.dtype), device="meta")


def rope_table(cfg: V4Config, initializer: str) -> torch.Tensor | None:
    """The value of a rope table initializer (`layers.3.attn.rotary.inv_freq`: layer 3's kind; `mtp.*`: sliding)."""
    if not initializer.endswith("rotary.inv_freq"):
        return None
    parts = initializer.split(".")
    kind = cfg.layer_types[int(parts[1])] if parts[0] == "layers" else SLIDING
    return inv_freq(cfg.rope(kind))


def export_graph(cfg: V4Config, draft: bool, dtype: torch.dtype = torch.float32, max_batch: int = 64,
                 max_seq_len: int = 4096, mtp: int = 0, stage: Stage | None = None, conditional: bool = True
                 ) -> ir.Model:
    """The target graph (or one pipeline stage of it), or the draft graph of k = mtp drafts per call, as an onnx_ir
    Model whose checkpoint initializers have no data yet (and which holds only the initializers it reads).
    `conditional=False`: the draft without its If nodes (for CUDA graphs; builder/model/drafting.py)."""
    dtype_name = str(dtype).removeprefix("torch.")
    stage = stage or single_stage(cfg.num_hidden_layers)[0]
    with torch.device("meta"):                               # no weight memory, whatever the model size
        model = Transformer(cfg, mtp=draft, layers=range(0) if draft else stage.layers)
        model = model.stack_experts().to_dtype(dtype).eval()
    inputs, outputs = graph_specs(cfg, draft, dtype_name, mtp, None if draft else stage)
    max_blocks = CacheLayout(cfg, draft).table_blocks(max_seq_len)
    dims = {"batch": Dim("batch", min=1, max=max_batch), "seq": Dim("seq", min=1, max=max_seq_len),
            "blocks": Dim("blocks", min=0, max=max_blocks), "pool_slots": Dim("pool_slots", min=1),
            "pool_blocks": Dim("pool_blocks", min=1)}
    # Example sizes: none 0 or 1 (torch.export specializes those), and every ratio's emitted rows >= 2.
    sizes = {"batch": 2, "seq": 2 * max(cfg.compress_rates.values()) + 3, "blocks": 3, "pool_slots": 5,
             "pool_blocks": 7}
    examples = tuple(_example(s, sizes) for s in inputs)
    dynamic = tuple({i: dims[d] for i, d in enumerate(s.shape) if isinstance(d, str)} or None for s in inputs)
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)  # torchvision absent
    with warnings.catch_warnings():     # the exporter's own deprecation chatter; our checks follow the export
        warnings.simplefilter("ignore")
        graph = _Graph(model, draft, stage, conditional).eval()
        program = torch.onnx.export(graph, examples, dynamo=True, opset_version=OPSET,
                                    optimize=False, input_names=[s.name for s in inputs],
                                    output_names=[s.name for s in outputs], dynamic_shapes=(dynamic,), verbose=False)
    return program.model



def split_sequences(graph: onnx.GraphProto) -> int:
    """The exporter writes torch.split as SplitToSequence + SequenceAt: each such pair whose readers use constant
    positions becomes one Split (fewer nodes, and ops every backend parses: MIGraphX has no sequence ops).
    Returns how many."""
    nodes = list(graph.node)
    constants = {n.output[0]: onnx.numpy_helper.to_array(n.attribute[0].t) for n in nodes
                 if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"}
    readers: dict[str, list[int]] = {}                     # value -> the nodes that read it
    for i, node in enumerate(nodes):
        for value in node.input:
            readers.setdefault(value, []).append(i)
    outputs = {o.name for o in graph.output}
    replaced: dict[int, onnx.NodeProto] = {}
    for i, node in enumerate(nodes):
        if node.op_type != "SplitToSequence" or len(node.input) < 2 or node.input[1] not in constants:
            continue
        sizes = constants[node.input[1]]
        users = readers.get(node.output[0], [])
        if sizes.ndim != 1 or node.output[0] in outputs or not all(      # only constant-position SequenceAt reads
                nodes[u].op_type == "SequenceAt" and nodes[u].input[1] in constants for u in users):
            continue
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        parts = [f"{node.output[0]}.{k}" for k in range(len(sizes))]
        replaced[i] = helper.make_node("Split", [node.input[0], node.input[1]], parts, axis=axis,
                                       name=f"{node.name}.split")
        for u in users:
            index = int(constants[nodes[u].input[1]]) % len(sizes)
            replaced[u] = helper.make_node("Identity", [parts[index]], list(nodes[u].output), name=nodes[u].name)
    if replaced:
        del graph.node[:]
        graph.node.extend(replaced.get(i, node) for i, node in enumerate(nodes))
    return sum(1 for node in replaced.values() if node.op_type == "Split")


__all__ = ["export_graph", "rope_table", "split_sequences"]
