"""Load a checkpoint folder into our model: config.json checked, every tensor checked against it, streamed in."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from v4engine.contract.config import V4Config

from .checkpoint import Checkpoint, CheckpointError, checkpoint_file
from .model import Transformer
from .model.dspark import DSpark


def open_checkpoint(directory: str | Path, mtp: bool) -> tuple[V4Config, Checkpoint]:
    """Read config.json and the safetensors headers; fail on the first thing that disagrees with the config.
    `mtp`: the draft module (whichever the checkpoint ships, `draft_module`) is checked too.

    The headers are compared with the config's sizes (layers, experts, vocabulary) before any model is built,
    so a small config.json that claims a huge model costs nothing."""
    directory = Path(directory)
    checkpoint_file(directory, "config.json", str(directory))
    cfg = V4Config.from_file(directory / "config.json")
    ckpt = Checkpoint.open(directory)
    drafter = draft_module(cfg, ckpt) if mtp else None
    check_sizes(cfg, ckpt)
    with torch.device("meta"):                      # shapes only: no memory for the weights
        expected = {name: tuple(t.shape) for name, t in Transformer(cfg, mtp=drafter == "mtp").state_dict().items()}
        if drafter == "dspark":
            expected |= {name: tuple(t.shape) for name, t in DSpark(cfg).state_dict().items()
                         if name.startswith("mtp.")}
    ckpt.check(expected)
    return cfg, ckpt


def draft_module(cfg: V4Config, ckpt: Checkpoint) -> str:
    """The drafter the checkpoint ships, as config.json and the tensors agree on: "mtp" (V4's one-layer MTP,
    mtp.0.e_proj ...) or "dspark" (the releases' DSpark, dspark_* keys and mtp.0.main_proj). Anything else is
    refused in one line (which other engines half-load as MTP), pointing at --mtp 0, which builds the target."""
    found = ckpt.draft_module
    if found is None:
        raise CheckpointError(f"{ckpt.directory}: the checkpoint has no mtp.* weights (no mtp.0.* draft module: "
                              "transformers' save_pretrained drops them), so nothing drafts; use --mtp 0 to build "
                              "without a draft graph")
    if found == "other":
        raise CheckpointError(f"{ckpt.directory}: the tensors under mtp.* are neither V4's MTP layer (mtp.0.e_proj) "
                              "nor a DSpark drafter (mtp.0.main_proj); use --mtp 0 to build the target alone")
    if (found == "dspark") != (cfg.dspark is not None):
        said = "has dspark_* fields" if cfg.dspark is not None else "has no dspark_* fields"
        raise CheckpointError(f"{cfg.source}: {said}, but the tensors under mtp.* are a "
                              f"{'DSpark drafter' if found == 'dspark' else 'V4 MTP layer'}; use --mtp 0 to build the "
                              "target alone")
    return found


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
    """Our eager V4 (+ its MTP layer, when `mtp` and the checkpoint ships one) with the checkpoint's weights,
    dequantized to `dtype`."""
    cfg, ckpt = open_checkpoint(directory, mtp)
    model = Transformer(cfg, mtp=mtp and ckpt.draft_module == "mtp")
    return _loaded(model, ckpt, progress).to_dtype(dtype).eval()


def load_dspark(directory: str | Path, dtype: torch.dtype = torch.float32) -> DSpark:
    """The checkpoint's DSpark drafter (with the target's embedding and head), dequantized to `dtype`."""
    cfg, ckpt = open_checkpoint(directory, mtp=True)
    if ckpt.draft_module != "dspark":
        raise CheckpointError(f"{ckpt.directory}: its draft module is {ckpt.draft_module}, not DSpark")
    return _loaded(DSpark(cfg), ckpt, False).to_dtype(dtype).eval()


def _loaded(model: nn.Module, ckpt: Checkpoint, progress: bool) -> nn.Module:
    """`model` with every one of its tensors read from the checkpoint (dequantized to the tensor's dtype)."""
    state = model.state_dict()
    with torch.no_grad():
        for name in tqdm(state, desc="loading weights", disable=not progress, unit="tensor"):
            target = state[name]
            target.copy_(ckpt.load(name, dtype=target.dtype if target.is_floating_point() else torch.float32))
    return model
