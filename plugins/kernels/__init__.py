"""Triton kernels of V4's custom ops: what the TensorRT plugins launch (and, later, MIGraphX custom ops).

One module per op family (attention, indexer, compressor), each with a kernel, a `plan_*` function giving
its `LaunchPlan` (launch.py) and a PyTorch-facing launcher with the same signature as the op's reference
in `v4engine.plugins`. Importing this package needs triton, never TensorRT. catalog.py lists every plan at
named sizes; aot.py compiles them all for GPUs this machine need not have.
"""
