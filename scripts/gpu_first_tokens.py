#!/usr/bin/env python3
"""The first tokens on a GPU: tiny-v4 (MTP 3) and tiny-v4-dspark (DSpark 5) built bf16 for ONNX Runtime's CUDA
provider (`v4build --device cuda`) and generated there, against the CPU fp32 engines and torch eager.

On the lent GPU machine, after onnxruntime-gpu's parts traveled (scripts/ort_gpu_wheel.py: `split` here, one device
call per part running `keep N`), one call:

    python3 scripts/gpu_first_tokens.py --out $OUT            # installs the wheel and this checkout into /tmp/site

What it does and writes (first_tokens.json and first_tokens.md under --out, the table on stdout):
1. Install: the joined wheel (its SHA-256 checked) and this checkout (no dependencies: the machine's Python has
   torch, onnx, onnxscript, safetensors, tokenizers) into a throwaway folder; the CUDA libraries ONNX Runtime's CUDA
   provider needs are the machine's nvidia-* packages (onnxruntime.preload_dlls).
2. Build, four processes at once: each checkpoint's CPU engine (fp32, the reference) and CUDA engine (bf16).
3. Placement, ONNX Runtime's own report: each CUDA graph loaded with the provider recording CUDA graphs, its
   verbose log captured: the nodes it placed per provider, against the build's model of it (the host nodes must
   be the shape arithmetic the build predicted: builder/backends/onnxruntime_cuda.py `placement`).
4. Greedy tokens, 8 prompts x --new-tokens, at batch 8: MTP 0 (the MTP 3 engine drafting nothing), MTP 3 and
   DSpark 5 on the GPU against the CPU fp32 engine's. Expected from bf16: the same tokens until a near-tie of the fp32 logits, which bf16 rounding can flip
   (the CUDA variant's logits are within 0.6% of fp32's on tiny-v4 in the CPU check, tests/test_onnxruntime_cuda.py),
   after which a continuation diverges: most continuations equal, all sharing their first tokens. Reported: the
   continuations equal, and the mean length of the common prefix.
5. CUDA graph launches: torch's profiler over a few decode steps at batch 1 counts cudaGraphLaunch calls against the
   engine's verify and draft-cycle calls (one launch each), and the kernels launched outside graphs.
6. Tokens/s at batch 1 and 8 (the same prompts, --new-tokens each, greedy, after a warm-up): MTP 0, MTP 3 and DSpark
   5 on the GPU, and torch eager (builder/model/v4.py with the same weights, bf16, on the same GPU: a forward per
   token, no drafting).

--dry-run, on a machine without a GPU (tests/test_gpu_first_tokens.py): the same steps where a CPU can take them:
the builds (or --engines KEY=DIR), the placement model, greedy tokens of the CPU engines with tokens decided on the
host against decided by the device sampler on torch CPU tensors (device_pools: the path a GPU session takes;
DSpark's confidence scheduling off, whose cost profile would take most of the run), CPU timings at batch 1, torch
eager on the CPU, and the report.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
CHECKPOINTS = {"tiny-v4": (REPO / "examples" / "tiny-v4", 3),
               "tiny-v4-dspark": (REPO / "examples" / "tiny-v4-dspark", 5)}
PROMPTS = ["def fib(n):", "class Stack:", "import os\n", "for i in range(", "    return ", "with open(", "# a",
           "if __name__"]
ENGINES = [f"{name}-{device}" for name in CHECKPOINTS for device in ("cpu", "cuda")]


def install(site: Path) -> None:
    """onnxruntime-gpu (joined from its parts) and this checkout into `site`, first on the path."""
    sys.path.insert(0, str(REPO / "scripts"))
    import ort_gpu_wheel

    ort_gpu_wheel.join(site)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-build-isolation",
                    "--target", str(site), str(REPO)], check=True)
    sys.path.insert(0, str(site))
    os.environ["PYTHONPATH"] = f"{site}:{os.environ.get('PYTHONPATH', '')}"


def build(work: Path, given: dict[str, Path]) -> dict[str, Path]:
    """The four engines: those given, the others built now, at once (a process each)."""
    engines = dict(given)

    def one(key: str) -> None:
        name, device = key.rsplit("-", 1)
        checkpoint, mtp = CHECKPOINTS[name]
        command = [sys.executable, "-m", "v4engine.builder.cli", "--checkpoint", str(checkpoint), "--mtp", str(mtp),
                   "--device", device, "--output", str(work / key), "--force", "--quiet"]
        subprocess.run(command, check=True, capture_output=True, text=True)
        engines[key] = work / key

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(one, [key for key in ENGINES if key not in engines]))
    return engines


# ---------------------------------------------------------------------- placement
def placement(engine: Path, on_gpu: bool) -> dict[str, Any]:
    """Per graph: the build's model of ONNX Runtime's placement (host shape nodes, offenders) and, on a GPU,
    ONNX Runtime's own (a session recording CUDA graphs, its verbose log: nodes per provider)."""
    import onnx

    from v4engine.builder.backends.onnxruntime_cuda import placement as modelled
    from v4engine.contract.engine import EngineManifest

    manifest, out = EngineManifest.read(engine), {}
    for graph, entry in manifest.graphs.items():
        predicted = modelled(onnx.load(engine / entry.file, load_external_data=False))
        row: dict[str, Any] = {"offenders": predicted.offenders, "host_shape_nodes": len(predicted.host_shape_nodes)}
        if on_gpu:
            row |= _ort_placement(engine, manifest, graph, set(predicted.host_shape_nodes))
        out[graph] = row
    return out


