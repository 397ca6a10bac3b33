"""Load a checkpoint folder into our model: config.json checked, every tensor checked against it, streamed in."""
from __future__ import annotations

from pathlib import Path

import torch
from tqdm import tqdm

from v4engine.runtime.config import V4Config

from .checkpoint import Checkpoint, CheckpointError
from .model import Transformer


def open_checkpoint(directory: str | Path, mtp: bool) -> tuple[V4Config, Checkpoint]:
    """Read config.json and the safetensors headers; fail on the first thing that disagrees with the config."""
    directory = Path(directory)
    cfg = V4Config.from_file(directory / "config.json")
    ckpt = Checkpoint.open(directory)
    if mtp and not ckpt.has_mtp_layer:
        raise CheckpointError(f"{directory}: the checkpoint has no mtp.0.* weights, which MTP drafting needs "
                              "(transformers' save_pretrained drops them); use --mtp 0 to build without a draft")
    with torch.device("meta"):                      # shapes only: no memory for the weights
        expected = {name: tuple(t.shape) for name, t in Transformer(cfg, mtp=mtp).state_dict().items()}
    ckpt.check(expected)
    return cfg, ckpt


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
