"""Full size without the bytes: a release-shaped checkpoint through `v4build --backend tensorrt --onnx-only` (or
`--backend onnxruntime`, which also loads every graph in ONNX Runtime without optimizing it).

1. `v4build make-release` writes the release's checkpoint (V4-Flash: 43 layers, 256 experts, FP8 block weights,
   MXFP4 experts, its draft module: MTP, or DSpark for the 0731 / 0813 releases; about 160 GB) as sparse
   safetensors files: valid headers, data holes, no disk used.
2. The build runs in a child process, alone: everything up to TensorRT's own build (export of target and draft,
   weights attached in place, onnx.checker and strict shape inference, the TensorRT preparation and profiles).
3. Reported: wall time, the child's peak RSS, the build's stages, and where every weight's bytes come from:
   each initializer of both graphs is in place (a linked checkpoint file), converted (weights/converted.bin) or
   inline; FP8 and FP4 tensors must all be in place, and only FP8 scale rows may be converted; the graphs'
   node counts and their most frequent ops.
4. What the runtime's checks of an engine folder cost at this size (contract/engine_folder.py): engine.json read
   and checked, every weight file fingerprinted and mapped, each graph parsed and its external data checked.

5. With --pipeline-stages N: each stage's layers and resident weight bytes, and the room it leaves for caches on
   an H200 (139 GiB visible), in bytes and in tokens of cache at the stage's bytes per token.

    .venv/bin/python -m benchmarks.bench_fullsize --work /tmp/fullsize [--release v4-flash] [--mtp 3] \
        [--backend tensorrt|onnxruntime] [--pipeline-stages N]
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import onnx
from benchmarks.bench_build import timed_build

from v4engine.builder.release import RELEASES
from v4engine.contract.engine import VALUE_BYTES, EngineManifest
from v4engine.contract.engine_folder import EngineFolder, read_graph

QUANTIZED = {onnx.TensorProto.FLOAT8E4M3FN: "FP8", onnx.TensorProto.FLOAT4E2M1: "FP4"}


def disk_bytes(folder: Path) -> tuple[int, int]:
    """(apparent bytes, bytes on disk) of the regular files under folder (hard links counted once)."""
    seen, apparent, used = set(), 0, 0
    for f in folder.rglob("*"):
        st = f.lstat()
        if f.is_file() and not f.is_symlink() and st.st_ino not in seen:
            seen.add(st.st_ino)
            apparent, used = apparent + st.st_size, used + st.st_blocks * 512
    return apparent, used


def weight_sources(engine: Path, manifest: EngineManifest) -> dict[str, Counter]:
    """Per graph: initializer counts by (source, type), where source is in place / converted / inline."""
    linked = {w.file for w in manifest.weights if w.link != "converted"}
    out = {}
    for graph, entry in manifest.graphs.items():
        model = onnx.load(str(engine / entry.file), load_external_data=False)
        counts: Counter = Counter()
        for t in model.graph.initializer:
            kind = QUANTIZED.get(t.data_type, onnx.TensorProto.DataType.Name(t.data_type))
            if t.data_location != onnx.TensorProto.EXTERNAL:
                counts["inline", kind] += 1
                continue
            location = next(e.value for e in t.external_data if e.key == "location")
            source = "in place" if location in linked else "converted"
            if source == "converted" and not t.name.endswith(".scale"):
                raise SystemExit(f"{engine / entry.file}: {t.name} ({kind}) was converted, not referenced in place")
            if kind in QUANTIZED.values() and source != "in place":
                raise SystemExit(f"{engine / entry.file}: quantized {t.name} is not in place")
            counts[source, kind] += 1
        out[graph] = counts
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="folder for the checkpoint and the engine")
    parser.add_argument("--release", default="v4-flash", choices=sorted(RELEASES),
                        help="v4-flash, v4-pro (the previews, with MTP), v4-flash-0731, v4-pro-0813 (with DSpark) "
                        "(default v4-flash)")
    parser.add_argument("--mtp", type=int, default=3, help="draft tokens, whatever the drafter (default 3)")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="activations (default bf16)")
    parser.add_argument("--backend", default="tensorrt", choices=["tensorrt", "onnxruntime"],
                        help="tensorrt (--onnx-only) or onnxruntime (default tensorrt)")
    parser.add_argument("--pipeline-stages", type=int, default=1, help="target graphs, one per GPU (default 1)")
    args = parser.parse_args()
    bin_dir = Path(sys.executable).parent
    checkpoint = args.work / args.release
    engine = args.work / f"{args.release}-{args.backend}-{args.pipeline_stages}"
    args.work.mkdir(parents=True, exist_ok=True)
    if not (checkpoint / "config.json").is_file():
        subprocess.run([bin_dir / "v4build", "make-release", str(checkpoint), "--release", args.release], check=True)
    shutil.rmtree(engine, ignore_errors=True)
    only = ["--onnx-only"] if args.backend == "tensorrt" else []
    wall, peak_mib = timed_build(checkpoint, engine, "--backend", args.backend, *only, "--mtp", str(args.mtp),
                                 "--dtype", args.dtype, "--pipeline-stages", str(args.pipeline_stages))
    manifest = EngineManifest.read(engine)
    ckpt_apparent, ckpt_used = disk_bytes(checkpoint)
    graphs_apparent = sum((engine / g.file).stat().st_size for g in manifest.graphs.values())
    converted = next((w.bytes for w in manifest.weights if w.link == "converted"), 0)
    print(f"\n## {args.release}: v4build --backend {args.backend} {' '.join(only)} --mtp {args.mtp} "
          f"--dtype {args.dtype} --pipeline-stages {args.pipeline_stages}\n")
    print("| measure | value |\n|---|---|")
    print(f"| wall time | {wall:.0f} s |")
    print(f"| peak RSS | {peak_mib / 1024:.2f} GiB |")
    stages = ", ".join(f"{k} {v:.0f} s" for k, v in manifest.build["stages"].items())
    print(f"| build steps | {stages} |")
    print(f"| checkpoint | {manifest.checkpoint['tensors']} tensors, {ckpt_apparent / 1e9:.1f} GB apparent, "
          f"{ckpt_used / 2**20:.0f} MiB on disk |")
    sizes = ", ".join(f"{name}.onnx {(engine / g.file).stat().st_size / 2**20:.0f} MiB"
                      for name, g in manifest.graphs.items())
    print(f"| graphs | {sizes} ({graphs_apparent / 2**20:.0f} MiB) |")
    print(f"| converted.bin | {converted / 2**20:.0f} MiB (FP8 block scales as float rows) |")
    print(f"| weight treatments | {manifest.build['weights']} |")
    for graph, counts in weight_sources(engine, manifest).items():
        listed = ", ".join(f"{source} {kind}: {n}" for (source, kind), n in sorted(counts.items()))
        print(f"| {graph} initializers | {listed} |")
    for graph, entry in manifest.graphs.items():
        ops = Counter(n.op_type for n in onnx.load(str(engine / entry.file), load_external_data=False).graph.node)
        print(f"| {graph} nodes | {sum(ops.values())}: " + ", ".join(f"{op} {n}" for op, n in ops.most_common(8)) + " |")
    if args.backend == "tensorrt":
        print(f"| TensorRT | {manifest.compiled.tensorrt} |")
        listed = "; ".join(f"{graph}: " + ", ".join(p.name for p in ps)
                           for graph, ps in manifest.compiled.profiles.items())
        print(f"| profiles | {listed} |")
    else:
        print(f"| ONNX Runtime | {manifest.compiled.onnxruntime}, loaded on {manifest.compiled.providers_checked} "
              f"{manifest.compiled.not_loaded or ''} |")
    print(f"| runtime's checks of the folder | {runtime_checks(engine)} |")
    print(stage_table(manifest))
    return 0


H200_VISIBLE = 139 * 2**30           # what one H200 exposes (141 GB of HBM3e; the device reports about 139 GiB)


def stage_table(manifest: EngineManifest) -> str:
    """Each pipeline stage: its layers, its weights as the backend holds them, and the room left for its caches."""
    value_bytes = VALUE_BYTES[manifest.dtype]
    rows = ["", "| stage | graphs | layers | weights resident | cache bytes per token (+ per sequence) | room left "
            "on an H200 | tokens of cache that fit |", "|---|---|---|---|---|---|---|"]
    for entry in manifest.stages:
        groups = list(entry.layout(manifest.model, value_bytes).groups)
        if entry.stage.last and manifest.mtp:
            groups += manifest.caches["draft"].groups
        per_token = sum(g.bytes_per_token for g in groups)
        fixed = sum(g.fixed_bytes for g in groups)
        room = H200_VISIBLE - entry.bytes
        layers = entry.stage.layers
        graphs = entry.stage.graph + (" + draft" if entry.stage.last and manifest.mtp else "")
        rows.append(f"| {entry.stage.index} | {graphs} | {layers.start}-{layers.stop - 1} ({len(layers)}) | "
                    f"{entry.bytes / 2**30:.1f} GiB | {per_token:,.0f} (+ {fixed / 2**20:.1f} MiB) | "
                    f"{room / 2**30:.1f} GiB | {max(room, 0) / per_token / 1e6:.1f} M |")
    sizes = [e.bytes for e in manifest.stages]
    rows.append(f"\nlargest / smallest stage: {max(sizes) / min(sizes):.2f}")
    return "\n".join(rows)


def runtime_checks(engine: Path) -> str:
    """Seconds of what opening a session checks before a backend sees a byte (contract/engine_folder.py)."""
    started = time.perf_counter()
    manifest = EngineManifest.read(engine)
    folder = EngineFolder(engine)
    weights = folder.map_weights(manifest.weights)
    mapped = time.perf_counter()
    for entry in manifest.graphs.values():
        read_graph(folder, entry, weights)
    done = time.perf_counter()
    return (f"{done - started:.1f} s: engine.json and {len(manifest.weights)} weight files "
            f"{mapped - started:.1f} s, graphs parsed and their external data checked {done - mapped:.1f} s")


if __name__ == "__main__":
    sys.exit(main())
