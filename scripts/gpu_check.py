#!/usr/bin/env python3
"""GPU check of v4engine's Triton kernels (issue 7): numerics, the AOT PTX that TensorRT launches, speed.

Run through scripts/gpu_check.sh on a machine with an NVIDIA GPU (it makes `import v4engine` work from a plain
checkout); `--cpu-dry-run` runs part (a) at the tiny size in Triton's interpreter, which is what
tests/test_gpu_check.py does on the CPU.

(a) numerics. Every op of plugins/kernels (sliding, HCA and CSA attention with and without key splits,
    indexer top-k, HCA and CSA compress) runs through its torch launcher on random inputs shaped like the
    model's, at the catalog's sizes: "tiny" (fp32, odd dims) and "v4-flash" (bf16, 512-d heads, 64 query heads
    on one key head, top-k 512 of 16384 CSA rows), for decode (S = 1) and a prefill chunk. The inputs follow the
    model's caches: the window's W-1 cached positions then the S new ones (-1 for slots before position 0),
    compressed rows in window order with two empty (-1) slots, CSA picks among the rows already closed with
    some -1, indexer key ids shuffled with every 5th slot empty; one query early in the sequence (a half-empty
    window, no closed row) and one at the end of the context. The PyTorch reference (plugins/*.py, the oracle)
    runs in fp32 on the same values. Pass: max |kernel - reference| <= 1e-4 for fp32 kernels, and
    max |kernel - reference| / max |reference| <= 1e-2 for bf16 ones; row ids exactly. The indexer: fp32
    integer-valued inputs (exact sums) must give exactly the reference's indices; otherwise summation order
    may swap near-ties, so the check of tests/test_kernels_indexer_compressor.py applies: the same picks are
    -1, picks are distinct, and the reference score of the i-th pick equals the i-th best reference score.
(b) AOT PTX. Every catalog plan (plugins/kernels/catalog.py) is compiled with compile_plan for this GPU (sm90,
    or sm100 on a Blackwell), its PTX loaded with cupy (cuModuleLoadData: the driver compiles PTX, as for
    TensorRT) and launched with the plan's grid, num_warps*32 threads, the kernel's shared memory and exactly
    TensorRT's arguments: input pointers, int32 scalars, output pointers (their types checked against the
    `.entry`'s parameters). The `.entry` also declares Triton's two scratch pointers, which TensorRT does not
    pass: the driver copies those two slots from whatever follows TensorRT's argument array, so this launch
    fills them with an invalid address, and a kernel that used them would fault here instead of working by
    accident (compile_plan refuses kernels that need scratch memory). Split attention runs both plans with the
    fp32 partials buffer the torch launcher allocates. Outputs are compared with a JIT launch of the same plan
    (bitwise expected) and with the reference. The plans built from the inputs must equal the catalog's.
(c) timing, decode at 64K context (V4-Flash: HCA rows 65536/128 = 512, CSA rows 65536/4 = 16384 with top-k 512,
    window 128, bf16), B = 1, 8, 64, 128, every query at the last position, every slot filled. Each run is
    timed with CUDA events, median of N, after a warm-up; before each run a 256 MiB write evicts the L2 and a
    GPU sleep lets the CPU queue the whole run, so the time is GPU time of HBM traffic. Timed: the torch
    launcher (attention picks its own key splits), the AOT PTX launch of the plan TensorRT runs (attention
    without splits) and the PyTorch eager reference on the same bf16 inputs. Bandwidth floor: every input read
    once (q, the window keys and positions, all R rows for HCA, the indexer's R keys, the compressors' buffer)
    except CSA's rows, of which only the k picked rows per query count; every output written once. GB/s =
    those bytes / kernel time, as a share of the H200's 4.8 TB/s and of a measured 2 GiB device copy.
(d) TensorRT: when importable, `v4build --backend tensorrt` builds tiny FP8 and MXFP4 checkpoints' engines (our
    plugins, AOT kernels, FP8/FP4 weights in place) and polygraphy compares each graph with the ONNX Runtime
    engine on a first call (fp32, atol 1e-3); otherwise the check says it is skipped.

Output: a table on stdout; under --out, rows.jsonl (written as rows complete, so a timeout keeps them),
gpu_check.json (environment, rows, notes), gpu_check.md (the same table) and aot_compile.json (registers, spills
and shared memory of every catalog kernel, from `python -m v4engine.plugins.kernels.aot`). Exit status: 0 when
every check passed, 1 when one failed, 2 when none failed but some were not started before --time-limit.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterable

if "--cpu-dry-run" in sys.argv[1:]:
    os.environ["TRITON_INTERPRET"] = "1"     # read when Triton is first imported (by the kernel modules below)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402

from v4engine.plugins import attention as attention_ref  # noqa: E402
from v4engine.plugins import compressor as compressor_ref  # noqa: E402
from v4engine.plugins import indexer as indexer_ref  # noqa: E402
from v4engine.plugins.kernels import attention as attention_kernels  # noqa: E402
from v4engine.plugins.kernels import catalog  # noqa: E402
from v4engine.plugins.kernels import compressor as compressor_kernels  # noqa: E402
from v4engine.plugins.kernels import indexer as indexer_kernels  # noqa: E402
from v4engine.plugins.kernels.aot import HIDDEN_PARAMS  # noqa: E402
from v4engine.plugins.kernels.launch import LaunchPlan, compile_plan, interpreting, launch  # noqa: E402
from v4engine.plugins.tensorrt.plugins import device_target  # noqa: E402

ATTENTION = ("sliding_attention", "hca_attention", "csa_attention")
OPS = ATTENTION + ("indexer_topk", "hca_compress", "csa_compress")
MODULES = {op: (attention_kernels, attention_ref) for op in ATTENTION} | {
    "indexer_topk": (indexer_kernels, indexer_ref),
    "hca_compress": (compressor_kernels, compressor_ref), "csa_compress": (compressor_kernels, compressor_ref)}

# (kind, B, S) per size; --quick keeps the first of each
NUMERIC_CASES = {"tiny": [("decode", 3, 1), ("prefill", 2, 20)], "v4-flash": [("decode", 8, 1), ("prefill", 2, 64)]}
TIMING_BATCHES, QUICK_TIMING_BATCHES = (1, 8, 64, 128), (1, 64)
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2}       # fp32: absolute; bf16: relative to max |reference|
EXACT_INDEXER_SCALE = 0.5          # with integer-valued inputs every indexer score is then exact in fp32

HBM_PEAK_GBPS = 4800.0             # H200 SXM datasheet
COPY_BYTES = 2 << 30               # the device-to-device copy that measures achievable bandwidth
FLUSH_BYTES = 256 << 20            # written before each timed run: more than the L2 (50 MiB on an H200)
SLEEP_CYCLES = 2_000_000           # about 1 ms of GPU sleep, longer than any launch sequence takes to queue
TIMED_RUNS, QUICK_TIMED_RUNS = 20, 10
SCRATCH_POISON = 0xDEAD_0000_0000  # what the AOT launch puts in Triton's two scratch slots (see (b))
MAX_DYNAMIC_SHARED_ATTRIBUTE = 8   # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES (CUDA driver API)
STATIC_SHARED_LIMIT = 48 << 10     # more dynamic shared memory than this must be opted into per function


# --------------------------------------------------------------------------- rows and the report
@dataclass
class Row:
    """One line of the table. error: max |got - ref| (fp32) or that / max |ref| (bf16); ok None: not judged."""
    check: str
    op: str
    size: str
    case: str
    error: float | None = None
    limit: float | None = None
    ok: bool | None = None
    kernel_ms: float | None = None
    aot_ms: float | None = None
    eager_ms: float | None = None
    speedup: float | None = None
    gbps: float | None = None
    peak_pct: float | None = None
    copy_pct: float | None = None
    bytes: int | None = None
    note: str = ""


COLUMNS = {"check": "check", "op": "op", "size": "size", "case": "case", "error": "max err", "ok": "pass",
           "kernel_ms": "kernel ms", "aot_ms": "aot ms", "eager_ms": "eager ms", "speedup": "speedup",
           "gbps": "GB/s", "peak_pct": "% peak", "copy_pct": "% copy"}


def cell(name: str, value: Any) -> str:
    if value is None:
        return "-"
    if name == "ok":
        return "pass" if value else "FAIL"
    formats = {"error": "{:.1e}", "speedup": "{:.1f}x", "gbps": "{:.0f}", "peak_pct": "{:.0f}%",
               "copy_pct": "{:.0f}%"}
    if name.endswith("_ms"):
        return f"{value:.3f}"
    return formats[name].format(value) if name in formats else str(value)


def table(rows: list[Row], markdown: bool = False) -> str:
    """Aligned columns: plain for the terminal, or a Markdown table with the same cells."""
    lines = [list(COLUMNS.values())] + [[cell(name, getattr(row, name)) for name in COLUMNS] for row in rows]
    widths = [max(map(len, column)) for column in zip(*lines)]
    lines = [[text.ljust(width) for text, width in zip(line, widths)] for line in lines]
    if not markdown:
        return "\n".join("  ".join(line).rstrip() for line in lines)
    lines.insert(1, ["-" * width for width in widths])
    return "\n".join("| " + " | ".join(line) + " |" for line in lines)


class Report:
    """Collects rows; appends each to OUT/rows.jsonl at once, so that a run cut short keeps what it did."""

    def __init__(self, out: Path, deadline: float):
        self.out, self.deadline, self.rows, self.skipped = out, deadline, [], []
        out.mkdir(parents=True, exist_ok=True)
        self.jsonl = (out / "rows.jsonl").open("w")

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, row: Row, fill: Callable[[Row], None]) -> None:
        """fill(row) measures and judges; an exception fails the row with its message, and the run goes on."""
        if self.time_left() <= 0:
            self.skipped.append(f"{row.check} {row.op} {row.size} {row.case}")
            return
        try:
            fill(row)
        except Exception as exc:   # one broken kernel must not hide the others
            row.ok, row.note = False, f"{type(exc).__name__}: {exc}"[:800]
        self.rows.append(row)
        self.jsonl.write(json.dumps(asdict(row)) + "\n")
        self.jsonl.flush()
        if row.ok is False:
            print(f"FAIL {row.check} {row.op} {row.size} {row.case}: {row.note}", flush=True)

    def failed(self) -> list[Row]:
        return [row for row in self.rows if row.ok is False]

    def exit_status(self, interrupted: bool) -> int:
        """0: every judged check passed; 1: some failed; 2: none failed, but some did not run (time)."""
        return 1 if self.failed() else 2 if self.skipped or interrupted else 0

    def write(self, environment: dict[str, Any], extra: dict[str, Any]) -> None:
        details = dict(environment=environment, rows=[asdict(row) for row in self.rows], skipped=self.skipped,
                       **extra)
        self.jsonl.close()
        (self.out / "gpu_check.json").write_text(json.dumps(details, indent=1, default=str))
        env = "\n".join(f"- {key}: {value}" for key, value in environment.items())
        notes = "\n".join(f"- {row.check} {row.op} {row.size} {row.case}: {row.note}" for row in self.rows if row.note)
        (self.out / "gpu_check.md").write_text(f"# GPU check\n\n{env}\n\n{table(self.rows, markdown=True)}\n\n"
                                               f"## Notes\n\n{notes or 'none'}\n")


# --------------------------------------------------------------------------- inputs shaped like the model's
class Draw:
    """Random tensors on one device from one seeded generator (drawn on the device: V4-Flash sizes are GiBs)."""

    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.gen = torch.Generator(device=device).manual_seed(seed)

    def normal(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(shape, generator=self.gen, device=self.device, dtype=dtype)

    def uniform(self, *shape: int) -> torch.Tensor:
        return torch.rand(shape, generator=self.gen, device=self.device)

    def ints(self, low: int, high: int, *shape: int) -> torch.Tensor:
        return torch.randint(low, high, shape, generator=self.gen, device=self.device)


def context(z: SimpleNamespace) -> int:
    """Positions the size's caches cover: 64K at V4-Flash (512 HCA rows of 128, 16384 CSA rows of 4)."""
    return min(z.hca_rows * z.hca_ratio, z.csa_rows * z.csa_ratio)


