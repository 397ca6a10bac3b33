"""Compile every catalog plan ahead of time for GPUs this machine need not have, and check what launchers see:
`python -m v4engine.plugins.kernels.aot --targets sm90 sm100 gfx942 [--size tiny v4-flash] [--out DIR] [--json]`.

TensorRT launches AOT kernels with the plan's arguments only, so the PTX `.entry` must take exactly those plus
the two scratch pointers Triton appends (unused: compile_plan refuses kernels that need scratch); the exit
status is 1 when a kernel does not, or does not compile. Registers and local memory (spills) are read from the
cubin with Triton's cuobjdump, as Triton's n_regs / n_spills exist only on a GPU. --out writes the PTX that
TensorRT or scripts/gpu_check.py loads, as OUT/target/size/op/kernel.ptx (named after its `.entry`).
gfx942 (MI300) is a build check for the day MIGraphX custom ops launch these kernels: the row is ok when the
AMD code object (hsaco) is produced; --out writes it as OUT/gfx942/size/op/kernel.hsaco.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from triton import knobs

from .catalog import SIZES, plans
from .launch import TARGETS, LaunchPlan, compile_plan, interpreting

HIDDEN_PARAMS = 2                     # Triton's global and profile scratch pointers, after the plan's arguments
COLUMNS = ("size", "op", "kernel", "target", "arguments", "params", "regs", "local", "shared", "hsaco", "ok",
           "error")


def entry_params(ptx: str) -> int:
    """Parameters of the PTX kernel's `.entry`: what every launcher must pass, in order."""
    return re.search(r"\.entry\s+\w+\s*\((.*?)\)", ptx, re.S).group(1).count(".param")


def resource_usage(cubin: bytes) -> dict[str, int]:
    """Registers and local memory bytes (register spills: our kernels keep no local arrays) per thread."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        usage = subprocess.run([knobs.nvidia.cuobjdump.path, "--dump-resource-usage", file.name],
                               capture_output=True, text=True, check=True).stdout
    regs, local = (int(re.search(rf"\b{key}:(\d+)", usage).group(1)) for key in ("REG", "LOCAL"))
    return dict(regs=regs, local=local)


def compile_row(size: str, op: str, plan: LaunchPlan, target: str, out: Path | None) -> dict[str, Any]:
    """One report row; a compile error goes into the row, so that one bad kernel hides no other."""
    row = dict(size=size, op=op, kernel=plan.kernel.__name__, target=target,
               arguments=len(plan.inputs) + len(plan.scalars) + len(plan.outputs), ok=False)
    try:
        compiled = compile_plan(plan, target)
    except Exception as exc:
        return row | dict(error=f"{type(exc).__name__}: {exc}")
    if TARGETS[target].backend == "hip":
        hsaco = compiled.asm["hsaco"]
        if out:
            path = out / target / size / op / f"{plan.kernel.__name__}.hsaco"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(hsaco)
        return row | dict(shared=compiled.metadata.shared, hsaco=len(hsaco), ok=len(hsaco) > 0)
    ptx = compiled.asm["ptx"]
    params = entry_params(ptx)
    if out:
        path = out / target / size / op / f"{plan.kernel.__name__}.ptx"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(ptx)
    return row | dict(params=params, **resource_usage(compiled.asm["cubin"]), shared=compiled.metadata.shared,
                      ok=params == row["arguments"] + HIDDEN_PARAMS)


def table(rows: list[dict[str, Any]]) -> str:
    lines = [COLUMNS] + [[str(row.get(column, "")) for column in COLUMNS] for row in rows]
    widths = [max(map(len, column)) for column in zip(*lines)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m v4engine.plugins.kernels.aot", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", nargs="+", required=True,
                        choices=list(TARGETS), help="the GPU targets compiled for")
    parser.add_argument("--size", nargs="+", choices=list(SIZES), default=list(SIZES),
                        help="the model widths whose kernels are compiled (default: all)")
    parser.add_argument("--out", type=Path, help="write the PTX to OUT/target/size/op/kernel.ptx")
    parser.add_argument("--json", action="store_true", help="print the rows as a JSON list instead of a table")
    args = parser.parse_args(argv)
    if interpreting():
        parser.error("TRITON_INTERPRET=1 is set, and Triton's interpreter cannot compile: unset it "
                     "(env -u TRITON_INTERPRET python -m v4engine.plugins.kernels.aot ...)")
    rows = [compile_row(size, op, plan, target, args.out) for size in args.size
            for op, op_plans in plans(size).items() for plan in op_plans for target in args.targets]
    print(json.dumps(rows, indent=1) if args.json else table(rows))
    return 0 if all(row["ok"] for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
