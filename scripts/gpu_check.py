#!/usr/bin/env python3
"""The GPU check's driver: (b) the AOT PTX launched as TensorRT launches it, (c) the bandwidth table, and one table
of everything, with the verdicts of (a) numerics and (d) TensorRT, the pytest tests (marked gpu) that
scripts/gpu_check.sh runs first and hands over as JUnit XML (--tests).

(b) AOT PTX. Every catalog plan (plugins/kernels/catalog.py) is compiled with compile_plan for this GPU (sm90, or
    sm100 on a Blackwell), its PTX loaded with cupy (cuModuleLoadData: the driver compiles PTX, as for TensorRT) and
    launched with the plan's grid, num_warps*32 threads, the kernel's shared memory and exactly TensorRT's arguments:
    input pointers, int32 scalars, output pointers (their types checked against the `.entry`'s parameters). The
    `.entry` also declares Triton's two scratch pointers, which TensorRT does not pass: the driver copies those two
    slots from whatever follows TensorRT's argument array, so this launch fills them with an invalid address, and a
    kernel that used them would fault here instead of working by accident (compile_plan refuses kernels that need
    scratch memory). Split attention runs both plans with the fp32 partials buffer the torch launcher allocates.
    The inputs are (a)'s (v4engine.testkit.numerics) at the catalog's own B and S; the plans built from them
    must equal the catalog's, and the outputs pass (a)'s verdict. Each row notes its kernels' registers, local
    memory (spills) and shared memory.
(c) Timing, decode at 64K context (V4-Flash: HCA rows 65536/128 = 512, CSA rows 65536/4 = 16384 with top-k 512,
    window 128, bf16), B = 1, 8, 64, 128, every query at the last position, every slot filled; the median of
    triton.testing.do_bench, which evicts the L2 before each run. Timed: the torch launcher (attention picks its own
    key splits), the AOT PTX launch of the plan TensorRT runs (attention without splits) and the PyTorch eager
    reference on the same bf16 inputs. Bandwidth floor: every input read once (q, the window keys and positions,
    all R rows for HCA, the indexer's R keys, the compressors' buffer) except CSA's rows, of which only the k picked
    rows per query count, and of the routed experts' weights only the chosen experts' (6 per token at V4-Flash, in
    their stored format); every output written once. GB/s = those bytes / kernel time, as a share of the H200's
    4.8 TB/s and of a measured 2 GiB device copy.

(e) Device pools (runtime/pool_arrays.py, cache.py): V4-Flash's target cache groups in bf16 pools on the GPU for 8
    sequences of 64K context. Numerics: two sequences prefilled to 64K in chunks of 4,096 (random rows, on the
    device) and then one verify step each, committed into device pools and into host pools alike: every pool bit-for-bit equal. Timing:
    one decode step's commit (k + 1 = 4 positions for each of B = 8 sequences, the rows already on the device),
    against what a step cost before the pools lived on the device, the whole pools of the B sequences crossing
    PCIe (their bytes at a measured pinned host-to-device copy).

(f) CUDA graphs (v4build --cuda-graphs, contract/calls.py): TensorRT's recorded enqueue holds what the
    plugins launch (the routed experts' plugin runs its torch launcher inside it), so those launches must be
    recordable. This checks the kernels, not the engines (neither TensorRT nor onnxruntime-gpu is on the lent
    machine): every op's torch launcher at V4-Flash's verify shape (B = 8 rows of k + 1 = 4 queries at the
    end of the context) is recorded once by torch.cuda.graph, fresh inputs are copied into the recorded buffers and
    it is replayed: the replay must equal the launcher run directly on those inputs bit for bit (same launches, same
    addresses, nothing the host decided at recording time), and pass (a)'s verdict against the reference. Timed:
    the launcher called directly (kernel ms) against the replay (aot ms column: one launch).

--dry-run, without a GPU (tests/test_gpu_check.py runs it): (b) and (c) at the tiny size up to the launch: the plans
built from the inputs, TensorRT's arguments against the PTX compiled for sm90, the bytes of the floor; (e) at the
tiny size on CPU tensors.

Output: the table on stdout; under --out, rows.jsonl (written as rows complete, so a run cut short keeps them),
gpu_check.json (environment, rows, checks not started) and gpu_check.md (the table). Exit status: 0 when every check
and test passed, 1 when one failed, 2 when none failed but some checks were not started before --time-limit.
"""
from __future__ import annotations