def query_positions(z: SimpleNamespace, B: int, S: int, draw: Draw, *, at_end: bool = False) -> torch.Tensor:
    """[B,S] positions. Decode: random, the last query at the end of the context and (B >= 3) the first at 2,
    early enough to see a half-empty window and no closed row; at_end: all at the end. Prefill: chunks of S
    consecutive positions, the first from 0, the last ending at the end of the context."""
    end = context(z) - S
    if at_end:
        starts = torch.full((B,), end, device=draw.device)
    else:
        starts = draw.ints(0, end + 1, B)
        starts[-1] = end
        if S > 1:
            starts[0] = 0
        elif B >= 3:
            starts[0] = 2
    return starts.unsqueeze(1) + torch.arange(S, device=draw.device)


def csa_picks(q_pos: torch.Tensor, z: SimpleNamespace, draw: Draw, holes: bool) -> torch.Tensor:
    """[B,S,k] distinct CSA rows among those closed for each query, -1 past them (and for 1 in 8 with holes)."""
    closed = (q_pos + 1).div(z.csa_ratio, rounding_mode="floor").unsqueeze(-1)
    slots = torch.arange(z.csa_rows, device=draw.device)
    preference = draw.uniform(*q_pos.shape, z.csa_rows).masked_fill(slots >= closed, -1.0)
    picks = preference.topk(min(z.topk, z.csa_rows), dim=-1).indices
    empty = picks >= closed
    if holes:
        empty |= draw.uniform(*picks.shape) < 1 / 8
    return picks.masked_fill(empty, -1)


