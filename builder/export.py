"""Export our V4 to ONNX: the `target` graph (any number of new tokens on existing caches; or one pipeline stage of
it) and the engine's `draft` graph, with flat, named inputs and outputs that follow the engine contract
(contract/layout.py `target_specs`, and the drafter's DraftSpec, contract/drafting.py).

Inputs of the target graph: `input_ids`, `positions` [batch, seq], the rows' cache `slots` and `block_table`, then
one `pool.{layer}.{cache}` per group of the cache layout (rings of per-sequence slots, blocks of compressed rows),
read through builder/model/paging.py into the dense views the layers take. Outputs: `logits`, `hidden` (pre-head
streams), what the drafter reads beside them, then one `new.{layer}.{cache}` per group: per-position deltas, or
per-window rows for the compressed caches. The draft graph is its method's forward (`DRAFT_FORWARDS`), fed its
inputs by name; for MTP a whole draft cycle (builder/model/drafting.py). Batch, sequence and row counts are
dynamic; k is fixed per engine.

Weights are not written here: the model is exported on the meta device and the builder attaches every
initializer afterwards (builder/weights.py), pointing into the checkpoint files.
"""
from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import onnx
import onnx_ir as ir
import torch
from onnx import helper
from torch import nn
from torch.export import Dim

from v4engine.contract.config import SLIDING, V4Config
from v4engine.contract.drafting import DraftSpec
from v4engine.contract.engine import MAX_BATCH
from v4engine.contract.layout import CAPTURED, CAPTURED_IN, STAGE_INPUT, STREAMS, CacheGroup, CacheLayout, TensorSpec, target_specs
from v4engine.contract.stages import Stage, single_stage
from v4engine.plugins import OPSET

from .model import LayerCache, Transformer
from .model.drafting import dspark_draft_outputs, mtp_draft_outputs
from .model.dspark import DSpark, capture
from .model.paging import PoolReader
from .model.rope import inv_freq

Feeds = dict[str, torch.Tensor]


@dataclass(frozen=True)
class DraftForward:
    """A drafting method's graph: the module holding its weights (official names) and its forward over the graph's
    inputs by name and its cache views (one per layer of its layout) -> its outputs by name, `new.*` included.
    `conditional`: False for CUDA graphs (no If nodes)."""

    model: Callable[[V4Config], nn.Module]
    forward: Callable[[nn.Module, Feeds, list[LayerCache], list[CacheGroup], bool], Feeds]


DRAFT_FORWARDS: dict[str, DraftForward] = {
    "mtp": DraftForward(lambda cfg: Transformer(cfg, mtp=True, layers=range(0)), mtp_draft_outputs),
    "dspark": DraftForward(DSpark, dspark_draft_outputs),
}


def _layer_caches(feeds: Feeds, layout: CacheLayout) -> list[LayerCache]:
    """Each layer's cache views (LayerCache), read from the call's pools through its slots and block table."""
    positions = feeds["positions"]
    reader = PoolReader(feeds["slots"], positions[:, 0], feeds.get("block_table"))
    caches: dict[int, LayerCache] = {}
    for group in layout.groups:
        cache = caches.setdefault(group.layer, LayerCache(window_kv=None))
        pool = feeds[group.pool]
        setattr(cache, group.name, reader.blocks(pool) if group.ratio else reader.ring(pool))
    return [caches[layer] for layer in sorted(caches)]


class _Graph(nn.Module):
    """Flat tensors in and out, by the contract's names, around a graph's forward (feeds by name -> outputs)."""

    def __init__(self, model: nn.Module, inputs: list[TensorSpec], outputs: list[TensorSpec], layout: CacheLayout,
                 forward: Callable[[nn.Module, Feeds, list[LayerCache]], Feeds]):
        super().__init__()
        self.model, self.layout, self.run = model, layout, forward
        self.input_names, self.output_names = [s.name for s in inputs], [s.name for s in outputs]

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        feeds = dict(zip(self.input_names, args))
        out = self.run(self.model, feeds, _layer_caches(feeds, self.layout))
        return tuple(out[name] for name in self.output_names)