import argparse
import json
import platform
import re
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterable

import numpy as np
import torch
import triton
from triton.testing import do_bench

import v4engine.plugins
from v4engine.plugins.kernels import catalog
from v4engine.plugins.kernels.aot import HIDDEN_PARAMS, resource_usage
from v4engine.plugins.kernels.launch import LaunchPlan, compile_plan
from v4engine.plugins.kernels.moe import BLOCK_T as MOE_BLOCK_T
from v4engine.plugins.kernels.moe import max_blocks
from v4engine.plugins.tensorrt.plugins import device_target
from v4engine.testkit.numerics import (ATTENTION, INDEXER, MOE, OPS, Draw, as_fp32, context, judge, kernel,
                                               make_inputs, op_attrs, plan_function, query_positions, reference,
                                               tensors)

TIMING_BATCHES = (1, 8, 64, 128)
HBM_PEAK_GBPS = 4800.0             # H200 SXM datasheet
COPY_BYTES = 2 << 30               # the device-to-device copy that measures achievable bandwidth
SCRATCH_POISON = 0xDEAD_0000_0000  # what the AOT launch puts in Triton's two scratch slots (see (b))
MAX_DYNAMIC_SHARED_ATTRIBUTE = 8   # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES (CUDA driver API)
STATIC_SHARED_LIMIT = 48 << 10     # more dynamic shared memory than this must be opted into per function


# --------------------------------------------------------------------------- rows and the report
@dataclass
class Row:
    """One line of the table; ok None: not judged (a timing, a skipped test)."""
    check: str                     # a test file's name (kernels, tensorrt), aot, bandwidth or time
    case: str
    ok: bool | None = None
    error: float | None = None     # (a)'s verdict: see v4engine.testkit.numerics
    limit: float | None = None
    kernel_ms: float | None = None
    aot_ms: float | None = None
    eager_ms: float | None = None
    bytes: int | None = None
    gbps: float | None = None
    peak_pct: float | None = None
    copy_pct: float | None = None
    note: str = ""


COLUMNS = {"check": "check", "case": "case", "ok": "pass", "error": "max err", "limit": "limit",
           "kernel_ms": "kernel ms", "aot_ms": "aot ms", "eager_ms": "eager ms", "bytes": "MB", "gbps": "GB/s",
           "peak_pct": "% peak", "copy_pct": "% copy"}


def cell(name: str, value: Any) -> str:
    if value is None:
        return "-"
    if name == "ok":
        return "pass" if value else "FAIL"
    if name in ("error", "limit"):
        return f"{value:.1e}"
    if name == "bytes":
        return f"{value / 1e6:.1f}"
    if name.endswith("_ms"):
        return f"{value:.3f}"
    if name.endswith("_pct"):
        return f"{value:.0f}%"
    return f"{value:.0f}" if name == "gbps" else str(value)


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

    def add(self, row: Row) -> None:
        self.rows.append(row)
        self.jsonl.write(json.dumps(asdict(row)) + "\n")
        self.jsonl.flush()
        if row.ok is False:
            print(f"FAIL {row.check} {row.case}: {row.note}", flush=True)

    def run(self, row: Row, fill: Callable[[Row], None]) -> None:
        """fill(row) measures and judges; an exception fails the row with its message, and the run goes on."""
        if time.monotonic() > self.deadline:
            self.skipped.append(f"{row.check} {row.case}")
            return
        try:
            fill(row)
        except Exception as exc:   # one broken kernel must not hide the others
            row.ok, row.note = False, f"{type(exc).__name__}: {exc}"[:800]
        self.add(row)

    def failed(self) -> list[Row]:
        return [row for row in self.rows if row.ok is False]

    def write(self, environment: dict[str, Any], extra: dict[str, Any]) -> None:
        self.jsonl.close()
        details = dict(environment=environment, rows=[asdict(row) for row in self.rows], skipped=self.skipped,
                       **extra)
        (self.out / "gpu_check.json").write_text(json.dumps(details, indent=1, default=str))
        env = "\n".join(f"- {key}: {value}" for key, value in environment.items())
        notes = "\n".join(f"- {row.check} {row.case}: {row.note}" for row in self.rows if row.note)
        (self.out / "gpu_check.md").write_text(f"# GPU check\n\n{env}\n\n{table(self.rows, markdown=True)}\n\n"
                                               f"## Notes\n\n{notes or 'none'}\n")