def _ort_placement(engine: Path, manifest: Any, graph: str, predicted: set[str]) -> dict[str, Any]:
    """ONNX Runtime's verbose log of one session of the graph, made as the runtime makes it (the engine folder's
    checked bytes and maps) on the CUDA provider recording CUDA graphs."""
    import onnxruntime as ort

    from v4engine.contract.engine_folder import EngineFolder, read_graph
    from v4engine.runtime.sessions.onnxruntime import session_options

    folder = EngineFolder(engine)
    weights = folder.map_weights(manifest.weights)
    options = session_options(weights.maps, None, False, False, fold_quantized=False)
    options.log_severity_level = 0                       # verbose: the partitioner lists every node's provider
    error = None
    with tempfile.TemporaryFile(mode="w+") as log, _stderr_to(log):
        try:
            ort.InferenceSession(read_graph(folder, manifest.graphs[graph], weights), options,
                                 providers=[("CUDAExecutionProvider", {"enable_cuda_graph": "1"})])
        except Exception as e:                           # noqa: BLE001 - reported, not raised
            error = str(e).splitlines()[0]
        log.seek(0)
        lines = [line.strip() for line in log if "placed on" in line or "graph capture" in line]
    on_cpu = [line.rsplit(" ", 1)[-1] for line in lines if "CPUExecutionProvider" in line and "Node" in line]
    return {"ort_error": error, "ort_log": lines[:40], "ort_cpu_nodes": len(on_cpu),
            "ort_cpu_nodes_outside_prediction": [n for n in on_cpu if n not in predicted][:20]}


@contextlib.contextmanager
def _stderr_to(file: Any):
    """The process's stderr (where ONNX Runtime logs) into `file` while the block runs."""
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(file.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


# ---------------------------------------------------------------------- generation
def generator(engine: Path, mtp: int, options: dict | None = None, scheduling: bool = True) -> Any:
    """A generator of the engine as a user opens one (`scheduling` False: DSpark's confidence scheduling off, which
    the dry run skips: its cost profile takes seconds a generator on a CPU)."""
    from v4engine.runtime.budget import Limits
    from v4engine.runtime.generator import Generator

    return Generator.from_engine_dir(engine, mtp=mtp, backend_options=options, limits=Limits(max_batch=8),
                                     own_process=True, confidence_scheduling=None if scheduling else False)


def greedy(gen: Any, new_tokens: int, drafts: int | None) -> list[list[int]]:
    """Greedy continuations of PROMPTS at batch 8 (`drafts`: draft tokens per step; 0: MTP 0 on the same engine)."""
    from v4engine.runtime.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, num_draft_tokens=drafts)
    return [r.token_ids for r in gen.generate(PROMPTS, params)]


def agreement(got: list[list[int]], want: list[list[int]]) -> dict[str, Any]:
    """How far greedy continuations agree: those equal, and the mean common prefix."""
    common = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w))) for g, w in zip(got, want)]
    return {"equal": sum(g == w for g, w in zip(got, want)), "of": len(want),
            "mean_common_prefix": sum(common) / len(common), "length": len(want[0])}