def _target_outputs(stage: Stage, layout: CacheLayout, draft: DraftSpec | None
                    ) -> Callable[[nn.Module, Feeds, list[LayerCache]], Feeds]:
    """A target stage's forward: embed (first stage) or take the previous stage's streams, run its layers, and the
    head (last stage), with what the drafter reads of them: DSpark's `captured` rows, the previous stage's
    (`captured_in`) followed by those of its own captured layers."""
    ids = draft.captured_layers(layout.cfg) if draft is not None else ()
    mine = tuple(i for i in ids if i in stage.layers)
    carries = any(i < stage.layers.stop for i in ids)

    def forward(model: Transformer, feeds: Feeds, caches: list[LayerCache]) -> Feeds:
        x = model.embedded_streams(feeds["input_ids"]) if stage.first else feeds[STAGE_INPUT]
        x, deltas, streams = model.run_layers(x, feeds["input_ids"], feeds["positions"], caches, stage.layers, mine)
        out = {g.new: getattr(deltas[g.layer - stage.layers.start], g.name) for g in layout.groups}
        if carries:
            parts = ([feeds[CAPTURED_IN]] if CAPTURED_IN in feeds else []) + \
                ([capture([streams[i] for i in mine])] if mine else [])
            out[CAPTURED] = torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]
        return out | {STREAMS: x} | ({"logits": model.logits(x)} if stage.last else {})

    return forward



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


def export_target(cfg: V4Config, dtype: torch.dtype = torch.float32, stage: Stage | None = None,
                  draft: DraftSpec | None = None) -> ir.Model:
    """The target graph, or one pipeline stage of it (returning what `draft` reads of the last stage too), as an
    onnx_ir Model whose checkpoint initializers have no data yet (and which holds only the initializers it reads)."""
    stage = stage or single_stage(cfg.num_hidden_layers)[0]
    dtype_name = str(dtype).removeprefix("torch.")
    extra = draft.stage_io(cfg, dtype_name, stage) if draft is not None else ((), ())
    with torch.device("meta"):                               # no weight memory, whatever the model size
        model = Transformer(cfg, mtp=False, layers=stage.layers).stack_experts().to_dtype(dtype).eval()
    inputs, outputs = target_specs(cfg, dtype_name, stage, *extra)
    layout = CacheLayout.target(cfg, layers=stage.layers)
    return _export(_Graph(model, inputs, outputs, layout, _target_outputs(stage, layout, draft)), cfg, inputs, outputs)


def export_draft(cfg: V4Config, draft: DraftSpec, k: int, dtype: torch.dtype = torch.float32,
                 conditional: bool = True) -> ir.Model:
    """The draft graph of `draft`'s method, k drafts per call (`conditional=False`: without If nodes, for CUDA
    graphs; builder/model/drafting.py), as export_target's."""
    method = DRAFT_FORWARDS[draft.method]
    with torch.device("meta"):
        model = method.model(cfg).stack_experts().to_dtype(dtype).eval()
    inputs, outputs = draft.graph_specs(cfg, str(dtype).removeprefix("torch."), k)
    layout = draft.layout(cfg)

    def forward(module: nn.Module, feeds: Feeds, caches: list[LayerCache]) -> Feeds:
        return method.forward(module, feeds, caches, layout.groups, conditional)

    return _export(_Graph(model, inputs, outputs, layout, forward), cfg, inputs, outputs)


def _export(graph: _Graph, cfg: V4Config, inputs: list[TensorSpec], outputs: list[TensorSpec]) -> ir.Model:
    """The export, for every batch and length the limits allow (MAX_BATCH, max_position_embeddings): an engine's
    own limits bound its sessions, not its graphs, so engines that differ only in limits share one export."""
    max_seq_len = cfg.max_position_embeddings
    max_blocks = CacheLayout.target(cfg).table_blocks(max_seq_len)
    dims = {"batch": Dim("batch", min=1, max=MAX_BATCH), "seq": Dim("seq", min=1, max=max_seq_len),
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
        program = torch.onnx.export(graph.eval(), examples, dynamo=True, opset_version=OPSET,
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


__all__ = ["DRAFT_FORWARDS", "DraftForward", "export_draft", "export_target", "rope_table", "split_sequences"]