def make_inputs(op: str, z: SimpleNamespace, q_pos: torch.Tensor, draw: Draw, *, holes: bool = True,
                integers: bool = False) -> dict[str, torch.Tensor]:
    """The op's inputs, named and ordered as its reference's parameters. holes: empty (-1) slots as in a cache
    being filled; integers: the indexer's exact-sum inputs (small integers, weights multiples of 1/2)."""
    B, S = q_pos.shape
    if op == "indexer_topk":
        key_ids = draw.uniform(B, z.csa_rows).argsort(dim=1)        # slot order is not window order
        if holes:
            key_ids[:, ::5] = -1
        if integers:
            q, keys = draw.ints(-2, 3, B, S, z.h, z.dI).to(z.dtype), draw.ints(-2, 3, B, z.csa_rows, z.dI).to(z.dtype)
            weights = draw.ints(-2, 3, B, S, z.h) / 2
        else:
            q, keys = draw.normal(B, S, z.h, z.dI, dtype=z.dtype), draw.normal(B, z.csa_rows, z.dI, dtype=z.dtype)
            weights = draw.normal(B, S, z.h)
        return dict(q=q, weights=weights, keys=keys, key_ids=key_ids, q_pos=q_pos)
    if op in ("hca_compress", "csa_compress"):
        state = compress_attrs(op, z)["state_tokens"]
        channels = z.hca_C if op == "hca_compress" else z.csa_C
        return dict(kv=draw.normal(B, state + S, channels, dtype=z.dtype),
                    gate=(3 * draw.normal(B, state + S, channels)).to(z.dtype), first_pos=q_pos[:, 0] - state)
    T = z.window - 1 + S
    kv_pos = (q_pos[:, :1] - (z.window - 1) + torch.arange(T, device=draw.device)).clamp(min=-1)
    inputs = dict(q=draw.normal(B, S, z.H, z.d, dtype=z.dtype), q_pos=q_pos, kv=draw.normal(B, T, z.d, dtype=z.dtype),
                  kv_pos=kv_pos)
    if op == "hca_attention":
        row_ids = torch.arange(z.hca_rows, device=draw.device).repeat(B, 1)
        if holes:
            row_ids[:, -2:] = -1
        inputs |= dict(rows=draw.normal(B, z.hca_rows, z.d, dtype=z.dtype), row_ids=row_ids)
    elif op == "csa_attention":
        inputs |= dict(rows=draw.normal(B, z.csa_rows, z.d, dtype=z.dtype), topk_idx=csa_picks(q_pos, z, draw, holes))
    return inputs | dict(sink=draw.normal(z.H))


def compress_attrs(op: str, z: SimpleNamespace) -> dict[str, int]:
    ratio = z.hca_ratio if op == "hca_compress" else z.csa_ratio
    return dict(ratio=ratio, state_tokens=ratio - 1 if op == "hca_compress" else 2 * ratio - 1)


