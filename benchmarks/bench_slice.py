"""The slice: a V4 wide enough that routed experts are most of its bytes, against transformers on the same weights.

The checkpoint is `v4build make-tiny --config slice --quantize mxfp4 --dtype bfloat16` (hidden 1024, a sliding, a
CSA and an HCA layer and the MTP layer, 64 experts top-6, MXFP4 experts and FP8 block weights as released; made
here when --checkpoint does not exist). One run reports:
- memory: a fresh process opens the engine (Generator, MTP 0): anonymous and file-backed RSS after the load, and
  the peak, against the checkpoint's bytes (bench_load.measure);
- speed at batch 1, greedy, each prompt run by transformers eager (an fp32 copy of the same dequantized weights)
  then v4engine MTP 0: decode tokens/s (after the first token), time to first token, and whether the tokens agree;
- what the graphs run: their node counts by op.

    .venv/bin/python -m benchmarks.bench_slice --checkpoint /work/scratch/slice --work /work/scratch/bench-slice
"""
from __future__ import annotations

import argparse
import collections
from pathlib import Path

import onnx
import torch

from benchmarks import built_engine
from benchmarks.bench_generate import Tally, run_transformers, run_v4engine
from benchmarks.bench_load import measure
from v4engine.builder.tiny import make_tiny
from v4engine.contract.engine import EngineManifest
from v4engine.runtime.generator import Generator
from v4engine.testkit import oracle


def decode_rate(tally: Tally) -> float:
    """Tokens per second after each prompt's first token."""
    return (tally.tokens - len(tally.ttft)) / (tally.seconds - sum(tally.ttft))


def node_counts(engine: Path) -> dict[str, collections.Counter]:
    manifest = EngineManifest.read(engine)
    return {graph: collections.Counter(n.op_type for n in onnx.load(engine / entry.file,
                                                                      load_external_data=False).graph.node)
            for graph, entry in manifest.graphs.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", type=Path, default=Path("/tmp/bench-slice/slice"),
                   help="the wide slice, made here by make-tiny --config slice if missing "
                        "(default /tmp/bench-slice/slice)")
    p.add_argument("--work", type=Path, default=Path("/tmp/bench-slice"),
                   help="the engine and transformers' copy go here (default /tmp/bench-slice)")
    p.add_argument("--prompts", type=int, default=3, help="random prompts (default 3)")
    p.add_argument("--prompt-tokens", type=int, default=200, help="tokens of each prompt (default 200)")
    p.add_argument("--new-tokens", type=int, default=33, help="tokens decoded per prompt (default 33)")
    p.add_argument("--threads", type=int, default=2, help="intra-op threads for both ONNX Runtime and torch")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default 0)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if not (args.checkpoint / "config.json").is_file():
        make_tiny(args.checkpoint, config="slice", quantize="mxfp4", dtype="bfloat16")
    engine, hf = built_engine(args.checkpoint, args.work, mtp=1), args.work / "hf"
    if not (hf / "config.json").is_file():
        oracle.transformers_copy(args.checkpoint, hf)
    checkpoint_mib = sum(f.stat().st_size for f in args.checkpoint.glob("*.safetensors")) / 2**20

    memory = measure(engine, None)
    resident = memory["anon_mib"] + memory["file_mib"]
    groups = EngineManifest.read(engine).build["weight_groups"]["target"]
    predicted = sum(n for group in groups.values() for n in group["resident"].values()) / 2**20
    print(f"checkpoint {checkpoint_mib:.0f} MiB; after load: {memory['anon_mib']:.0f} MiB anonymous + "
          f"{memory['file_mib']:.0f} MiB file-backed = {resident / checkpoint_mib:.2f}x the checkpoint (engine.json "
          f"predicts {predicted:.0f} MiB for the target graph's weights); peak {memory['peak_mib']:.0f} MiB; "
          f"load {memory['load_s']:.1f} s")
    for name, group in groups.items():
        print(f"  {name}: stored " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in group["stored"].items())
              + "; loaded " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in group["resident"].items()))

    model = oracle.load_transformers(hf)
    model.generation_config.eos_token_id = None
    generator = Generator.from_engine_dir(engine, mtp=0, prefix_cache=False,          # as transformers
                                          backend_options={"threads": args.threads})
    gen = torch.Generator().manual_seed(args.seed)
    vocab = generator.manifest.model.vocab_size
    prompts = [torch.randint(2, vocab, (args.prompt_tokens,), generator=gen).tolist() for _ in range(args.prompts)]
    run_transformers(model, prompts[0][:16], 4, Tally())                 # warm-ups, untimed
    run_v4engine(generator, [prompts[0][:16]], 4, Tally())
    theirs, ours = Tally(), Tally()
    for prompt in prompts:                                               # interleaved, prompt by prompt
        run_transformers(model, prompt, args.new_tokens, theirs)
        run_v4engine(generator, [prompt], args.new_tokens, ours)
    same = sum(a == b for a, b in zip(theirs.outputs, ours.outputs))
    print("\n| system | decode tokens/s | time to first token | same tokens |\n|---|---|---|---|")
    for name, tally in (("transformers eager", theirs), ("v4engine MTP 0", ours)):
        print(f"| {name} | {decode_rate(tally):.1f} | {1000 * sum(tally.ttft) / len(tally.ttft):.0f} ms | "
              f"{same}/{len(prompts)} |")
    print(f"\nv4engine / transformers: decode {decode_rate(ours) / decode_rate(theirs):.2f}x, time to first token "
          f"{sum(theirs.ttft) / sum(ours.ttft):.2f}x faster")
    for graph, counts in node_counts(engine).items():
        print(f"{graph}: {sum(counts.values())} nodes; " + ", ".join(f"{op} {n}" for op, n in counts.most_common(12)))


if __name__ == "__main__":
    main()