def rows_of_tests(junit: Path) -> Iterable[Row]:
    """One row per test of pytest's JUnit XML (xunit1: the kernels' error and limit come as test properties)."""
    if not junit.exists():
        yield Row("tests", str(junit), ok=False, note="no test results (pytest did not finish)")
        return
    for case in ElementTree.parse(junit).iter("testcase"):
        name = case.get("name")
        outcome = next((child for child in case if child.tag in ("failure", "error", "skipped")), None)
        properties = {p.get("name"): p.get("value") for p in case.iter("property")}
        yield Row(case.get("classname").rpartition(".")[2].removeprefix("test_gpu_"),
                  name[name.find("[") + 1:-1] if name.endswith("]") else name,
                  ok=None if outcome is not None and outcome.tag == "skipped" else outcome is None,
                  error=float(properties["error"]) if "error" in properties else None,
                  limit=float(properties["limit"]) if "limit" in properties else None,
                  note=(outcome.get("message", "") if outcome is not None else properties.get("verdict", ""))[:300])


# --------------------------------------------------------------------------- launch plans as TensorRT sees them
def plans_for(op: str, z: SimpleNamespace, inputs: dict[str, torch.Tensor], splits: int = 1) -> list[LaunchPlan]:
    """The op's launch plans for these inputs, with the size's attributes (what TensorRT builds per shape)."""
    plan, attrs = plan_function(op), op_attrs(op, z)
    if "pool" in inputs:                # a paged op: the pool's rows per block, the table's width
        attrs["page_rows"] = inputs["pool"].shape[1]
    if op in ATTENTION:
        q, kv = inputs["q"], inputs["kv"]
        dims = dict(zip("BSHd", q.shape), T=kv.shape[1])
        for name, dim, axis in (("rows", "R", 1), ("row_ids", "R", 1), ("block_table", "W", 1), ("new_rows", "N", 1),
                                ("topk_idx", "k", 2)):
            if name in inputs:
                dims[dim] = inputs[name].shape[axis]
        return plan(dims, q.dtype, splits=splits, **attrs)
    if op in INDEXER:
        q, weights = inputs["q"], inputs["weights"]
        dims = dict(zip(("B", "S", "h", "dI"), q.shape), R=inputs["key_ids"].shape[1])
        if "block_table" in inputs:
            dims |= dict(W=inputs["block_table"].shape[1], N=inputs["new_keys"].shape[1])
        return [plan(dims, q.dtype, weights_dtype=weights.dtype, **attrs)]
    if op in MOE:
        x, w1 = inputs["x"], inputs["w1"]
        return plan({"T": x.shape[0]}, x.dtype, experts=w1.shape[0], dim=x.shape[1], inter=w1.shape[1],
                    k=inputs["indices"].shape[1], **attrs)
    kv = inputs["kv"]
    return [plan(dict(zip("BLC", kv.shape)), kv.dtype, **attrs)]


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
    if op in MOE:      # scratch as the torch launcher allocates it, passed from plan to plan by name
        x, (T, k) = inputs["x"], inputs["indices"].shape
        blocks, inter = max_blocks(T * k, inputs["w1"].shape[0]), inputs["w1"].shape[1]
        tensors = dict(inputs, block_expert=torch.empty(blocks, dtype=torch.int32, device=device),
                       order=torch.empty(blocks * MOE_BLOCK_T, dtype=torch.int32, device=device),
                       hidden=torch.empty(blocks * MOE_BLOCK_T, inter, dtype=x.dtype, device=device),
                       picked=torch.empty(T * k, x.shape[1], dtype=torch.float32, device=device),
                       out=torch.zeros(T, x.shape[1], dtype=torch.float32, device=device))
        calls = [(plan, [tensors[n] for n in plan.inputs], [tensors[n] for n in plan.outputs]) for plan in plans]
        return calls, tensors["out"]
    if op in INDEXER:
        B, S = inputs["q_pos"].shape
        idx = torch.empty(B, S, min(first.constexprs["TOPK"], inputs["key_ids"].shape[1]), dtype=torch.int64,
                          device=device)
        return [(first, args, [idx])], idx
    kv = inputs["kv"]
    width = kv.shape[2] // 2 if first.constexprs["OVERLAP"] else kv.shape[2]
    rows = torch.empty(kv.shape[0], first.grid[0], width, dtype=kv.dtype, device=device)
    row_ids = torch.empty(kv.shape[0], first.grid[0], dtype=torch.int64, device=device)
    return [(first, args, [rows, row_ids])], (rows, row_ids)


