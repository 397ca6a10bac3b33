"""The options one backend takes, at build time and when its engines are opened: one frozen dataclass each, hung on
the backend's record (contract/backends.py `Backend.build_options`, `Backend.session_options`).

Generic entry points (BuildOptions, Generator.from_engine_dir, v4build's flags) pass what their caller gave as a
mapping; `read` refuses, in one line, an option the engine's backend does not take or a value of another type,
rather than dropping it: `cuda_graphs=False` on a TensorRT engine (which always replays the graphs it was built
with) is an error, not a silence. Each field is one option with its default.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from .untrusted import shown

TENSORRT_OPTIMIZATION_LEVEL = 3              # --builder-optimization-level's default, TensorRT's own


@dataclass(frozen=True)
class BackendOptions:
    @classmethod
    def read(cls, given: Mapping[str, Any] | None, backend: str, error: type[Exception]) -> Self:
        """These options from `given` (option name -> value; absent ones keep their defaults)."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        hints = typing.get_type_hints(cls)
        values = {}
        for name, value in (given or {}).items():
            if name not in fields:
                takes = ", ".join(fields) or "none"
                raise error(f"option {name!r} is not one {backend} engines take (their {cls.kind} options: {takes})")
            if not _matches(value, hints[name]):
                raise error(f"{backend} {cls.kind} option {name!r} must be {_described(hints[name])} "
                            f"(got {shown(value)})")
            values[name] = tuple(value) if isinstance(value, list) else Path(value) if isinstance(value, str) \
                and Path in typing.get_args(hints[name]) else value
        return cls(**values)

    kind: typing.ClassVar[str] = "build"
    device: typing.ClassVar[str] = "cpu"     # what an engine is built to run on: cpu, cuda (NVIDIA) or rocm (AMD)

    @property
    def cuda_graph_ready(self) -> bool:
        """Whether the graphs are built for CUDA graphs (no control flow): the `cuda_graphs` build option, where
        a backend takes it, and every engine built for ONNX Runtime's CUDA provider."""
        return bool(getattr(self, "cuda_graphs", False)) or self.device == "cuda"

    @property
    def default_dtype(self) -> str:
        """The activation dtype a build takes when --dtype is not given: fp32 on the CPU, where it is exact and the
        only dtype ONNX Runtime's CPU provider runs fast; bf16 on NVIDIA GPUs (fp32 runs at about 1/15 of an H100's
        bf16 rate, and V4's weights are bf16 or narrower)."""
        return "fp32" if self.device == "cpu" else "bf16"


# ---------------------------------------------------------------------- build options (v4build)
ORT_DEVICES = ("cpu", "cuda")     # what an ONNX Runtime engine is built for (`v4build --device`)


@dataclass(frozen=True)
class OnnxRuntimeBuild(BackendOptions):
    cuda_graphs: bool = False        # graphs without control flow; verify and draft cycles recorded on CUDA
    int8_moe_activations: bool = False  # lossy: QMoE quantizes the routed experts' inputs to int8 (engine.json)
    device: str = "cpu"              # `--device`: cpu, or cuda (the CUDA variant: every node on the CUDA provider)


@dataclass(frozen=True)
class TensorRTBuild(BackendOptions):
    device: typing.ClassVar[str] = "cuda"

    cuda_graphs: bool = False        # as ONNX Runtime's: the engines' enqueues recorded by torch.cuda.graph
    onnx_only: bool = False          # prepare and check the graphs, build no engines (no TensorRT needed)
    builder_optimization_level: int = TENSORRT_OPTIMIZATION_LEVEL
    timing_cache: Path | None = None  # kept across builds (default: one in the engine)


@dataclass(frozen=True)
class MIGraphXBuild(BackendOptions):
    device: typing.ClassVar[str] = "rocm"
    # MIGraphX's Python bindings (up to ROCm 7.2.4) take no bf16 buffers, so its compiled programs cannot run a bf16
    # engine (runtime/sessions/migraphx.py): fp16 is the GPU dtype they run
    default_dtype: typing.ClassVar[str] = "fp16"


# ---------------------------------------------------------------------- session options (Generator)
@dataclass(frozen=True)
class OnnxRuntimeSessionOptions(BackendOptions):
    kind: typing.ClassVar[str] = "session"
    providers: tuple | None = None   # execution providers (default: the CPU), names or (name, options)
    threads: int | None = None       # intra-op threads per session (default: OMP_NUM_THREADS, else one per core)
    device_pools: bool | None = None  # pools as torch tensors on the session's device (default: on a GPU provider)
    cuda_graphs: bool | None = None  # replay an engine built --cuda-graphs (default: on the CUDA provider)
    runtime_widening: bool = True    # on the CPU, widen stored weights before the session is made, a group at a time
                                     # (False: ONNX Runtime's constant folding, all at once, with a higher load peak)
    stored_weights: bool = True      # on the CPU, dense FP8 and bf16 projections read their stored bytes in v4engine's
                                     # kernels (runtime/sessions/stored_weights.py; False: float32 weights, stock MatMul)


@dataclass(frozen=True)
class TensorRTSessionOptions(BackendOptions):
    kind: typing.ClassVar[str] = "session"


@dataclass(frozen=True)
class MIGraphXSessionOptions(BackendOptions):
    kind: typing.ClassVar[str] = "session"


def _matches(value: Any, hint: Any) -> bool:
    """Whether `value` is of the option's type (a list for a tuple, text for a path; never a bool for a number)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return any(_matches(value, h) for h in typing.get_args(hint))
    origin = typing.get_origin(hint) or hint
    if origin is type(None):
        return value is None
    if origin is bool:
        return isinstance(value, bool)
    if origin is int:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0
    if origin is tuple:
        return isinstance(value, (tuple, list))
    if origin is Path:
        return isinstance(value, (str, Path))
    return isinstance(value, origin)


def _described(hint: Any) -> str:
    names = {bool: "true or false", int: "an integer >= 0", tuple: "a list", Path: "a path", type(None): "None"}
    parts = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    return " or ".join(names.get(typing.get_origin(p) or p, str(p)) for p in parts)


__all__ = ["BackendOptions", "MIGraphXBuild", "MIGraphXSessionOptions", "OnnxRuntimeBuild",
           "OnnxRuntimeSessionOptions", "TENSORRT_OPTIMIZATION_LEVEL", "TensorRTBuild", "TensorRTSessionOptions"]
