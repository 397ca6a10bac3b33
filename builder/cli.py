"""The `v4build` command line.

    v4build make-tiny OUT [--config NAME] [--quantize fp8|mxfp4] [--names official|hf] ...
    v4build check --checkpoint DIR [--mtp K]

Every failure prints one line naming the file, tensor or field at fault and exits non-zero.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from v4engine.runtime.errors import V4EngineError


def _make_tiny(args: argparse.Namespace) -> None:
    from .tiny import make_tiny

    out = make_tiny(args.out, config=args.config, seed=args.seed, quantize=args.quantize, names=args.names,
                    dtype=args.dtype, shards=args.shards, mtp=not args.no_mtp)
    print(f"wrote tiny checkpoint '{args.config}' to {out}")


def _check(args: argparse.Namespace) -> None:
    from .load import open_checkpoint

    cfg, ckpt = open_checkpoint(args.checkpoint, mtp=args.mtp > 0)
    kinds = {kind: cfg.layer_types.count(kind) for kind in dict.fromkeys(cfg.layer_types)}
    formats: dict[str, int] = {}
    for name in ckpt.names():
        fmt = ckpt.info(name).format
        formats[fmt] = formats.get(fmt, 0) + 1
    print(f"{args.checkpoint}: {len(ckpt.names())} tensors in {len(ckpt.files())} file(s), formats {formats}")
    print(f"  {cfg.num_hidden_layers} layers {kinds}, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, "
          f"experts {cfg.n_routed_experts} (top {cfg.num_experts_per_tok}), mtp layer: "
          f"{'yes' if any(n.startswith('mtp.0.') for n in ckpt.names()) else 'no'}")
    print(f"  fingerprint {ckpt.fingerprint()[:16]}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="v4build", description="Build DeepSeek-V4 (+ MTP) engines from checkpoints.")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("make-tiny", help="write a random, seeded tiny V4 checkpoint (for tests and examples)",
                       description="Write a random, seeded tiny DeepSeek-V4 checkpoint with its mtp.0.* layer.")
    t.add_argument("out", type=Path, help="output folder (replaced if it exists)")
    t.add_argument("--config", default="mixed", help="tiny config name: mixed, split_groups or flash_like "
                   "(default: mixed)")
    t.add_argument("--quantize", choices=["fp8", "mxfp4"], default=None,
                   help="fp8: FP8 e4m3 weights with 128x128 e8m0 block scales where the release has them, routed "
                   "experts too; mxfp4: the same but routed experts MXFP4, exactly like V4-Flash (default: none)")
    t.add_argument("--names", choices=["official", "hf"], default="official",
                   help="official: DeepSeek release names and config form; hf: what transformers' "
                   "save_pretrained writes (loads with DeepseekV4ForCausalLM.from_pretrained)")
    t.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="dtype of unquantized weights (hc, sink, ape and router bias stay float32)")
    t.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    t.add_argument("--shards", type=int, default=2, help="number of safetensors files (default 2; mtp.0.* in the last)")
    t.add_argument("--no-mtp", action="store_true", help="leave out the mtp.0.* draft layer")
    t.set_defaults(run=_make_tiny)

    c = sub.add_parser("check", help="read a checkpoint and check every tensor against config.json",
                       description="Read config.json and every safetensors header, and check each tensor's shape "
                       "and dtype against the config without loading the weights.")
    c.add_argument("--checkpoint", type=Path, required=True, help="checkpoint folder (config.json + safetensors)")
    c.add_argument("--mtp", type=int, default=1, help="number of MTP draft tokens planned; > 0 requires the mtp.0.* "
                   "weights (default 1)")
    c.set_defaults(run=_check)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        args.run(args)
    except V4EngineError as e:
        print(f"v4build: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("v4build: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
