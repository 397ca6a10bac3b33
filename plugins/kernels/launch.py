"""One launch plan per kernel call, shared by every way we launch our Triton kernels.

The PyTorch launcher (`launch`), the TensorRT AOT plugin (`plugins/tensorrt/`) and the GPU check
(`scripts/gpu_check.py`, which launches the PTX through cupy) all take the same `LaunchPlan`, so the
argument order, grid and compile options cannot drift apart. The argument order is TensorRT's for AOT
plugins: input pointers, then int32 scalars, then output pointers; everything else (head size, window,
scale, block sizes) is a Triton constexpr baked into the kernel, because TensorRT does not serialize
plugin attributes for AOT kernels.

Grids are written with `+`, `*` and `//` only, so the same plan function evaluates on Python ints
and on TensorRT's symbolic shape expressions.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGETS = {
    "sm90": GPUTarget("cuda", 90, 32),       # H100 / H200
    "sm100": GPUTarget("cuda", 100, 32),     # B200
    "gfx942": GPUTarget("hip", "gfx942", 64),  # MI300 (MIGraphX issue: a build check only)
}

POINTER_TYPES = {"float32": "*fp32", "float16": "*fp16", "bfloat16": "*bf16", "int64": "*i64", "int32": "*i32"}


def cdiv(a: Any, b: int) -> Any:
    """ceil(a / b) with + and // only (works on ints and on TensorRT shape expressions)."""
    return (a + (b - 1)) // b


def pointer_type(dtype: Any) -> str:
    """Triton pointer type of a torch dtype or dtype name: torch.bfloat16 -> '*bf16'."""
    return POINTER_TYPES[str(dtype).removeprefix("torch.")]


@dataclass(frozen=True)
class LaunchPlan:
    """A kernel, its arguments in TensorRT's order, its constexprs, grid and compile options."""
    kernel: Any                                   # a @triton.jit function
    # argument names must be the kernel's parameter names (Triton matches the signature by name)
    inputs: dict[str, str]                        # argument name -> Triton pointer type, in order
    scalars: dict[str, Any]                       # argument name -> int32 value (int or shape expression)
    outputs: dict[str, str]                       # argument name -> Triton pointer type, in order
    constexprs: dict[str, Any]
    grid: tuple[Any, Any, Any]
    num_warps: int = 4
    num_stages: int = 2
    name: str = field(default="")                 # the op, for tables and messages

    def signature(self) -> dict[str, str]:
        """Triton compile signature: every runtime argument in launch order, then the constexprs."""
        sig = dict(self.inputs)
        sig.update({name: "i32" for name in self.scalars})
        sig.update(self.outputs)
        sig.update({name: "constexpr" for name in self.constexprs})
        return sig


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def compile_plan(plan: LaunchPlan, target: str = "sm90"):
    """Compile ahead of time for an explicit target (no GPU needed). Returns Triton's CompiledKernel.

    Every pointer is declared 16-byte aligned (TensorRT and torch allocations are 256-byte aligned), or Triton
    falls back to 2-byte loads. TensorRT launches only its own arguments, so the hidden scratch pointers Triton
    appends must be unused. Needs a process where TRITON_INTERPRET is off: under the interpreter, tl.max & co
    are interpreter objects that cannot be compiled.
    """
    if interpreting():
        raise RuntimeError("compile_plan needs TRITON_INTERPRET unset (compile in a process without it)")
    signature = plan.signature()
    pointers = [i for i, kind in enumerate(signature.values()) if kind.startswith("*")]
    src = ASTSource(fn=plan.kernel, signature=signature, constexprs=dict(plan.constexprs),
                    attrs={(i,): [["tt.divisibility", 16]] for i in pointers})
    compiled = triton.compile(src, target=TARGETS[target], options={
        "num_warps": plan.num_warps, "num_stages": plan.num_stages, "enable_fp_fusion": True})
    md = compiled.metadata
    for scratch in ("global_scratch_size", "profile_scratch_size"):
        if getattr(md, scratch, 0):
            raise RuntimeError(f"{plan.name or md.name}: kernel needs {scratch}={getattr(md, scratch)}, "
                               "which TensorRT AOT plugins cannot provide")
    return compiled


def launch(plan: LaunchPlan, inputs: list, outputs: list) -> None:
    """Run the plan on torch tensors (CUDA, or CPU under TRITON_INTERPRET=1); grid and scalars must be ints."""
    plan.kernel[tuple(int(g) for g in plan.grid)](
        *inputs, *[int(v) for v in plan.scalars.values()], *outputs, **plan.constexprs,
        num_warps=plan.num_warps, num_stages=plan.num_stages)
