"""`make demo`: make the tiny checkpoint, check it, build its engine with --mtp 3, and generate.

Until the runtime exists, generation is our eager model's greedy continuation, computed incrementally
(prefill, then one token at a time through the caches); the demo prints it, how far those logits are from a
full recompute, and how far the engine's logits (ONNX Runtime, the target graph) are from the model's.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from v4engine.builder.cli import main as v4build
from v4engine.builder.load import load_model
from v4engine.builder.model import ModelState
from v4engine.runtime.engine import EngineManifest
from v4engine.runtime.sessions import open_session

OUT = Path(__file__).resolve().parent.parent / "demo-out"
PROMPT = [0, 17, 42, 99, 5, 63, 8, 120, 33, 71, 2, 64]
NEW_TOKENS = 24


def main() -> int:
    checkpoint = OUT / "tiny-v4"
    if not (checkpoint / "config.json").exists():
        v4build(["make-tiny", str(checkpoint), "--config", "mixed", "--quantize", "fp8"])
    if v4build(["check", "--checkpoint", str(checkpoint), "--mtp", "3"]):
        return 1
    engine = OUT / "tiny-v4-engine"
    if not (engine / "engine.json").exists() and v4build(["--checkpoint", str(checkpoint), "--mtp", "3",
                                                           "--output", str(engine)]):
        return 1
    model = load_model(checkpoint, mtp=True)
    state = ModelState(model.cfg, 1)
    ids = torch.tensor([PROMPT])
    steps = []
    with torch.no_grad():
        out = model(ids, state.positions(ids.shape[1]), state.views())
        state.commit(out.deltas, [ids.shape[1]])
        steps.append(out.logits)
        for _ in range(NEW_TOKENS - 1):
            token = steps[-1][:, -1:].argmax(-1)
            ids = torch.cat([ids, token], dim=1)
            out = model(token, state.positions(1), state.views())
            state.commit(out.deltas, [1])
            steps.append(out.logits)
        ids = torch.cat([ids, steps[-1][:, -1:].argmax(-1)], dim=1)
        full = model(ids[:, :-1], ModelState(model.cfg, 1).positions(ids.shape[1] - 1),
                     ModelState(model.cfg, 1).views()).logits
    drift = (torch.cat(steps, dim=1) - full).abs().max().item()
    manifest = EngineManifest.read(engine)
    empty = ModelState(model.cfg, 1).views()
    feeds = {"input_ids": ids[:, :-1].numpy(), "positions": ModelState(model.cfg, 1).positions(ids.shape[1] - 1).numpy()}
    for g in manifest.cache_groups("target"):
        feeds[f"past.{g.layer}.{g.name}"] = getattr(empty[g.layer], g.name).numpy()
    engine_logits = open_session(engine, manifest, "target").run(feeds)["logits"]
    engine_drift = abs(engine_logits - full.numpy()).max()
    print(f"prompt ids:            {PROMPT}")
    print(f"greedy continuation:   {ids[0, len(PROMPT):].tolist()}")
    print(f"incremental vs full recompute, max |logit diff| over {ids.shape[1] - 1} positions: {drift:.1e}")
    print(f"engine (ONNX Runtime) vs model, max |logit diff| over the same positions: {engine_drift:.1e}")
    print("(random tiny weights: the tokens mean nothing yet; the runtime with MTP drafting comes next)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