def tokens_per_second(gen: Any, batch: int, new_tokens: int, drafts: int | None) -> float:
    from v4engine.runtime.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, num_draft_tokens=drafts)
    gen.generate(PROMPTS[:batch], params)                                  # warm-up: sessions, buckets, graphs
    started = time.perf_counter()
    results = gen.generate(PROMPTS[:batch], params)
    return sum(len(r.token_ids) for r in results) / (time.perf_counter() - started)


def eager_tokens_per_second(checkpoint: Path, batch: int, new_tokens: int, device: str) -> float:
    """Our PyTorch model with the checkpoint's weights in bf16 (fp32 on the CPU), greedy, a forward per token."""
    import torch

    from v4engine.builder.load import load_model
    from v4engine.builder.model import ModelState

    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    model = load_model(checkpoint, mtp=False, dtype=dtype).to(device)
    prompt = torch.tensor([[3 + i % 64 for i in range(8)]] * batch, device=device)

    def run() -> int:
        state = ModelState(model.cfg, batch, dtype=dtype, device=device)
        with torch.no_grad():
            out = model(prompt, state.positions(prompt.shape[1]), state.views())
            state.commit(out.deltas, [prompt.shape[1]] * batch)
            for _ in range(new_tokens):
                token = out.logits[:, -1].argmax(-1, keepdim=True)
                out = model(token, state.positions(1), state.views())
                state.commit(out.deltas, [1] * batch)
        if device != "cpu":
            torch.cuda.synchronize()
        return batch * new_tokens

    run()
    started = time.perf_counter()
    return run() / (time.perf_counter() - started)