def op_attrs(op: str, z: SimpleNamespace) -> dict[str, Any]:
    """The op's attributes at a catalog size, as catalog.plans gives them to the plan functions."""
    if op in ATTENTION:
        return dict(window=z.window, scale=z.d ** -0.5) | (dict(ratio=z.hca_ratio) if op == "hca_attention" else {})
    if op == "indexer_topk":
        return dict(topk=z.topk, ratio=z.csa_ratio, scale=z.dI ** -0.5)
    return compress_attrs(op, z)


def as_fp32(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same values upcast: the reference then computes in fp32 what the kernel saw."""
    return {name: t.float() if t.is_floating_point() else t for name, t in inputs.items()}


# --------------------------------------------------------------------------- comparisons
def tensors(result: Any) -> tuple[torch.Tensor, ...]:
    """An op's result as a tuple (the compressors return two tensors, the other ops one)."""
    return result if isinstance(result, tuple) else (result,)


def max_error(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(error, limit): absolute for fp32 results, relative to the largest reference value for 16-bit ones."""
    diff = (got.float() - want.float()).abs().max().item() if want.numel() else 0.0
    if got.dtype == torch.float32:
        return diff, TOLERANCE[torch.float32]
    return diff / max(want.abs().max().item(), 1e-30), TOLERANCE[torch.bfloat16]


def judge(op: str, row: Row, got: Any, want: Any, inputs: dict[str, torch.Tensor], attrs: dict[str, Any],
          exact: bool = False) -> None:
    """Fill row.error, row.limit and row.ok: got is the kernel's result, want the fp32 reference's."""
    if op == "indexer_topk":
        judge_indexer(row, got, want, inputs, attrs, exact)
        return
    same_ids = True
    if op in ("hca_compress", "csa_compress"):
        (got, got_ids), (want, want_ids) = got, want
        same_ids = torch.equal(got_ids, want_ids)
        row.note = "" if same_ids else "row_ids differ from the reference"
    row.error, row.limit = max_error(got, want)
    row.ok = row.error <= row.limit and same_ids


def judge_indexer(row: Row, got: torch.Tensor, want: torch.Tensor, inputs: dict[str, torch.Tensor],
                  attrs: dict[str, Any], exact: bool) -> None:
    """Exact: indices equal (error = count of differing picks). Otherwise the order-independent check of
    tests/test_kernels_indexer_compressor.py: error = max |score of i-th pick - i-th best score| / max |score|."""
    if exact:
        row.error, row.limit = float((got != want).sum().item()), 0.0
        row.ok = row.error == 0
        return
    scores = indexer_ref.visible_scores(*as_fp32(inputs).values(), attrs["ratio"], attrs["scale"])
    picked = got >= 0
    ordered = got.sort(dim=-1).values
    repeats = ((ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)).any().item()
    got_scores = torch.gather(scores, -1, got.clamp(min=0))[picked]
    best_scores = torch.gather(scores, -1, want.clamp(min=0))[picked]
    finite = scores[torch.isfinite(scores)]
    scale = finite.abs().max().item() if finite.numel() else 1.0
    row.error = (got_scores - best_scores).abs().max().item() / scale if got_scores.numel() else 0.0
    row.limit = TOLERANCE[inputs["q"].dtype]
    problems = [text for text, bad in (("-1 picks differ from the reference's", not torch.equal(~picked, want == -1)),
                                       ("a row picked twice", repeats),
                                       ("an invisible row picked", not torch.isfinite(got_scores).all().item()))
                if bad]
    row.note = "; ".join(problems)
    row.ok = not problems and row.error <= row.limit


# --------------------------------------------------------------------------- (a) numerics
def check_numerics(report: Report, sizes: Iterable[str], quick: bool, device: torch.device) -> None:
    """Each op through its torch launcher vs its fp32 reference, per size and case (attention: splits 1 and N)."""
    draw = Draw(device, seed=1)
    for size in sizes:
        z = catalog.SIZES[size]
        for kind, B, S in NUMERIC_CASES[size][:1] if quick else NUMERIC_CASES[size]:
            case = f"{kind} B={B} S={S}"
            q_pos = query_positions(z, B, S, draw)
            for op in OPS:
                inputs = make_inputs(op, z, q_pos, draw)
                for splits in (1, z.splits) if op in ATTENTION else (None,):
                    name = op if (splits or 1) == 1 else f"{op}_split{splits}"
                    report.run(Row("numerics", name, size, case),
                               lambda row: numerics_row(row, op, z, inputs, splits))
            if size == "tiny":      # exact indices need exact sums: integer inputs in fp32
                inputs = make_inputs("indexer_topk", z, q_pos, draw, integers=True)
                report.run(Row("numerics", "indexer_topk", size, f"{case} exact"),
                           lambda row: numerics_row(row, "indexer_topk", z, inputs, None, exact=True))


def numerics_row(row: Row, op: str, z: SimpleNamespace, inputs: dict[str, torch.Tensor], splits: int | None,
                 exact: bool = False) -> None:
    kernels, references = MODULES[op]
    attrs = op_attrs(op, z) | (dict(scale=EXACT_INDEXER_SCALE) if exact else {})
    got = getattr(kernels, op)(*inputs.values(), **attrs, **({} if splits is None else dict(splits=splits)))
    want = getattr(references, op)(*as_fp32(inputs).values(), **attrs)
    judge(op, row, got, want, inputs, attrs, exact)


# --------------------------------------------------------------------------- launch plans as TensorRT sees them
def plans_for(op: str, z: SimpleNamespace, inputs: dict[str, torch.Tensor], splits: int = 1) -> list[LaunchPlan]:
    """The op's launch plans for these inputs, with the size's attributes (what TensorRT builds per shape)."""
    kernels, _ = MODULES[op]
    plan_fn, attrs = getattr(kernels, f"plan_{op}"), op_attrs(op, z)
    if op in ATTENTION:
        q, kv = inputs["q"], inputs["kv"]
        dims = dict(zip("BSHd", q.shape), T=kv.shape[1])
        if "rows" in inputs:
            dims["R"] = inputs["rows"].shape[1]
        if "topk_idx" in inputs:
            dims["k"] = inputs["topk_idx"].shape[2]
        return plan_fn(dims, q.dtype, splits=splits, **attrs)
    if op == "indexer_topk":
        q, weights = inputs["q"], inputs["weights"]
        dims = dict(zip(("B", "S", "h", "dI"), q.shape), R=inputs["keys"].shape[1])
        return [plan_fn(dims, q.dtype, weights_dtype=weights.dtype, **attrs)]
    kv = inputs["kv"]
    return [plan_fn(dict(zip("BLC", kv.shape)), kv.dtype, **attrs)]


Call = tuple[LaunchPlan, list[torch.Tensor], list[torch.Tensor]]


def plan_calls(op: str, plans: list[LaunchPlan], inputs: dict[str, torch.Tensor]) -> tuple[list[Call], Any]:
    """Each plan with its argument tensors, outputs allocated as the torch launchers allocate them (split
    attention: the fp32 partials [B,S,H,splits,d+2] between its two plans); and the op's result."""
    first = plans[0]
    args = [inputs[name] for name in first.inputs]
    device = args[0].device
    if op in ATTENTION:
        q = inputs["q"]
        out = torch.empty_like(q)
        if len(plans) == 1:
            return [(first, args, [out])], out
        part = torch.empty(*q.shape[:3], first.constexprs["SPLITS"], q.shape[3] + 2, dtype=torch.float32,
                           device=device)
        return [(first, args, [part]), (plans[1], [part], [out])], out
    if op == "indexer_topk":
        B, S = inputs["q_pos"].shape
        idx = torch.empty(B, S, min(first.constexprs["TOPK"], inputs["keys"].shape[1]), dtype=torch.int64,
                          device=device)
        return [(first, args, [idx])], idx
    kv = inputs["kv"]
    width = kv.shape[2] // 2 if first.constexprs["OVERLAP"] else kv.shape[2]
    rows = torch.empty(kv.shape[0], first.grid[0], width, dtype=kv.dtype, device=device)
    row_ids = torch.empty(kv.shape[0], first.grid[0], dtype=torch.int64, device=device)
    return [(first, args, [rows, row_ids])], (rows, row_ids)


def kernel_arguments(plan: LaunchPlan, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> list[np.ndarray]:
    """The parameter values TensorRT passes, in its order: input pointers (u64), int32 scalars, output pointers
    (u64); then the two scratch slots of Triton's `.entry`, filled with an invalid address (see (b))."""
    pointers = [np.array([t.data_ptr()], dtype=np.uint64) for t in inputs]
    scalars = [np.array([int(v)], dtype=np.int32) for v in plan.scalars.values()]
    results = [np.array([t.data_ptr()], dtype=np.uint64) for t in outputs]
    scratch = [np.array([SCRATCH_POISON], dtype=np.uint64) for _ in range(HIDDEN_PARAMS)]
    return pointers + scalars + results + scratch


def entry_types(ptx: str) -> list[str]:
    """The PTX type of each `.entry` parameter, in order: 'u64' for pointers, 'u32' for int32 scalars."""
    params = re.search(r"\.entry\s+\w+\s*\((.*?)\)", ptx, re.S).group(1)
    return re.findall(r"\.param\s+\.(\w+)", params)


def argument_types(values: list[np.ndarray]) -> list[str]:
    """The PTX types kernel_arguments' values stand for."""
    return [{np.dtype(np.uint64): "u64", np.dtype(np.int32): "u32"}[v.dtype] for v in values]


class PtxLauncher:
    """Compiles plans for one target with compile_plan, loads their PTX through cupy and launches them with
    TensorRT's arguments. One loaded function per distinct compiled kernel (B, S and R only change the grid)."""

    def __init__(self, target: str):
        import cupy
        self.driver, self.target, self.functions = cupy.cuda.driver, target, {}
        self.notes: list[str] = []

    def function(self, plan: LaunchPlan) -> tuple[int, int, list[str]]:
        """(CUfunction, dynamic shared memory bytes, `.entry` parameter types) of the plan's compiled kernel."""
        key = (plan.kernel.__name__, repr(plan.signature()), repr(sorted(plan.constexprs.items())), plan.num_warps,
               plan.num_stages)
        if key not in self.functions:
            compiled = compile_plan(plan, self.target)
            ptx, md = compiled.asm["ptx"], compiled.metadata
            try:
                module = self.driver.moduleLoadData(ptx.encode())
            except self.driver.CUDADriverError as exc:   # then check the rest on the cubin, and say so
                self.notes.append(f"{md.name}: the driver refused Triton's PTX ({exc}); launched its cubin")
                module = self.driver.moduleLoadData(compiled.asm["cubin"])
            function = self.driver.moduleGetFunction(module, md.name)
            if md.shared > STATIC_SHARED_LIMIT:
                self.driver.funcSetAttribute(function, MAX_DYNAMIC_SHARED_ATTRIBUTE, md.shared)
            self.functions[key] = (function, md.shared, entry_types(ptx))
        return self.functions[key]

    def launch(self, plan: LaunchPlan, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> None:
        function, shared, types = self.function(plan)
        values = kernel_arguments(plan, inputs, outputs)
        if argument_types(values) != types:
            raise RuntimeError(f"{plan.kernel.__name__}: the PTX .entry takes {types}, TensorRT's arguments and "
                               f"the scratch slots are {argument_types(values)}")
        params = np.array([v.ctypes.data for v in values], dtype=np.uint64)     # void *kernelParams[]
        self.driver.launchKernel(function, *(int(g) for g in plan.grid), plan.num_warps * 32, 1, 1, shared,
                                 torch.cuda.current_stream().cuda_stream, params.ctypes.data, 0)


def run_calls(calls: list[Call], launcher: Callable[[LaunchPlan, list, list], None]) -> None:
    for plan, inputs, outputs in calls:
        launcher(plan, inputs, outputs)


# --------------------------------------------------------------------------- (b) AOT PTX
def start_catalog_compile(target: str, out: Path) -> subprocess.Popen:
    """Compile the whole catalog in a second process while (a) runs: Triton's on-disk cache then answers (b)'s
    compile_plan at once, and OUT/aot_compile.json gets each kernel's registers, spills and shared memory."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    with (out / "aot_compile.json").open("w") as stdout, (out / "aot_compile.err").open("w") as stderr:
        return subprocess.Popen([sys.executable, "-m", "v4engine.plugins.kernels.aot", "--targets", target, "--json"],
                                stdout=stdout, stderr=stderr, env=env)


def check_aot(report: Report, ptx: PtxLauncher, device: torch.device) -> None:
    """Every catalog plan, at the catalog's own B and S: AOT PTX vs a JIT launch of the same plan vs reference."""
    draw = Draw(device, seed=2)
    for size in catalog.SIZES:
        z = catalog.SIZES[size]
        q_pos = query_positions(z, z.B, z.S, draw)
        for name, plans in catalog.plans(size).items():
            op, _, splits = name.partition("_split")
            report.run(Row("aot", name, size, f"catalog B={z.B} S={z.S}"),
                       lambda row: aot_row(row, op, z, make_inputs(op, z, q_pos, draw), int(splits or 1), plans, ptx))


def aot_row(row: Row, op: str, z: SimpleNamespace, inputs: dict[str, torch.Tensor], splits: int,
            catalog_plans: list[LaunchPlan], ptx: PtxLauncher) -> None:
    plans = plans_for(op, z, inputs, splits)
    if plans != catalog_plans:
        raise AssertionError("the plans built from the inputs differ from catalog.plans (drift)")
    jit_calls, jit = plan_calls(op, plans, inputs)
    aot_calls, aot = plan_calls(op, plans, inputs)
    run_calls(jit_calls, launch)
    run_calls(aot_calls, ptx.launch)          # on the same stream: the comparisons below wait for both
    bitwise = all(torch.equal(a, b) for a, b in zip(tensors(jit), tensors(aot)))
    attrs = op_attrs(op, z)
    want = getattr(MODULES[op][1], op)(*as_fp32(inputs).values(), **attrs)
    judge(op, row, aot, want, inputs, attrs)
    row.note = "; ".join(filter(None, [row.note, "bitwise equal to the JIT launch" if bitwise
                                       else "differs from the JIT launch (within tolerance of the reference)"]))


# --------------------------------------------------------------------------- (c) timing
def gpu_ms(fn: Callable[[], Any], runs: int, flush: torch.Tensor) -> float:
    """Median GPU time of fn in ms: L2 evicted before each run, and the GPU held asleep while the CPU queues it."""
    fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(runs)]
    for start, end in events:
        flush.zero_()
        torch.cuda._sleep(SLEEP_CYCLES)
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def copy_bandwidth(report: Report, runs: int, flush: torch.Tensor) -> float | None:
    """GB/s of a 2 GiB device-to-device copy (bytes read + written): the bandwidth a kernel can hope for."""
    def fill(row: Row) -> None:
        src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=flush.device)
        dst = torch.empty_like(src)
        row.kernel_ms = gpu_ms(lambda: dst.copy_(src), runs, flush)
        row.bytes = 2 * COPY_BYTES
        row.gbps = row.bytes / row.kernel_ms / 1e6
        row.peak_pct, row.copy_pct = 100 * row.gbps / HBM_PEAK_GBPS, 100.0

    row = Row("bandwidth", "copy 2 GiB", "-", "device to device")
    report.run(row, fill)
    torch.cuda.empty_cache()
    return row.gbps


def floor_bytes(op: str, inputs: dict[str, torch.Tensor], result: Any) -> int:
    """Bytes an ideal kernel moves: every input read once, every output written once, but of CSA's rows only
    the k picked per query (at most all R rows of the batch)."""
    size = sum(t.numel() * t.element_size() for t in (*inputs.values(), *tensors(result)))
    if op == "csa_attention":
        rows, picks = inputs["rows"], inputs["topk_idx"]
        B, R, d = rows.shape
        picked = min(picks.shape[1] * picks.shape[2], R)             # rows a batch row's queries read
        size -= (R - picked) * B * d * rows.element_size()
    return size


def check_timing(report: Report, batches: Iterable[int], runs: int, ptx: PtxLauncher | None,
                 copy_gbps: float | None, flush: torch.Tensor) -> None:
    """Decode at 64K context, V4-Flash sizes: torch launcher, AOT PTX, eager reference; error vs fp32 reference."""
    z = catalog.SIZES["v4-flash"]
    draw = Draw(flush.device, seed=3)
    for op in OPS:
        for B in batches:
            row = Row("time", op, "v4-flash", f"decode@{context(z) // 1024}K B={B}")
            report.run(row, lambda row: timing_row(row, op, z, B, runs, ptx, copy_gbps, flush, draw))
            torch.cuda.empty_cache()


def timing_row(row: Row, op: str, z: SimpleNamespace, B: int, runs: int, ptx: PtxLauncher | None,
               copy_gbps: float | None, flush: torch.Tensor, draw: Draw) -> None:
    kernels, references = MODULES[op]
    inputs = make_inputs(op, z, query_positions(z, B, 1, draw, at_end=True), draw, holes=False)
    attrs = op_attrs(op, z)

    def kernel() -> Any:
        return getattr(kernels, op)(*inputs.values(), **attrs)

    result = kernel()
    judge(op, row, result, getattr(references, op)(*as_fp32(inputs).values(), **attrs), inputs, attrs)
    row.kernel_ms = gpu_ms(kernel, runs, flush)
    row.eager_ms = gpu_ms(lambda: getattr(references, op)(*inputs.values(), **attrs), runs, flush)
    if ptx is not None:
        calls, _ = plan_calls(op, plans_for(op, z, inputs), inputs)
        row.aot_ms = gpu_ms(lambda: run_calls(calls, ptx.launch), runs, flush)
    row.bytes = floor_bytes(op, inputs, result)
    row.speedup = row.eager_ms / row.kernel_ms
    row.gbps = row.bytes / row.kernel_ms / 1e6
    row.peak_pct = 100 * row.gbps / HBM_PEAK_GBPS
    row.copy_pct = 100 * row.gbps / copy_gbps if copy_gbps else None


# --------------------------------------------------------------------------- (d) TensorRT
TENSORRT_ATOL = 1e-3          # fp32 engines (built without TF32); TensorRT's GEMM tactics reorder sums


def first_call_feeds(manifest: Any, graph: str, batch: int, seq: int) -> dict[str, np.ndarray]:
    """The inputs of a first call of `graph` (a prefill on empty caches), random tokens and streams."""
    from v4engine.runtime.cache import SequenceCache, batch_views

    rng = np.random.default_rng(0)
    cfg = manifest.model
    groups = manifest.cache_groups(graph)
    caches = [SequenceCache(cfg, groups, 4 * seq, np.float32) for _ in range(batch)]
    feeds = {"input_ids": rng.integers(0, cfg.vocab_size, (batch, seq)),
             "positions": np.tile(np.arange(seq), (batch, 1)), **batch_views(caches, groups)}
    if graph == "draft":
        feeds["hidden"] = rng.standard_normal((batch, seq, cfg.hc_mult, cfg.hidden_size)).astype(np.float32)
    return feeds


def compare_with_onnxruntime(manifest: Any, reference: Path, runner: Callable[[str], Any], atol: float
                             ) -> tuple[bool, str]:
    """Every graph of `manifest`: runner(graph) (a polygraphy runner) against ONNX Runtime on the graph of the
    engine folder `reference`, on a first call, through polygraphy's comparator."""
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx
    from polygraphy.comparator import Comparator, SimpleCompareFunc

    verdicts, ok = [], True
    for graph in manifest.graphs:
        runners = [OnnxrtRunner(SessionFromOnnx(str(reference / f"{graph}.onnx"))), runner(graph)]
        results = Comparator.run(runners, data_loader=[first_call_feeds(manifest, graph, 2, 9)])
        same = bool(Comparator.compare_accuracy(results, compare_func=SimpleCompareFunc(atol=atol, rtol=0)))
        ok &= same
        verdicts.append(f"{graph} {'matches' if same else 'DIFFERS'}")
    return ok, ", ".join(verdicts) + f" ONNX Runtime within {atol} (polygraphy)"


def build_tiny_engines_and_compare_with_onnxruntime(work: Path) -> tuple[bool, str]:
    """Build a tiny FP8 and a tiny MXFP4 checkpoint's engines with TensorRT (our plugins, AOT kernels; FP8 and FP4
    weights in place) and with ONNX Runtime, and compare them (compare_with_onnxruntime, prefill profile)."""
    from polygraphy.backend.trt import EngineFromBytes, TrtRunner

    from v4engine.builder.build import BuildOptions, build
    from v4engine.builder.tiny import make_tiny

    verdicts, ok = [], True
    for quantize in ("fp8", "mxfp4"):
        checkpoint = make_tiny(work / quantize / "checkpoint", config="flash_like", quantize=quantize, force=True)
        common = dict(checkpoint=checkpoint, mtp=2, max_batch=4, max_seq_len=256, max_prefill_chunk=16,
                      force=True, progress=False)
        engine = work / quantize / "tensorrt"
        manifest = build(BuildOptions(output=engine, backend="tensorrt", **common))
        build(BuildOptions(output=work / quantize / "onnxruntime", **common))
        same, verdict = compare_with_onnxruntime(
            manifest, work / quantize / "onnxruntime", lambda graph: TrtRunner(
                EngineFromBytes((engine / f"{graph}.plan").read_bytes()), optimization_profile=0), TENSORRT_ATOL)
        ok &= same
        verdicts.append(f"{quantize}: {verdict}")
    return ok, "; ".join(verdicts)


def check_tensorrt(report: Report, work: Path) -> None:
    try:
        import tensorrt
    except ImportError:
        print("TensorRT not importable: engine build and polygraphy comparison skipped", flush=True)
        report.run(Row("tensorrt", "engines", "tiny", "-", note="TensorRT not importable: skipped"), lambda row: None)
        return

    def fill(row: Row) -> None:
        row.ok, verdict = build_tiny_engines_and_compare_with_onnxruntime(work)
        row.note = f"TensorRT {tensorrt.__version__}: {verdict}"
        print(row.note, flush=True)

    report.run(Row("tensorrt", "engines", "tiny", "-"), fill)


# --------------------------------------------------------------------------- driver
def environment(device: torch.device) -> dict[str, Any]:
    """Versions and the device, printed first and kept in gpu_check.json."""
    env = dict(python=platform.python_version(), torch=torch.__version__, torch_cuda=torch.version.cuda,
               triton=triton.__version__, v4engine_plugins=str(Path(attention_ref.__file__).parent),
               triton_interpret=interpreting(), device=str(device))
    try:
        import cupy
        env |= dict(cupy=cupy.__version__, cuda_driver_api=cupy.cuda.runtime.driverGetVersion())
    except Exception as exc:   # absent, or present without a usable CUDA
        env["cupy"] = f"unavailable ({type(exc).__name__}: {exc})"[:200]
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env |= dict(gpu=props.name, capability="%d.%d" % (props.major, props.minor), sms=props.multi_processor_count,
                    gpu_memory_gib=round(props.total_memory / 2 ** 30, 1))
    return env


def aot_target(device: torch.device) -> str | None:
    """compile_plan's target for this GPU, as the plugins pick it (sm90: H100/H200, sm100: B200); None for others."""
    try:
        return device_target(torch.cuda.get_device_capability(device))
    except ValueError:
        return None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("gpu-check-out"), help="folder for the details")
    parser.add_argument("--quick", action="store_true", help="fewer cases, batches and timed runs")
    parser.add_argument("--time-limit", type=float, default=200.0,
                        help="seconds; checks not started by then are skipped (and listed)")
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="only (a), tiny size, on the CPU in Triton's interpreter (no cupy, no timing)")
    args = parser.parse_args(argv)
    if args.cpu_dry_run and not interpreting():
        parser.error("--cpu-dry-run needs TRITON_INTERPRET=1 before Triton is imported (give the flag on the "
                     "command line of this script, or set the variable)")
    if not args.cpu_dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device: use --cpu-dry-run")
    return args