def kernel_arguments(plan: LaunchPlan, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> list[np.ndarray]:
    """The parameter values TensorRT passes, in its order: input pointers (u64), int32 scalars, output pointers
    (u64); then the two scratch slots of Triton's `.entry`, filled with an invalid address (see (b)). TensorRT's
    tensors are dense: a strided view here would be read as if it were, so it is refused."""
    for name, t in zip([*plan.inputs, *plan.outputs], [*inputs, *outputs]):
        if not t.is_contiguous():
            raise ValueError(f"{plan.name}: argument {name} is a strided view; TensorRT passes dense tensors")
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


def resources(compiled: Any) -> str:
    """Registers and local memory (spills) per thread, read from the cubin with cuobjdump, and shared memory: a note
    for the table, so a cuobjdump that fails is said there and judges nothing."""
    try:
        usage = resource_usage(compiled.asm["cubin"])
    except Exception as exc:
        return f"resources unknown ({type(exc).__name__}: {exc})"[:200]
    return f"{usage['regs']} regs, {usage['local']} B local, {compiled.metadata.shared} B shared"


class PtxLauncher:
    """Compiles plans for one target with compile_plan and launches their PTX through cupy's CUDA driver API with
    TensorRT's arguments, checked against the PTX `.entry` first. Without a driver (the dry run) it stops short of
    loading and launching. One kernel per distinct compiled plan (B, S and R only change the grid)."""

    def __init__(self, target: str, driver: Any = None):
        self.target, self.driver, self.kernels = target, driver, {}
        self.notes: list[str] = []

    def kernel(self, plan: LaunchPlan) -> SimpleNamespace:
        """The plan's compiled kernel: its `.entry` parameter types, shared memory, resources and CUfunction."""
        key = (plan.kernel.__name__, repr(plan.signature()), repr(sorted(plan.constexprs.items())), plan.num_warps,
               plan.num_stages)
        if key not in self.kernels:
            compiled = compile_plan(plan, self.target)
            md = compiled.metadata
            self.kernels[key] = SimpleNamespace(types=entry_types(compiled.asm["ptx"]), shared=md.shared,
                                                function=self.load(compiled) if self.driver else None,
                                                resources=f"{md.name} {resources(compiled)}")
        return self.kernels[key]

    def load(self, compiled: Any) -> int:
        """The CUfunction of the compiled kernel's PTX (or of its cubin, noted, if the driver refuses the PTX)."""
        md = compiled.metadata
        try:
            module = self.driver.moduleLoadData(compiled.asm["ptx"].encode())
        except self.driver.CUDADriverError as exc:   # then check the rest on the cubin, and say so
            self.notes.append(f"{md.name}: the driver refused Triton's PTX ({exc}); launched its cubin")
            module = self.driver.moduleLoadData(compiled.asm["cubin"])
        function = self.driver.moduleGetFunction(module, md.name)
        if md.shared > STATIC_SHARED_LIMIT:
            self.driver.funcSetAttribute(function, MAX_DYNAMIC_SHARED_ATTRIBUTE, md.shared)
        return function

    def launch(self, plan: LaunchPlan, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> None:
        compiled = self.kernel(plan)
        values = kernel_arguments(plan, inputs, outputs)
        if argument_types(values) != compiled.types:
            raise RuntimeError(f"{plan.kernel.__name__}: the PTX .entry takes {compiled.types}, TensorRT's arguments "
                               f"and the scratch slots are {argument_types(values)}")
        if self.driver is None:
            return
        params = np.array([v.ctypes.data for v in values], dtype=np.uint64)     # void *kernelParams[]
        self.driver.launchKernel(compiled.function, *(int(g) for g in plan.grid), plan.num_warps * 32, 1, 1,
                                 compiled.shared, torch.cuda.current_stream().cuda_stream, params.ctypes.data, 0)


def run_calls(calls: list[Call], launcher: Callable[[LaunchPlan, list, list], None]) -> None:
    for plan, inputs, outputs in calls:
        launcher(plan, inputs, outputs)


# --------------------------------------------------------------------------- (b) AOT PTX
def check_aot(report: Report, ptx: PtxLauncher, sizes: Iterable[str], device: torch.device) -> None:
    """Every catalog plan at the catalog's own B and S: the AOT PTX against the reference."""
    draw = Draw(device, seed=2)
    for size in sizes:
        z = catalog.SIZES[size]
        q_pos = query_positions(z, z.B, z.S, draw)
        for name, plans in catalog.plans(size).items():
            op, _, splits = name.partition("_split")
            report.run(Row("aot", f"{size} {name} B={z.B} S={z.S}"),
                       lambda row: aot_row(row, op, z, make_inputs(op, z, q_pos, draw), int(splits or 1), plans, ptx))


def aot_row(row: Row, op: str, z: SimpleNamespace, inputs: dict[str, torch.Tensor], splits: int,
            catalog_plans: list[LaunchPlan], ptx: PtxLauncher) -> None:
    plans = plans_for(op, z, inputs, splits)
    if plans != catalog_plans:
        raise AssertionError("the plans built from the inputs differ from catalog.plans (drift)")
    calls, result = plan_calls(op, plans, inputs)
    run_calls(calls, ptx.launch)
    row.note = "; ".join(ptx.kernel(plan).resources for plan in plans)
    if ptx.driver is None:
        row.ok, row.note = True, f"{row.note}; arguments checked, not launched (dry run)"
        return
    attrs = op_attrs(op, z)
    verdict = judge(op, result, reference(op)(*as_fp32(inputs).values(), **attrs), inputs, attrs)
    row.ok, row.error, row.limit = verdict.ok, verdict.error, verdict.limit
    row.note = "; ".join([row.note, *verdict.problems])


# --------------------------------------------------------------------------- (c) timing
def gpu_ms(fn: Callable[[], Any]) -> float:
    """Median GPU time of fn in ms, the L2 evicted before each run."""
    return do_bench(fn, return_mode="median")


def copy_bandwidth(report: Report, device: torch.device) -> float | None:
    """GB/s of a 2 GiB device-to-device copy (bytes read + written): the bandwidth a kernel can hope for."""
    def fill(row: Row) -> None:
        src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        row.kernel_ms = gpu_ms(lambda: dst.copy_(src))
        row.bytes = 2 * COPY_BYTES
        row.gbps = row.bytes / row.kernel_ms / 1e6
        row.peak_pct, row.copy_pct = 100 * row.gbps / HBM_PEAK_GBPS, 100.0

    row = Row("bandwidth", "copy 2 GiB device to device")
    report.run(row, fill)
    torch.cuda.empty_cache()
    return row.gbps


def floor_bytes(op: str, inputs: dict[str, torch.Tensor], result: Any) -> int:
    """Bytes an ideal kernel moves: every input read once, every output written once, but of CSA's rows only
    the k picked per query (at most all R rows of the batch)."""
    if op in MOE:      # of the experts' weights and scales, only the chosen experts' share
        indices, experts = inputs["indices"], inputs["w1"].shape[0]
        chosen = indices[(indices >= 0) & (indices < experts)].unique().numel()
        per_expert = {name for name, t in inputs.items() if t.dim() == 3 and t.shape[0] == experts}
        return int(sum(t.numel() * t.element_size() * (chosen / experts if name in per_expert else 1)
                       for name, t in (*inputs.items(), ("out", result))))
    size = sum(t.numel() * t.element_size() for t in (*inputs.values(), *tensors(result)))
    if op in ("csa_attention", "csa_attention_paged"):
        rows, picks = [inputs[n] for n in ("rows", "pool", "new_rows") if n in inputs], inputs["topk_idx"]
        B, d = picks.shape[0], rows[0].shape[-1]
        stored = sum(t.numel() for t in rows) // d                   # every row stored (a pool: all its blocks)
        picked = min(picks.shape[1] * picks.shape[2], stored // B)   # rows a batch row's queries read
        size -= (stored - B * picked) * d * rows[0].element_size()
    return size


def check_timing(report: Report, size: str, batches: Iterable[int], ptx: PtxLauncher | None, copy_gbps: float | None,
                 device: torch.device, timed: bool = True) -> None:
    """Decode with every query at the end of the context: torch launcher, AOT PTX and eager reference, against the
    bandwidth floor. Not timed: the floor only (the dry run)."""
    z = catalog.SIZES[size]
    draw = Draw(device, seed=3)
    for op in OPS:
        for B in batches:
            row = Row("time", f"{size} {op} decode@{context(z)} B={B}")
            report.run(row, lambda row: timing_row(row, op, z, B, ptx, copy_gbps, draw, timed))
            if device.type == "cuda":
                torch.cuda.empty_cache()


def timing_row(row: Row, op: str, z: SimpleNamespace, B: int, ptx: PtxLauncher | None, copy_gbps: float | None,
               draw: Draw, timed: bool) -> None:
    inputs = make_inputs(op, z, query_positions(z, B, 1, draw, at_end=True), draw, holes=False)
    calls, result = plan_calls(op, plans_for(op, z, inputs), inputs)
    row.bytes = floor_bytes(op, inputs, result)
    if not timed:
        return
    attrs = op_attrs(op, z)
    row.kernel_ms = gpu_ms(lambda: kernel(op)(*inputs.values(), **attrs))
    row.eager_ms = gpu_ms(lambda: reference(op)(*inputs.values(), **attrs))
    if ptx is not None:
        row.aot_ms = gpu_ms(lambda: run_calls(calls, ptx.launch))
    row.gbps = row.bytes / row.kernel_ms / 1e6
    row.peak_pct = 100 * row.gbps / HBM_PEAK_GBPS
    row.copy_pct = 100 * row.gbps / copy_gbps if copy_gbps else None


# --------------------------------------------------------------------------- (e) device pools
POOL_SEQUENCES, POOL_CONTEXT, VERIFY_POSITIONS, PREFILL_CHUNK = 8, 65536, 4, 4096


def pool_config(dry_run: bool) -> Any:
    """V4-Flash's config (builder/release.py), or the tiny one for the dry run."""
    from v4engine.builder.release import RELEASES
    from v4engine.builder.tiny import TINY_CONFIGS
    from v4engine.contract.config import V4Config

    return V4Config.from_dict(TINY_CONFIGS["flash_like"] if dry_run else RELEASES["v4-flash"][0])


def commit_step(pool: Any, caches: list, n: int, rows: Callable[[Any, int], Any]) -> None:
    """Every sequence commits n positions, each group's delta `rows(group, count)` (as a graph emits them)."""
    from v4engine.contract.layout import closed_windows

    for cache in caches:
        cache.reserve(cache.length + n)
        cache.commit({g.pool: rows(g, closed_windows(cache.length, n, g.ratio) if g.ratio else n)
                      for g in pool.groups}, n)
    pool.flush()


def check_pools(report: Report, device: torch.device, dry_run: bool) -> None:
    from v4engine.runtime.cache import CachePool, SequenceCache
    from v4engine.contract.layout import CacheLayout
    from v4engine.runtime.pool_arrays import DeviceArrays, HostArrays, to_numpy

    cfg = pool_config(dry_run)
    layout = CacheLayout.target(cfg, value_bytes=2)
    context = 8 * layout.block_tokens if dry_run else POOL_CONTEXT
    per_sequence = layout.table_blocks(context)

    def numerics(row: Row) -> None:
        pools = [CachePool(layout, 2, 2 * per_sequence, arrays)
                 for arrays in (DeviceArrays("bf16", str(device)), HostArrays("bf16"))]
        caches = [[SequenceCache(pool) for _ in range(2)] for pool in pools]
        g = torch.Generator(device).manual_seed(0)
        prefill = context - VERIFY_POSITIONS        # in chunks, as the runtime prefills (each chunk's delta rows
        chunks = [PREFILL_CHUNK] * (prefill // PREFILL_CHUNK) + [prefill % PREFILL_CHUNK]    # exist whole at once)
        for n in [c for c in chunks if c] + [VERIFY_POSITIONS]:
            made: list[torch.Tensor] = []

            def draw(group: Any, count: int) -> torch.Tensor:
                made.append(torch.randn((count, group.width), generator=g, device=device, dtype=torch.bfloat16))
                return made[-1]

            commit_step(pools[0], caches[0], n, draw)
            given = iter(made)
            commit_step(pools[1], caches[1], n, lambda group, count: to_numpy(next(given)))
        differ = [name for name, array in pools[1].arrays.items()
                  if not np.array_equal(to_numpy(pools[0].arrays[name]).view(np.int16), array.view(np.int16))]
        row.ok = not differ
        row.bytes = pools[0].bytes_written
        row.note = f"differ: {differ[:3]}" if differ else f"{len(pools[1].arrays)} pools bit-for-bit equal"

    def timing(row: Row) -> None:
        pool = CachePool(layout, POOL_SEQUENCES, POOL_SEQUENCES * per_sequence, DeviceArrays("bf16", str(device)))
        caches = [SequenceCache(pool, length=context - 64) for _ in range(POOL_SEQUENCES)]
        for cache in caches:            # the blocks a 64K context holds (their rows left as allocated)
            cache.reserve(cache.length)
        step = {g.pool: torch.randn((VERIFY_POSITIONS, g.width), device=device, dtype=torch.bfloat16)
                for g in pool.groups}
        written = pool.bytes_written

        def one_step() -> None:
            commit_step(pool, caches, VERIFY_POSITIONS, lambda group, count: step[group.pool][:count])
            torch.cuda.synchronize(device)
            for cache in caches:        # the next step writes the same positions again
                cache.length -= VERIFY_POSITIONS

        one_step()
        row.bytes = pool.bytes_written - written
        row.kernel_ms = float(np.median([_wall_ms(one_step) for _ in range(20)]))
        whole = POOL_SEQUENCES * layout.bytes_for(context)
        pinned = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
        on_device = torch.empty_like(pinned, device=device)
        h2d_gbps = (1 << 30) / gpu_ms(lambda: on_device.copy_(pinned, non_blocking=True)) / 1e6
        row.eager_ms = whole / h2d_gbps / 1e6
        row.note = (f"commit of {VERIFY_POSITIONS} positions x {POOL_SEQUENCES} sequences on the device; eager ms: "
                    f"their whole pools ({whole / 1e9:.2f} GB) over PCIe at {h2d_gbps:.1f} GB/s, as before")

    report.run(Row("pools", f"{'tiny' if dry_run else 'v4-flash'} commit = host commit, 2 x {context}"), numerics)
    if not dry_run:
        report.run(Row("pools", f"v4-flash decode commit @{context} B={POOL_SEQUENCES}"), timing)
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- (f) CUDA graphs
GRAPH_ROWS, GRAPH_QUERIES = 8, 4          # a verify of k = 3 drafts for 8 sequences


def check_cuda_graphs(report: Report, device: torch.device) -> None:
    z = catalog.SIZES["v4-flash"]
    draw = Draw(device, seed=11)
    for op in OPS:
        report.run(Row("graphs", f"v4-flash {op} verify@{context(z)} B={GRAPH_ROWS} S={GRAPH_QUERIES}"),
                   lambda row: graph_row(row, op, z, draw))
        torch.cuda.empty_cache()


def graph_row(row: Row, op: str, z: SimpleNamespace, draw: Draw) -> None:
    """One op's launcher recorded, replayed on fresh inputs copied into its buffers (see (f))."""
    def fresh() -> dict[str, torch.Tensor]:
        q_pos = query_positions(z, GRAPH_ROWS, GRAPH_QUERIES, draw, at_end=True)
        return make_inputs(op, z, q_pos, draw, holes=False)

    attrs, launch = op_attrs(op, z), kernel(op)
    static = fresh()
    launch(*static.values(), **attrs)                  # compiles and warms up outside the recording
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        recorded = tensors(launch(*static.values(), **attrs))
    inputs = fresh()
    for name, value in inputs.items():
        static[name].copy_(value)
    graph.replay()
    direct = tensors(launch(*inputs.values(), **attrs))
    torch.cuda.synchronize()
    same = all(torch.equal(a, b) for a, b in zip(recorded, direct))
    verdict = judge(op, launch(*inputs.values(), **attrs), reference(op)(*as_fp32(inputs).values(), **attrs),
                    inputs, attrs)
    row.ok, row.error, row.limit = same and verdict.ok, verdict.error, verdict.limit
    row.kernel_ms = gpu_ms(lambda: launch(*static.values(), **attrs))
    row.aot_ms = gpu_ms(graph.replay)
    row.note = ("replay = direct launch, bit for bit" if same else "replay differs from the direct launch") + \
        f"; {verdict}"


def _wall_ms(fn: Callable[[], None]) -> float:
    started = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - started)


# --------------------------------------------------------------------------- driver
def environment(device: torch.device) -> dict[str, Any]:
    """Versions and the device, printed first and kept in gpu_check.json."""
    env = dict(python=platform.python_version(), torch=torch.__version__, torch_cuda=torch.version.cuda,
               triton=triton.__version__, v4engine_plugins=str(Path(v4engine.plugins.__file__).parent),
               device=str(device))
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


def gpu_launcher(device: torch.device, env: dict[str, Any], extra: dict[str, Any]) -> PtxLauncher | None:
    """The AOT launcher for this GPU (sm90: H100/H200, sm100: B200); None, said in extra, for others or without
    cupy."""
    try:
        target = device_target(torch.cuda.get_device_capability(device))
    except ValueError:
        extra["aot"] = f"no AOT target for capability {env['capability']}: (b) and the aot ms column skipped"
        return None
    if env["cupy"].startswith("unavailable"):
        extra["aot"] = "cupy unavailable: (b) and the aot ms column skipped"
        return None
    import cupy

    return PtxLauncher(target, cupy.cuda.driver)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("gpu-check-out"), help="folder for the results")
    parser.add_argument("--tests", type=Path, help="pytest's JUnit XML (xunit1) of the gpu tests, for the table")
    parser.add_argument("--time-limit", type=float, default=170.0,
                        help="seconds; checks not started by then are skipped (and listed)")
    parser.add_argument("--dry-run", action="store_true",
                        help="no GPU: (b) and (c) at the tiny size up to the launch, for sm90")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device: use --dry-run")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    device = torch.device("cpu" if args.dry_run else "cuda")
    torch.set_float32_matmul_precision("highest")        # an fp32 reference, not TF32
    env = environment(device)
    print("\n".join(f"{key}: {value}" for key, value in env.items()), flush=True)
    report = Report(args.out, started + args.time_limit)
    for row in rows_of_tests(args.tests) if args.tests else ():
        report.add(row)
    extra: dict[str, Any] = {}
    try:
        if args.dry_run:
            ptx = PtxLauncher("sm90")
            check_aot(report, ptx, ["tiny"], device)
            check_timing(report, "tiny", [catalog.SIZES["tiny"].B], None, None, device, timed=False)
            check_pools(report, device, dry_run=True)
        else:
            ptx = gpu_launcher(device, env, extra)
            if ptx is not None:
                extra["ptx_notes"] = ptx.notes         # filled as kernels load
                check_aot(report, ptx, catalog.SIZES, device)
            copy_gbps = copy_bandwidth(report, device)
            check_pools(report, device, dry_run=False)
            check_cuda_graphs(report, device)
            check_timing(report, "v4-flash", TIMING_BATCHES, ptx, copy_gbps, device)
    except KeyboardInterrupt:          # gpu_check.sh's time limit: keep what was done
        extra["interrupted"] = f"after {time.monotonic() - started:.0f} s"
    report.write(env, extra)
    print(table(report.rows))
    for note in [extra.get("aot"), *extra.get("ptx_notes", [])]:
        if note:
            print("note:", note)
    judged = [row for row in report.rows if row.ok is not None]
    print(f"{len(judged) - len(report.failed())}/{len(judged)} checks passed in {time.monotonic() - started:.0f} s; "
          f"details in {args.out}/gpu_check.md and gpu_check.json")
    if report.skipped or "interrupted" in extra:
        print(f"incomplete: {len(report.skipped)} checks not started at the time limit"
              + (f", interrupted {extra['interrupted']}" if "interrupted" in extra else ""))
    return 1 if report.failed() else 2 if report.skipped or "interrupted" in extra else 0


if __name__ == "__main__":
    raise SystemExit(main())
