"""The `v4build` command line.

    v4build --checkpoint DIR --output OUT [--mtp K] [--backend onnxruntime] [--device cpu|cuda] [--dtype D] ...
    v4build make-tiny OUT [--config NAME] [--quantize fp8|mxfp4] [--names official|hf] ...
    v4build make-release OUT [--release v4-flash|v4-pro] [--shards N]
    v4build check --checkpoint DIR [--mtp K]
    v4build memory ENGINE_DIR [--json]
    v4build triton-repo ENGINE_DIR OUT [--gpu | --gpus 0,1] [--max-batch N] [--max-queue-size N] [--instance-count N]
                        [--drafter NAME] [--mtp K] [--force]

Every failure prints one line naming the file, tensor or field at fault and exits non-zero.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from v4engine.contract.backend_options import ORT_DEVICES, TENSORRT_OPTIMIZATION_LEVEL
from v4engine.contract.backends import BACKENDS
from v4engine.contract.engine import BUILT_LIMIT_DEFAULTS
from v4engine.contract.errors import V4EngineError
from v4engine.contract.stages import gpu_list
from v4engine.contract.staging import Interrupted, signals_as_exceptions
from v4engine.runtime.drafters import DRAFTERS



def _make_tiny(args: argparse.Namespace) -> None:
    from .tiny import make_tiny

    out = make_tiny(args.out, config=args.config, seed=args.seed, quantize=args.quantize, names=args.names,
                    dtype=args.dtype, shards=args.shards, mtp=not args.no_mtp, agree=args.agree, force=args.force,
                    drafter=args.drafter)
    print(f"wrote tiny checkpoint '{args.config}' to {out}")


def _make_release(args: argparse.Namespace) -> None:
    from .release import RELEASES, write_release_checkpoint

    out = write_release_checkpoint(args.out, release=args.release, shards=args.shards, force=args.force)
    print(f"wrote {RELEASES[args.release][2]} to {out}: sparse files, no tensor data")


def _check(args: argparse.Namespace) -> None:
    from .load import open_checkpoint

    cfg, ckpt = open_checkpoint(args.checkpoint, mtp=args.mtp != 0)
    kinds = {kind: cfg.layer_types.count(kind) for kind in dict.fromkeys(cfg.layer_types)}
    formats: dict[str, int] = {}
    for name in ckpt.names():
        fmt = ckpt.info(name).format
        formats[fmt] = formats.get(fmt, 0) + 1
    print(f"{args.checkpoint}: {len(ckpt.names())} tensors in {len(ckpt.files())} file(s), formats {formats}")
    print(f"  {cfg.num_hidden_layers} layers {kinds}, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, "
          f"experts {cfg.n_routed_experts} (top {cfg.num_experts_per_tok}), draft module: "
          f"{ckpt.draft_module or 'none'}")
    if ckpt.draft_module == "dspark" and cfg.dspark is not None:
        d = cfg.dspark
        print(f"  drafter: DSpark, {d.stages} stages reading target layers {list(d.target_layer_ids)}, block size "
              f"{d.block_size} (v4build --mtp without a value drafts that many), Markov rank {d.markov_rank}, noise "
              f"token {d.noise_token_id}")
    print(f"  fingerprint {ckpt.fingerprint()[:16]}")


def _build(args: argparse.Namespace) -> None:
    from .build import BuildOptions, build

    given = {"device": args.device, "cuda_graphs": args.cuda_graphs or None, "onnx_only": args.onnx_only or None,
             "int8_moe_activations": args.int8_moe_activations or None,
             "builder_optimization_level": args.builder_optimization_level, "timing_cache": args.timing_cache}
    manifest = build(BuildOptions(checkpoint=args.checkpoint, output=args.output, mtp=args.mtp, backend=args.backend,
                                  dtype=args.dtype, max_batch=args.max_batch, max_seq_len=args.max_seq_len,
                                  max_prefill_chunk=args.max_prefill_chunk, force=args.force, progress=not args.quiet,
                                  pipeline_stages=args.pipeline_stages,   # the backend's own options: only those given
                                  backend_options={name: value for name, value in given.items() if value is not None}))
    print(summary(args.output, manifest))


def _memory(args: argparse.Namespace) -> None:
    from .memory import as_json, describe, memory_plan

    manifest, plan = memory_plan(args.engine_dir)
    print(as_json(plan) if args.json else describe(args.engine_dir, manifest, plan))


def _triton_repo(args: argparse.Namespace) -> None:
    from v4engine.triton_repo import render

    gpus = gpu_list(args.gpus, "--gpus") if args.gpus is not None else []
    out = render(args.engine_dir, args.out, gpu=args.gpu, max_batch=args.max_batch,
                 max_queue_size=args.max_queue_size, instance_count=args.instance_count, gpus=gpus,
                 drafter=args.drafter, mtp=args.mtp, force=args.force, report_prefix_hits=args.report_prefix_hits,
                 confidence_scheduling={"auto": None, "on": True, "off": False}[args.confidence_scheduling])
    where = f"GPUs {args.gpus}" if gpus else "GPU" if args.gpu else "CPU"
    print(f"wrote the Triton model repository for {args.engine_dir} to {out} "
          f"({where}): preprocessing, v4_generate, postprocessing, ensemble")


def summary(out: Path, manifest) -> str:
    """What was built: graphs and sizes, weights, cache bytes per token, time."""
    def mb(n: float) -> str:
        return f"{n / 2**20:.1f} MiB"

    lines = [f"engine {out} ({manifest.backend}, {manifest.dtype}, mtp {manifest.mtp}) "
             f"built in {manifest.build['seconds']:.1f} s"]
    for name, graph in manifest.graphs.items():
        lines.append(f"  {graph.file}: {mb((out / graph.file).stat().st_size)}, "
                     f"{len(graph.inputs)} inputs, {len(graph.outputs)} outputs")
    for w in manifest.weights:
        lines.append(f"  {w.file}: {mb(w.bytes)} ({w.link}{' to ' + w.source if w.source else ''})")
    lines.append(f"  weights: {manifest.build['weights']}")
    for graph, groups in manifest.build.get("weight_groups", {}).items():
        stored, resident = (sum(n for g in groups.values() for n in g[side].values()) for side in ("stored", "resident"))
        lines.append(f"  {graph} weights: {mb(stored)} stored, {mb(resident)} once loaded "
                     f"({resident / max(stored, 1):.2f}x; engine.json build.weight_groups has them by group)")
    if len(manifest.stages) > 1:
        for entry in manifest.stages:
            layers = entry.stage.layers
            lines.append(f"  pipeline stage {entry.stage.index} ({entry.stage.graph}"
                         f"{' + draft' if entry.stage.last and manifest.mtp else ''}): layers {layers.start}-"
                         f"{layers.stop - 1}, {mb(entry.bytes)} of weights once loaded")
    lines.append("  build steps: " + ", ".join(f"{k} {v:.1f} s" for k, v in manifest.build.get("stages", {}).items()))
    for part, layout in manifest.caches.items():
        per_token = sum(g.bytes_per_token for g in layout.groups)
        fixed = sum(g.fixed_bytes for g in layout.groups)
        lines.append(f"  {part} caches: {per_token:.0f} bytes per token + {fixed} bytes per sequence")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="v4build", description="Compile a DeepSeek-V4 checkpoint (with its mtp.0.* draft layer) into an engine "
        "directory: target and draft graphs, engine.json, tokenizer. Weights are referenced in place, never copied.",
        epilog="Other commands: 'v4build make-tiny --help' (a tiny random checkpoint), 'v4build make-release --help' "
        "(a full-size checkpoint without data), 'v4build memory --help' (an engine's bytes per device), "
        "'v4build check --help' (check a checkpoint against its config.json), "
        "'v4build triton-repo --help' (a Triton Inference Server model repository serving an engine).")
    p.add_argument("--checkpoint", type=Path, required=True,
                   help="checkpoint folder: config.json and safetensors (single file or sharded with an index); "
                   "official or transformers names; bf16/fp32, FP8 block-scaled, MXFP4 experts")
    p.add_argument("--output", type=Path, required=True, help="engine directory to create (built beside it in a "
                   "temporary folder and renamed at the end)")
    p.add_argument("--mtp", type=int, nargs="?", const=None, default=1, metavar="K",
                   help="draft tokens per step with the draft module the checkpoint ships (mtp.*: V4's MTP layer, or "
                   "the DSpark drafter of V4-Flash-0731, V4-Pro-0813 and the -DSpark repacks); 0: no draft graph; "
                   "without a value: the drafter's own default (DSpark: dspark_block_size; MTP: 1); sizes the caches "
                   "(default 1)")
    p.add_argument("--backend", choices=list(BACKENDS), default="onnxruntime",
                   help="engine backend: onnxruntime (default; runs on the CPU, or on CUDA with onnxruntime-gpu), "
                   "tensorrt (NVIDIA GPUs: TensorRT 10.15+/11.x engines with the v4 plugins; needs TensorRT unless "
                   "--onnx-only) or migraphx (AMD GPUs under ROCm: a variant MIGraphX's parser reads, compiled where "
                   "the migraphx module imports, else with the compile_migraphx.sh written beside it)")
    p.add_argument("--device", choices=list(ORT_DEVICES), default=None,
                   help="onnxruntime: what the engine runs on: cpu (default), or cuda, the CUDA variant (onnxruntime-"
                   "gpu): every node on ONNX Runtime's CUDA provider, FP8 and MXFP4 weights resident on the GPU as "
                   "stored and widened there, verify and draft calls recorded as CUDA graphs; engine.json records it "
                   "(build.compile.device). tensorrt engines run on NVIDIA GPUs, migraphx ones on AMD GPUs")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None,
                   help="activation dtype of the graphs (hc mixes, sinks and softmaxes stay fp32). Default: fp32 for "
                   "the CPU (exact; ONNX Runtime's CPU provider has no bf16 kernels), bf16 for NVIDIA GPUs "
                   "(tensorrt, onnxruntime --device cuda), fp16 for migraphx (its Python bindings take no bf16 "
                   "buffers)")
    limits = BUILT_LIMIT_DEFAULTS
    p.add_argument("--max-batch", type=int, default=limits["max_batch"],
                   help=f"largest batch the graphs accept (default {limits['max_batch']})")
    p.add_argument("--max-seq-len", type=int, default=limits["max_seq_len"],
                   help=f"longest sequence the engine serves (default {limits['max_seq_len']})")
    p.add_argument("--max-prefill-chunk", type=int, default=limits["max_prefill_chunk"],
                   help="most prompt tokens per engine call; the runtime prefills in chunks of this size, and "
                   f"TensorRT's prefill profile ends there (default {limits['max_prefill_chunk']})")
    p.add_argument("--pipeline-stages", type=int, default=1, metavar="N",
                   help="split the target's layers into N graphs of about equal resident weight bytes, one per device "
                   "(the embedding in the first, the head and the MTP draft graph with the last); engine.json lists "
                   "each stage's layers, bytes and cache groups; run with v4generate --devices (default 1)")
    p.add_argument("--cuda-graphs", action="store_true", help="onnxruntime, tensorrt: graphs a CUDA graph can hold "
                   "(no Loop or If: Sinkhorn's rounds unrolled, the draft's conditionals dropped, same results), and "
                   "engine.json naming the verify and draft-cycle profiles, so that on an NVIDIA GPU each of those "
                   "calls is recorded once per bucket of static shapes and replayed as one launch; costs a little "
                   "on the CPU (default: off)")
    p.add_argument("--int8-moe-activations", action="store_true", help="onnxruntime, lossy: the routed experts "
                   "quantize their inputs to int8 (ONNX Runtime QMoE's fast path; about 1e-2 off the exact fp32 "
                   "path, 1.5x the decode speed of the wide slice on a 2-core CPU); engine.json records it as "
                   "build.compile.moe_activations (default: off, exact)")
    p.add_argument("--onnx-only", action="store_true", help="tensorrt: prepare the graphs for TensorRT (plugin "
                   "nodes, profiles, engine.json) and stop before building engines; needs no TensorRT")
    p.add_argument("--builder-optimization-level", type=int, choices=range(6),
                   default=None, metavar="0-5",
                   help="tensorrt: TensorRT's builder optimization level (0 fastest build .. 5 most tactics; "
                   f"default {TENSORRT_OPTIMIZATION_LEVEL})")
    p.add_argument("--timing-cache", type=Path, default=None, help="tensorrt: timing cache file, read if it exists "
                   "and written after the build, so that rebuilds skip tactic timing (default: timing.cache in "
                   "the engine directory, seeded from the one a --force rebuild replaces)")
    p.add_argument("--force", action="store_true", help="replace OUTPUT if it exists and is an engine folder built "
                   "by v4build (any other folder is left alone)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(run=_build)
    return p


FORCE_CHECKPOINT = ("replace OUT if it exists and is a checkpoint folder v4build wrote (any other folder, a "
                    "downloaded checkpoint included, is left alone)")


def tools_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="v4build", description="Tools around DeepSeek-V4 checkpoints.")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("make-tiny", help="write a random, seeded tiny V4 checkpoint (for tests and examples)",
                       description="Write a random, seeded tiny DeepSeek-V4 checkpoint with its mtp.0.* layer.")
    t.add_argument("out", type=Path, help="output folder to create")
    t.add_argument("--config", default="mixed", help="config name: mixed, split_groups or flash_like (tiny, what "
                   "the tests run), or slice (hidden 1024, 64 experts top-6: 0.3 GB with --quantize mxfp4, for "
                   "benchmarks/bench_slice.py) (default: mixed)")
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
    t.add_argument("--no-mtp", action="store_true", help="leave out the draft module (mtp.*)")
    t.add_argument("--drafter", choices=["mtp", "dspark"], default="mtp",
                   help="the draft module under mtp.*: mtp, V4's one-layer MTP (the preview release's), or dspark, "
                   "the three-stage DSpark drafter laid out as V4-Flash-0731 ships it (dspark_* config keys, "
                   "main_proj, Markov and confidence heads) (default: mtp)")
    t.add_argument("--agree", type=float, default=None, metavar="ALPHA",
                   help="make the draft module mostly agree with the target by construction (block outputs scaled by "
                   "ALPHA, e.g. 0.1, so the target is close to a bigram model; the MTP layer reads only the next "
                   "token, DSpark's Markov head is that bigram), so that drafts are often accepted")
    t.add_argument("--force", action="store_true", help=FORCE_CHECKPOINT)
    t.set_defaults(run=_make_tiny)

    m = sub.add_parser("make-release", help="write a release-shaped checkpoint without data (sparse files)",
                       description="Write a checkpoint with a release's exact config, tensor names, dtypes and shapes "
                       "(FP8 block weights, MXFP4 experts, mtp.0.*), as sharded safetensors whose data are holes: "
                       "valid headers, no disk used, zeros when read. For building and measuring at full size.")
    m.add_argument("out", type=Path, help="output folder to create")
    m.add_argument("--release", choices=["v4-flash", "v4-pro", "v4-flash-0731", "v4-pro-0813"], default="v4-flash",
                   help="v4-flash (the preview, as released, with its MTP layer), v4-pro (sizes from a mirror of its "
                   "config, compress_ratios assumed), v4-flash-0731 or v4-pro-0813 (the current releases: the same "
                   "targets with the three-stage DSpark drafter under mtp.0..2) (default v4-flash)")
    m.add_argument("--shards", type=int, default=None, help="number of safetensors files (default: as released)")
    m.add_argument("--force", action="store_true", help=FORCE_CHECKPOINT)
    m.set_defaults(run=_make_release)

    c = sub.add_parser("check", help="read a checkpoint and check every tensor against config.json",
                       description="Read config.json and every safetensors header, and check each tensor's shape "
                       "and dtype against the config without loading the weights.")
    c.add_argument("--checkpoint", type=Path, required=True, help="checkpoint folder (config.json + safetensors)")
    c.add_argument("--mtp", type=int, nargs="?", const=None, default=1, metavar="K",
                   help="draft tokens planned (as v4build --mtp); other than 0, the draft module under mtp.* (MTP or "
                   "DSpark) is checked too (default 1)")
    c.set_defaults(run=_check)

    mem = sub.add_parser("memory", help="what an engine will hold on each device: weights, caches, workspace",
                         description="Read an engine folder (no GPU needed) and print, per device (pipeline stage, "
                         "the draft beside the last), the bytes of its weights as the backend holds them once loaded, "
                         "its caches at the engine's limits (max_batch sequences of max_seq_len tokens) and an "
                         "estimate of the workspace of its largest call (a floor: builder/memory.py), and the weights "
                         "against the checkpoint's bytes.")
    mem.add_argument("engine_dir", type=Path, help="engine directory built by v4build (--onnx-only engines too)")
    mem.add_argument("--json", action="store_true", help='print {"devices": [{"weights_bytes", "cache_bytes", '
                     '"workspace_bytes", ...}, ...]}, one entry per device in stage order')
    mem.set_defaults(run=_memory)

    r = sub.add_parser("triton-repo", help="render a Triton Inference Server model repository serving an engine",
                       description="Render a Triton model repository that serves ENGINE_DIR with streaming MTP "
                       "speculative decoding: preprocessing -> v4_generate -> postprocessing, wired by the model "
                       "'ensemble' (HTTP generate / generate_stream, gRPC streaming). The Python models run "
                       "v4engine from the server's Python environment; the engine is referenced by its path.")
    r.add_argument("engine_dir", type=Path, help="engine directory built by v4build (with its tokenizer.json)")
    r.add_argument("out", type=Path, help="repository folder to create (written beside it, renamed at the end)")
    placement = r.add_mutually_exclusive_group()
    placement.add_argument("--gpu", action="store_true", help="v4_generate on KIND_GPU instances, the engine opened "
                           "with ONNX Runtime's CUDA provider (default: KIND_CPU)")
    placement.add_argument("--gpus", default=None, metavar="0,1,...", help="each v4_generate instance spans these "
                           "GPUs, one per pipeline stage of the engine (v4build --pipeline-stages; KIND_MODEL "
                           "instances: stage i on the i-th GPU listed)")
    r.add_argument("--max-batch", type=int, default=None, help="requests generating together in one scheduler "
                   "(default: the largest batch the engine was built for)")
    r.add_argument("--max-queue-size", type=int, default=32, help="requests that may wait for a batch slot; "
                   "beyond that a request is refused at once (default 32)")
    r.add_argument("--instance-count", type=int, default=1, help="v4_generate instances, each with its own "
                   "scheduler and engine sessions (default 1)")
    r.add_argument("--drafter", choices=list(DRAFTERS), default=None, help="drafting method of v4_generate: the "
                   "engine's own draft graph's by default; prompt_lookup drafts from n-grams of each request's own "
                   "context, on any engine")
    r.add_argument("--mtp", type=int, default=None, help="draft tokens per step (default: the engine's k; "
                   "prompt_lookup on an engine built --mtp 0: 3)")
    r.add_argument("--confidence-scheduling", choices=["auto", "on", "off"], default="auto", help="v4_generate "
                   "verifies only the drafts that pay and skips draft cycles that do not (needs DSpark's confidence "
                   "head); auto (default): on for DSpark, off otherwise")
    r.add_argument("--report-prefix-hits", action="store_true", help="each response's metrics name the prompt "
                   "tokens its request took from the prefix cache (default: only the Prometheus total "
                   "v4_prefix_hit_tokens_total, so that one client cannot learn whether another sent a prompt)")
    r.add_argument("--force", action="store_true", help="replace OUT if it is a model repository")
    r.set_defaults(run=_triton_repo)
    return p


def main(argv: list[str] | None = None) -> int:
    """Every way a run can end is one line on stderr and an exit status: 0 done, 1 refused or failed (the line
    names the file, tensor or field), 130 Ctrl-C, 128+N for signal N (SIGTERM, SIGHUP). Nothing half-written is
    left behind in any case (contract/staging.py)."""
    argv = sys.argv[1:] if argv is None else argv
    tools = bool(argv) and argv[0] in ("make-tiny", "make-release", "check", "memory", "triton-repo")
    args = (tools_parser() if tools else build_parser()).parse_args(argv)
    try:
        with signals_as_exceptions():
            args.run(args)
    except V4EngineError as e:
        return _fail(f"error: {e}", 1)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)
    except Interrupted as e:
        return _fail(f"interrupted ({e})", 128 + e.signum)
    except BrokenPipeError:                    # stdout closed (`| head`): what is left to say goes nowhere
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return _fail("error: stdout was closed", 1)
    except OSError as e:                       # a full disk, a vanished folder: the file and the reason
        where = f"{e.filename}: " if e.filename else ""
        return _fail(f"error: {where}{e.strerror or e}", 1)
    except MemoryError:
        return _fail("error: out of memory", 1)
    return 0


def _fail(message: str, status: int) -> int:
    print(f"v4build: {message}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