def stop_on_sigterm(signum: int, frame: Any) -> None:
    """gpu_check.sh's timeout sends SIGTERM: unwind like Ctrl-C, so that the report is still written."""
    raise KeyboardInterrupt


def check_gpu(report: Report, args: argparse.Namespace, env: dict[str, Any], extra: dict[str, Any],
              section: Callable[[str], None]) -> None:
    """(a) to (d) on the GPU, the catalog compiling in a second process meanwhile."""
    device = torch.device("cuda")
    target = aot_target(device)
    compile_job = start_catalog_compile(target, args.out) if target else None
    try:
        section("(a) numerics")
        check_numerics(report, catalog.SIZES, args.quick, device)
        ptx = None
        if target is None:
            extra["aot"] = f"no AOT target for capability {env['capability']}: (b) skipped"
        elif env["cupy"].startswith("unavailable"):
            extra["aot"] = "cupy unavailable: (b) and the aot ms column skipped"
        else:
            section(f"(b) AOT PTX ({target}) through cupy")
            try:
                compile_job.wait(timeout=max(1.0, report.time_left()))
            except subprocess.TimeoutExpired:   # then compile_plan compiles what it needs itself
                pass
            ptx = PtxLauncher(target)
            extra["ptx_notes"] = ptx.notes
            check_aot(report, ptx, device)
        if "aot" in extra:
            print(extra["aot"], flush=True)
        runs = QUICK_TIMED_RUNS if args.quick else TIMED_RUNS
        flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device)
        section("(c) timing: copy bandwidth, then decode at 64K context")
        copy_gbps = copy_bandwidth(report, runs, flush)
        check_timing(report, QUICK_TIMING_BATCHES if args.quick else TIMING_BATCHES, runs, ptx, copy_gbps, flush)
        section("(d) TensorRT")
        check_tensorrt(report, args.out / "tensorrt")
    finally:
        if compile_job is not None:
            if compile_job.poll() is None:
                compile_job.kill()
                compile_job.wait()
            extra["catalog_compile_exit_status"] = compile_job.returncode


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    device = torch.device("cpu" if args.cpu_dry_run else "cuda")
    torch.set_float32_matmul_precision("highest")        # an fp32 reference, not TF32
    env = environment(device)
    print("\n".join(f"{key}: {value}" for key, value in env.items()), flush=True)
    report = Report(args.out, started + args.time_limit)
    extra: dict[str, Any] = {}

    def section(title: str) -> None:
        print(f"[{time.monotonic() - started:6.1f} s] {title}", flush=True)

    try:
        if args.cpu_dry_run:
            section("(a) numerics, tiny size, Triton interpreter")
            check_numerics(report, ["tiny"], args.quick, device)
        else:
            check_gpu(report, args, env, extra, section)
    except KeyboardInterrupt:
        extra["interrupted"] = f"after {time.monotonic() - started:.0f} s"
    report.write(env, extra)
    print(table(report.rows))
    for note in extra.get("ptx_notes", []):
        print("note:", note)
    judged = [row for row in report.rows if row.ok is not None]
    print(f"{len(judged) - len(report.failed())}/{len(judged)} checks passed in {time.monotonic() - started:.0f} s; "
          f"details in {args.out}/gpu_check.json and gpu_check.md")
    if report.skipped or "interrupted" in extra:
        print(f"incomplete: {len(report.skipped)} checks skipped at the time limit"
              + (f", interrupted {extra['interrupted']}" if "interrupted" in extra else ""))
    return report.exit_status("interrupted" in extra)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, stop_on_sigterm)
    raise SystemExit(main())