def graph_launches(gen: Any, drafts: int | None) -> dict[str, int]:
    """cudaGraphLaunch calls against the engine calls recorded as CUDA graphs, over a few decode steps."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from v4engine.runtime.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=8, ignore_eos=True, num_draft_tokens=drafts)
    gen.generate(PROMPTS[:1], params)                                                   # buckets recorded
    calls: dict[str, int] = {}
    engine_calls = gen.scheduler.calls
    engine_calls.on_call, kept = (lambda kind, shape, seconds: calls.__setitem__(kind, calls.get(kind, 0) + 1)), \
        engine_calls.on_call
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            gen.generate(PROMPTS[:1], params)
            torch.cuda.synchronize()
    finally:
        engine_calls.on_call = kept
    names = [event.name for event in prof.events()]
    return {"graph_launches": sum("GraphLaunch" in name for name in names),
            "kernel_launches": sum("LaunchKernel" in name for name in names),
            "recorded_calls": sum(n for kind, n in calls.items() if kind in ("verify", "cycle")), "calls": calls}


# ---------------------------------------------------------------------- the run
def run(args: argparse.Namespace) -> dict[str, Any]:
    on_gpu = not args.dry_run
    if on_gpu:
        install(Path(tempfile.mkdtemp(prefix="first-tokens-site-")))
        import onnxruntime as ort

        ort.preload_dlls(cuda=True, cudnn=False)
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise SystemExit(f"onnxruntime {ort.__version__} has no CUDAExecutionProvider here")
    import onnxruntime as ort
    import torch

    report: dict[str, Any] = {"dry_run": args.dry_run, "onnxruntime": ort.__version__, "torch": torch.__version__,
                              "gpu": torch.cuda.get_device_name() if on_gpu else "none (dry run)",
                              "new_tokens": args.new_tokens, "prompts": len(PROMPTS)}
    started = time.perf_counter()
    engines = build(args.work, dict(args.engines))
    report["build_seconds"] = round(time.perf_counter() - started, 1)
    report["placement"] = {key: placement(engines[key], on_gpu) for key in ENGINES if key.endswith("cuda")}
    cases = {"MTP 0": ("tiny-v4", 0), "MTP 3": ("tiny-v4", None), "DSpark 5": ("tiny-v4-dspark", None)}
    report["greedy"], report["speed"], report["launches"] = {}, {}, {}
    opened: dict[str, tuple[Any, Any]] = {}          # an engine's generators, MTP 0 on the MTP 3 engine's
    for case, (name, drafts) in cases.items():
        if name not in opened:
            checkpoint_mtp = CHECKPOINTS[name][1]
            reference = generator(engines[f"{name}-cpu"], checkpoint_mtp, scheduling=on_gpu)
            # on the GPU its CUDA engine; dry, the CPU engine again with the device path's sampler and bindings
            device = generator(engines[f"{name}-cuda"], checkpoint_mtp) if on_gpu else \
                generator(engines[f"{name}-cpu"], checkpoint_mtp, {"device_pools": True}, scheduling=False)
            opened[name] = (reference, device)
        reference, gen = opened[name]
        report["greedy"][case] = agreement(greedy(gen, args.new_tokens, drafts),
                                           greedy(reference, args.new_tokens, drafts))
        report["speed"][case] = {f"batch {b}": round(tokens_per_second(gen, b, args.new_tokens, drafts), 1)
                                 for b in ((1, 8) if on_gpu else (1,))}
        if on_gpu:
            report["launches"][case] = graph_launches(gen, drafts)
    device = "cuda" if on_gpu else "cpu"
    report["speed"]["torch eager"] = {f"batch {b}": round(eager_tokens_per_second(
        CHECKPOINTS["tiny-v4"][0], b, args.new_tokens, device), 1) for b in ((1, 8) if on_gpu else (1,))}
    report["seconds"] = round(time.perf_counter() - started, 1)
    return report


def markdown(report: dict[str, Any]) -> str:
    lines = [f"GPU: {report['gpu']}; onnxruntime {report['onnxruntime']}, torch {report['torch']}; "
             f"{report['prompts']} prompts x {report['new_tokens']} tokens", "",
             "| case | greedy equal | mean common prefix | " + " | ".join(
                 next(iter(report["speed"].values()))) + " (tokens/s) |",
             "|---|---|---|" + "---|" * len(next(iter(report["speed"].values())))]
    for case, speed in report["speed"].items():
        same = report["greedy"].get(case)
        agreed = f"{same['equal']}/{same['of']}" if same else "-"
        prefix = f"{same['mean_common_prefix']:.1f}/{same['length']}" if same else "-"
        lines.append(f"| {case} | {agreed} | {prefix} | " + " | ".join(str(v) for v in speed.values()) + " |")
    lines.append("")
    for key, graphs in report["placement"].items():
        for graph, row in graphs.items():
            lines.append(f"- {key} {graph}: modelled offenders {len(row['offenders'])}, host shape nodes "
                         f"{row['host_shape_nodes']}" + (f"; ONNX Runtime: {row['ort_cpu_nodes']} on the CPU, "
                                                        f"{len(row['ort_cpu_nodes_outside_prediction'])} not "
                                                        f"predicted, error {row['ort_error']}"
                                                        if "ort_cpu_nodes" in row else ""))
    for case, launch in report.get("launches", {}).items():
        lines.append(f"- {case}: {launch['graph_launches']} CUDA graph launches for {launch['recorded_calls']} "
                     f"recorded calls; {launch['kernel_launches']} kernels launched outside graphs")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("first-tokens-out"), help="results folder (created)")
    parser.add_argument("--work", type=Path, default=None, help="where engines are built (default: a temporary "
                        "folder)")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens each prompt generates (default 32)")
    parser.add_argument("--engines", nargs="*", default=[], metavar="KEY=DIR", help=f"engines already built, by key "
                        f"({', '.join(ENGINES)}): not built again")
    parser.add_argument("--dry-run", action="store_true", help="no GPU: the steps a CPU can take (module doc)")
    args = parser.parse_args(argv)
    args.engines = [(k, Path(v)) for k, v in (item.split("=", 1) for item in args.engines)]
    unknown = [k for k, _ in args.engines if k not in ENGINES]
    if unknown:
        parser.error(f"--engines: {unknown[0]} is not one of {', '.join(ENGINES)}")
    args.work = args.work or Path(tempfile.mkdtemp(prefix="first-tokens-"))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "first_tokens.json").write_text(json.dumps(report, indent=2) + "\n")
    text = markdown(report)
    (args.out / "first_tokens.md").write_text(text)
    print(text)
    problems = [f"{key} {graph}" for key, graphs in report["placement"].items() for graph, row in graphs.items()
                if row["offenders"] or row.get("ort_error") or row.get("ort_cpu_nodes_outside_prediction")]
    if problems:
        print(f"placement problems: {', '.join(problems)}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
