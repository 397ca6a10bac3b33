"""v4engine.plugins.tensorrt: the v4 ops as TensorRT plugins, for the TensorRT backend.

TensorRT's ONNX parser resolves a node to a plugin when its op_type is the plugin's name and its
`plugin_namespace` attribute the plugin's namespace: every `v4::Name` node of our graphs matches the plugin
`v4::Name` registered here. The graphs keep the local function of the same name (the op's definition); the
build's parser flag ENABLE_PLUGIN_OVERRIDE makes the plugin take precedence (docs/backends.md §3, §5). The plugins are Python "quickly deployable plugins" (`tensorrt.plugin`):
`register_plugins()` must run in the process that builds the engine, and, for plugins run just in time, in the
one that loads it. The attention, indexer and compressor nodes run ahead-of-time kernels (`aot=1`); the routed
experts run just in time, so every V4 engine (each has a MoE) loads where Python, torch and Triton are.

Importing this package needs neither TensorRT nor Triton: shapes.py is pure, and plugins.py (Triton, torch)
is imported by register_plugins() once TensorRT is known to be there.
"""
from __future__ import annotations

MIN_TENSORRT = (10, 15)            # ONNX parser flag ENABLE_PLUGIN_OVERRIDE; AOT Python plugins since 10.9
INSTALL = "pip install tensorrt (10.15+/11.x) on a machine with an NVIDIA GPU"

_registered = False


class TensorRTNotInstalled(ImportError):
    """TensorRT cannot be imported here, or is older than MIN_TENSORRT."""


def register_plugins() -> None:
    """Register the v4 plugins with TensorRT's plugin registry; later calls do nothing. The AOT kernels are
    compiled for this machine's GPU, as TensorRT builds its engines for it.

    Caveat: tensorrt.plugin (11.1 sources) turns an int or float attribute's plugin field, a 1-element array,
    into a Python number with int(array), which NumPy 2.4 refuses (TypeError: only 0-dimensional arrays...):
    build engines with numpy < 2.4 (NVIDIA's plugin sample pins 1.26) until TensorRT reads them otherwise."""
    global _registered
    try:
        import tensorrt as trt
        import tensorrt.plugin as trtp
    except ImportError as e:                # not installed, or installed without its libraries (libnvinfer)
        raise TensorRTNotInstalled(f"TensorRT is not installed: {INSTALL}") from e
    if tuple(int(part) for part in trt.__version__.split(".")[:2]) < MIN_TENSORRT:
        raise TensorRTNotInstalled(f"TensorRT {trt.__version__} is too old for the v4 plugins: {INSTALL}")
    if not _registered:
        from .plugins import define

        define(trtp, trt)
        _registered = True


__all__ = ["MIN_TENSORRT", "TensorRTNotInstalled", "register_plugins"]
