"""Load a checkpoint folder into our model: config.json checked, every tensor checked against it, streamed in."""
from __future__ import annotations

from pathlib import Path

import torch
from tqdm import tqdm

from v4engine.contract.config import V4Config

from .checkpoint import Checkpoint, CheckpointError, checkpoint_file
from .model import Transformer


def open_checkpoint(directory: str | Path, mtp: bool) -> tuple[V4Config, Checkpoint]:
    """Read config.json and the safetensors headers; fail on the first thing that disagrees with the config.

    The headers are compared with the config's sizes (layers, experts, vocabulary) before any model is built,
    so a small config.json that claims a huge model costs nothing."""
    directory = Path(directory)
    checkpoint_file(directory, "config.json", str(directory))
    cfg = V4Config.from_file(directory / "config.json")
    ckpt = Checkpoint.open(directory)
    check_draft_module(cfg, ckpt, mtp)
    check_sizes(cfg, ckpt)
    with torch.device("meta"):                      # shapes only: no memory for the weights
        expected = {name: tuple(t.shape) for name, t in Transformer(cfg, mtp=mtp).state_dict().items()}
    ckpt.check(expected)
    return cfg, ckpt


def check_draft_module(cfg: V4Config, ckpt: Checkpoint, mtp: bool) -> None:
    """--mtp drafts with V4's one-layer MTP module (mtp.0.*); refuse a checkpoint without it, or with another
    drafter in its place (V4-Flash-0731's DSpark: three blocks under mtp.0..2, no e_proj/h_proj/enorm/hnorm),
    which other engines half-load as MTP."""
    if not mtp:
        return
    found = ckpt.draft_module
    if cfg.dspark is not None or found == "other":
        what = "a DSpark drafter (config dspark_*" if cfg.dspark is not None else "a drafter that is not V4's MTP ("
        raise CheckpointError(f"{ckpt.directory}: holds {what}; mtp.* without V4's e_proj/h_proj/enorm/hnorm "
                              "layer), not the one-layer MTP module that --mtp drafts with; build its target with "
                              "--mtp 0")
    if found is None:
        raise CheckpointError(f"{ckpt.directory}: the checkpoint has no mtp.0.* weights, which MTP drafting needs "
                              "(transformers' save_pretrained drops them); use --mtp 0 to build without a draft")


def check_sizes(cfg: V4Config, ckpt: Checkpoint) -> None:
    """The config's layer count, expert count and vocabulary against what the headers hold, in time linear in
    the headers: a model (whose modules grow with layers x experts) is built only once these agree."""
    config = cfg.source
    experts: dict[int, set[int]] = {}
    for name in ckpt.names():
        parts = name.split(".")
        if parts[0] == "layers":
            layer = experts.setdefault(int(parts[1]), set())
            if parts[2:4] == ["ffn", "experts"]:
                layer.add(int(parts[4]))
    if set(experts) != set(range(cfg.num_hidden_layers)):
        raise CheckpointError(f"{config}: field 'num_hidden_layers' is {cfg.num_hidden_layers}, but the checkpoint "
                              f"holds {len(experts)} layers (indices up to {max(experts, default=-1)})")
    for layer, found in experts.items():
        if found != set(range(cfg.n_routed_experts)):
            raise CheckpointError(f"{config}: field 'n_routed_experts' is {cfg.n_routed_experts}, but layer {layer} "
                                  f"of the checkpoint holds {len(found)} experts")
    embed = ckpt.logical_shape("embed.weight")
    if embed != (cfg.vocab_size, cfg.hidden_size):
        raise CheckpointError(f"{config}: field 'vocab_size' is {cfg.vocab_size} (and hidden_size {cfg.hidden_size}), "
                              f"but embed.weight has shape {list(embed)}")


def load_model(directory: str | Path, mtp: bool = True, dtype: torch.dtype = torch.float32,
               progress: bool = False) -> Transformer:
    """Our eager V4 (+ MTP layer) with the checkpoint's weights, dequantized to `dtype`."""
    cfg, ckpt = open_checkpoint(directory, mtp)
    model = Transformer(cfg, mtp=mtp)
    state = model.state_dict()
    with torch.no_grad():
        for name in tqdm(state, desc="loading weights", disable=not progress, unit="tensor"):
            target = state[name]
            target.copy_(ckpt.load(name, dtype=target.dtype if target.is_floating_point() else torch.float32))
    return model.to_dtype(dtype).eval()
