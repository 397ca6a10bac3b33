"""The TensorRT plugins (plugins/tensorrt/) without TensorRT: its plugin functions are registered with a stand-in
for `tensorrt.plugin` (FakeTrtp) and called the way TensorRT 11.1 calls them.

1. What `@trtp.register` and `@trtp.autotune` declare for every v4 node of exported graphs (the output shapes and
   types, the accepted type combinations, the attributes) agrees with ONNX shape inference on those graphs.
2. `@trtp.aot_impl` at V4-Flash sizes, with symbolic batch, length and row counts, returns the catalog's kernel:
   the same PTX, named by its `.entry`, launched with the catalog plan's grid, block, shared memory and scalars.
   It compiles in a child process without TRITON_INTERPRET (which conftest.py sets without a GPU: see
   test_kernels_aot.py).
3. register_plugins() without TensorRT fails with one clear line.
"""
from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
import typing
from types import SimpleNamespace
from typing import Any

import onnx
import pytest
import sympy
import torch

pytest.importorskip("triton")

from v4engine.builder.build import add_functions                           # noqa: E402
from v4engine.builder.export import export_draft, export_target            # noqa: E402
from v4engine.builder.tiny import TINY_CONFIGS                            # noqa: E402
from v4engine.builder.weights import serialize_without_data               # noqa: E402
from v4engine.contract.config import V4Config                              # noqa: E402
from v4engine.contract.drafting import MTP                                 # noqa: E402
from v4engine.plugins import DOMAIN                                       # noqa: E402
from v4engine.plugins import tensorrt as trt_plugins                      # noqa: E402
from v4engine.plugins.kernels import aot, catalog                         # noqa: E402
from v4engine.plugins.kernels.launch import compile_plan                  # noqa: E402
from v4engine.plugins.tensorrt.plugins import OPS, define, device_target  # noqa: E402



# --------------------------------------------------------------------------- a symbolic dim that compares
class SymDim:
    """TensorRT's ShapeExpr as our plugins may use it: +, * and // with an int or a dim on the right (ShapeExpr has
    no __radd__/__rmul__), is_constant / constant_value(); backed by sympy, so that results compare with ==."""

    def __init__(self, expr: Any):
        self.expr = sympy.sympify(expr)

    def __add__(self, other): return SymDim(self.expr + _sym(other))
    def __mul__(self, other): return SymDim(self.expr * _sym(other))
    def __floordiv__(self, other): return SymDim(self.expr // _sym(other))

    @property
    def is_constant(self) -> bool:
        return self.expr.is_Integer

    def constant_value(self) -> int:
        return int(self.expr)

    def __eq__(self, other) -> bool:
        diff = self.expr - _sym(other)
        return diff == 0 or sympy.simplify(diff) == 0

    __hash__ = None

    def __repr__(self) -> str:
        return str(self.expr)


def _sym(x: Any) -> sympy.Expr:
    return x.expr if isinstance(x, SymDim) else sympy.sympify(x)


def parse_dim(text: str) -> SymDim:
    """An ONNX dim_param as the exporter writes it ('rows_csa + (((seq + 3)//4))', 'Min(2, ...)')."""
    names = set(re.findall(r"[A-Za-z_]\w*", text)) - {"Min", "Max"}
    return SymDim(sympy.sympify(text, locals={n: sympy.Symbol(n, integer=True, nonnegative=True) for n in names}))


def value(x: Any, subs: dict) -> int:
    """An int, SymDim or FakeSymInt32 evaluated at subs."""
    x = x.value if isinstance(x, FakeSymInt32) else x
    return int(_sym(x).subs(subs))


# --------------------------------------------------------------------------- a stand-in for tensorrt.plugin
class FakeTensorDesc:
    def __init__(self, shape_expr: tuple, dtype: str):
        self.shape_expr, self.dtype = shape_expr, dtype


class FakeSymInt32:
    def __init__(self, value: Any):
        self.value = value


class FakeKernelLaunchParams:
    """As trtp.KernelLaunchParams: these seven fields only, 1 (shared_mem: 0) unless set."""
    FIELDS = ("grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z", "shared_mem")

    def __init__(self):
        for name in self.FIELDS:
            setattr(self, name, 0 if name == "shared_mem" else 1)

    def __setattr__(self, name, value):
        if name not in self.FIELDS:
            raise AttributeError(f"KernelLaunchParams object has no attribute '{name}'")
        super().__setattr__(name, value)


class FakeSymIntExprs(list):
    @classmethod
    def from_tuple(cls, exprs):
        return cls(exprs)


FAKE_TRT = SimpleNamespace(DataType=SimpleNamespace(FLOAT="FP32", HALF="FP16", BF16="BF16", INT64="INT64",
                                                   INT8="INT8"))
ATTRIBUTE_TYPES = (int, float, bytes, bool, str)


class FakeTrtp:
    """Records the decorated functions after the checks tensorrt/plugin/_validate.py (TensorRT 11.1) makes, and
    calls them as _plugin_class.py does."""
    TensorDesc = FakeTensorDesc
    KernelLaunchParams = FakeKernelLaunchParams
    SymInt32 = FakeSymInt32
    SymIntExprs = FakeSymIntExprs

    def __init__(self):
        self.plugins: dict[str, dict[str, Any]] = {}

    @staticmethod
    def from_shape_expr(shape_expr: tuple, dtype: str) -> FakeTensorDesc:
        return FakeTensorDesc(tuple(shape_expr), dtype)

    @staticmethod
    def min(a, b) -> SymDim:
        if isinstance(a, int) and isinstance(b, int):
            raise ValueError("Both arguments cannot be 'int's")
        return SymDim(sympy.Min(_sym(a), _sym(b)))

    @staticmethod
    def AutoTuneCombination(io_types: str, layouts: str = "LINEAR") -> SimpleNamespace:
        return SimpleNamespace(types=tuple(t.strip() for t in io_types.split(",")), layouts=layouts)

    def register(self, plugin_id: str):
        def record(fn):
            sig = inspect.signature(fn)
            params = list(sig.parameters.values())
            inputs = [p.name for p in params if p.annotation is FakeTensorDesc]
            attrs = {p.name: p.annotation for p in params[len(inputs):]}
            assert inputs and [p.name for p in params[:len(inputs)]] == inputs, "TensorDescs first"
            assert all(t in ATTRIBUTE_TYPES for t in attrs.values()), attrs
            assert not {"outputs", "stream", "tactic"} & set(attrs)
            assert all(p.default is p.empty for p in params)
            ret = sig.return_annotation
            outputs = typing.get_args(ret) if typing.get_origin(ret) is tuple else (ret,)
            assert all(t is FakeTensorDesc for t in outputs), ret
            self.plugins[plugin_id] = dict(register=fn, inputs=inputs, attrs=attrs)
            return fn
        return record

    def _later(kind: str, tail: tuple[str, ...]):
        def decorator(self, plugin_id: str):
            def record(fn):
                plugin = self.plugins[plugin_id]
                names = list(inspect.signature(fn).parameters)
                n = len(plugin["inputs"])
                middle = names[n:len(names) - len(tail)]
                assert names[:n] == plugin["inputs"] and tuple(names[len(names) - len(tail):]) == tail, names
                assert middle == [a for a in plugin["attrs"] if a in middle], names
                plugin[kind] = fn
                return fn
            return record
        return decorator

    autotune = _later("autotune", ("outputs",))
    aot_impl = _later("aot_impl", ("outputs", "tactic"))
    impl = _later("impl", ("outputs", "stream"))
    del _later

    # calls, as TensorRT makes them
    def outputs(self, plugin_id: str, descs: list, attrs: dict) -> tuple:
        out = self.plugins[plugin_id]["register"](*descs, **attrs)
        return out if isinstance(out, tuple) else (out,)

    def combinations(self, plugin_id: str, descs: list, outputs: tuple) -> list[tuple[str, ...]]:
        return [c.types for c in self.plugins[plugin_id]["autotune"](*descs, outputs)]

    def aot(self, plugin_id: str, descs: list, attrs: dict, outputs: tuple, tactic: int = 0) -> tuple:
        plugin = self.plugins[plugin_id]
        ret = inspect.signature(plugin["aot_impl"]).return_annotation
        args = typing.get_args(ret)
        assert typing.get_origin(ret) is tuple and len(args) == 4, ret
        assert args[2] is FakeKernelLaunchParams and issubclass(args[3], FakeSymIntExprs), ret
        values = [attrs[a] for a in plugin["attrs"]]          # every attribute, in registration order
        return plugin["aot_impl"](*descs, *values, outputs, tactic)


def fake_plugins(target: str = "sm90") -> FakeTrtp:
    trtp = FakeTrtp()
    define(trtp, FAKE_TRT, target)
    assert set(trtp.plugins) == {f"{DOMAIN}::{op.name}" for op in OPS}
    for op in OPS:       # ahead of time where the op has a plan, else just in time only
        kinds = {"register", "autotune", "impl"} | ({"aot_impl"} if op.plan else set())
        assert set(trtp.plugins[f"{DOMAIN}::{op.name}"]) - {"inputs", "attrs"} == kinds, op.name
    return trtp


# --------------------------------------------------------------------------- 1. shapes and types vs ONNX
ONNX_TYPES = {onnx.TensorProto.FLOAT: "FP32", onnx.TensorProto.FLOAT16: "FP16", onnx.TensorProto.BFLOAT16: "BF16",
              onnx.TensorProto.INT64: "INT64", onnx.TensorProto.INT8: "INT8"}
ATTRIBUTE_KINDS = {onnx.AttributeProto.INT: int, onnx.AttributeProto.FLOAT: float}


@pytest.fixture(scope="module")
def graphs() -> dict[str, onnx.ModelProto]:
    """split_groups' graphs (target: an HCA and a CSA layer, in bf16; draft: the sliding MTP layer, in fp32), with
    the op functions and opsets builder/build.py gives them; no weights (shape inference reads none). And the
    stored-experts ops as the TensorRT preparation makes them (never exported): one node each, fp16, symbolic T."""
    cfg = V4Config.from_dict(TINY_CONFIGS["split_groups"], source="tiny config split_groups")
    out = {}
    for name, dtype in (("target", torch.bfloat16), ("draft", torch.float32)):
        model = export_draft(cfg, MTP, 3, dtype=dtype) if name == "draft" else export_target(cfg, dtype=dtype)
        proto = serialize_without_data(model)
        add_functions(proto)
        out[name] = proto
    out["stored experts"] = stored_experts_graph(experts=8, dim=256, inter=128, k=3)
    return out


def stored_experts_graph(experts: int, dim: int, inter: int, k: int) -> onnx.ModelProto:
    """A graph of an Fp8RoutedExperts and an Mxfp4RoutedExperts node over x [T, dim] fp16."""
    T = onnx.TensorProto
    inputs = [onnx.helper.make_tensor_value_info("x", T.FLOAT16, ["T", dim]),
              onnx.helper.make_tensor_value_info("indices", T.INT64, ["T", k]),
              onnx.helper.make_tensor_value_info("weights", T.FLOAT, ["T", k])]
    nodes, outputs = [], []
    for fmt, per_byte, block in (("fp8", 1, 128), ("mxfp4", 2, 32)):
        names = []
        for w, (rows, cols) in (("w1", (inter, dim)), ("w2", (dim, inter)), ("w3", (inter, dim))):
            names += [f"{fmt}.{w}", f"{fmt}.{w}_scale"]
            inputs += [onnx.helper.make_tensor_value_info(f"{fmt}.{w}", T.INT8, [experts, rows, cols // per_byte]),
                       onnx.helper.make_tensor_value_info(f"{fmt}.{w}_scale", T.FLOAT if fmt == "fp8" else T.INT8,
                                                          [experts, rows, -(-cols // block)])]
        op_type = "Fp8RoutedExperts" if fmt == "fp8" else "Mxfp4RoutedExperts"
        nodes.append(onnx.helper.make_node(op_type, ["x", "indices", "weights", *names], [f"{fmt}.out"],
                                           domain=DOMAIN, limit=7.0, plugin_namespace="v4", plugin_version="1"))
        outputs.append(onnx.helper.make_tensor_value_info(f"{fmt}.out", T.FLOAT, ["T", dim]))   # as exported
    model = onnx.helper.make_model(onnx.helper.make_graph(nodes, "stored experts", inputs, outputs),
                                   opset_imports=[onnx.helper.make_opsetid("", 23)], ir_version=10)
    add_functions(model)
    return model


def tensor_types(model: onnx.ModelProto) -> dict[str, tuple[str, list]]:
    """Value name -> (type, dims); a dim is an int, a dim_param, or None when unknown."""
    out = {t.name: (ONNX_TYPES.get(t.data_type), list(t.dims)) for t in model.graph.initializer}
    for v in [*model.graph.input, *model.graph.output, *model.graph.value_info]:
        tensor = v.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else d.dim_param or None for d in tensor.shape.dim]
        out[v.name] = (ONNX_TYPES.get(tensor.elem_type), dims)
    return out


def as_dims(dims: list) -> tuple[SymDim | None, ...]:
    """TensorRT's view of ONNX dims (every dim a ShapeExpr); None for unknown and shape inference's unk__ names."""
    return tuple(None if d is None or str(d).startswith("unk__") else parse_dim(d) if isinstance(d, str)
                 else SymDim(d) for d in dims)


def infer(model: onnx.ModelProto) -> dict[str, tuple[str, list]]:
    return tensor_types(onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True, data_prop=True))


def without_v4_output_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy whose v4 node outputs lose the shapes the exporter declared: inference then has only the bodies."""
    bare = onnx.ModelProto()
    bare.CopyFrom(model)
    outputs = {o for node in bare.graph.node if node.domain == DOMAIN for o in node.output}
    kept = [v for v in bare.graph.value_info if v.name not in outputs]
    del bare.graph.value_info[:]
    bare.graph.value_info.extend(kept)
    return bare


def test_plugin_declarations_agree_with_onnx_shape_inference(graphs):
    """For every v4 node: the node's attributes are the plugin's (names, order, types); register() on the node's
    input shapes gives the output shapes and types strict shape inference gives (the exporter's declared shapes,
    merged with the op functions' inference), and the function bodies alone never contradict them; the node's
    types are one of autotune's combinations."""
    trtp = fake_plugins()
    ops = {op.name: op for op in OPS}
    seen = set()
    for graph, model in graphs.items():
        types, bodies = infer(model), infer(without_v4_output_shapes(model))
        for node in (n for n in model.graph.node if n.domain == DOMAIN and n.op_type in ops):
            plugin_id, op = f"{DOMAIN}::{node.op_type}", ops[node.op_type]
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute
                     if not a.name.startswith("plugin_")}
            assert {a.name: ATTRIBUTE_KINDS.get(a.type) for a in node.attribute if a.name in attrs} == op.attributes
            assert list(attrs) == list(op.attributes) == list(trtp.plugins[plugin_id]["attrs"])
            assert len(node.input) == len(op.inputs) == len(op.shapes.input_types)
            descs = [FakeTensorDesc(as_dims(types[i][1]), types[i][0]) for i in node.input]
            outputs = trtp.outputs(plugin_id, descs, attrs)
            assert len(outputs) == len(node.output)
            for desc, name in zip(outputs, node.output):
                dtype, dims = types[name]
                assert all(d is not None for d in as_dims(dims)), (graph, node.name, name, dims)
                assert (desc.dtype, desc.shape_expr) == (dtype, as_dims(dims)), (graph, node.name, name)
                body_type, body_dims = bodies[name]
                assert body_type == dtype and len(body_dims) == len(dims), (graph, node.name, name)
                assert all(d is None or d == want for d, want in zip(as_dims(body_dims), desc.shape_expr)), \
                    (graph, node.name, name, body_dims)
            io = tuple(d.dtype for d in descs + list(outputs))
            assert io in trtp.combinations(plugin_id, descs, outputs), (graph, node.name, io)
            seen.add(node.op_type)
    assert seen == set(ops)


# --------------------------------------------------------------------------- 2. ahead-of-time kernels
def aot_cases() -> dict[str, tuple[str, list[FakeTensorDesc], dict[str, Any], dict]]:
    """op -> (catalog call, input descs, attributes, values of the symbols): catalog.plans('v4-flash') at batch B,
    S new tokens, T window keys, R compressed rows, L compressor tokens, all symbolic; k = Min(topk, R) as the
    indexer's output declares it. Paged: a pool of P blocks of the layout's rows, a table of W blocks, N new rows
    (the catalog's whole blocks of past rows, then the rest)."""
    z = catalog.SIZES["v4-flash"]
    B, S, T, R, L, P, W, N = (sympy.Symbol(n, integer=True, positive=True) for n in "BSTRLPWN")

    def desc(*shape: Any, dtype: str = "BF16") -> FakeTensorDesc:
        return FakeTensorDesc(tuple(SymDim(d) for d in shape), dtype)

    window = [desc(B, S, z.H, z.d), desc(B, S, dtype="INT64"), desc(B, T, z.d), desc(B, T, dtype="INT64")]
    sink = desc(z.H, dtype="FP32")
    attention = dict(window=z.window, scale=z.d ** -0.5)
    at = {B: z.B, S: z.S, T: z.window - 1 + z.S}
    compressed = [desc(B, L, z.hca_C), desc(B, L, z.hca_C), desc(B, dtype="INT64")]

    def paged(op: str, width: int, rows: int) -> tuple[list[FakeTensorDesc], dict]:
        page = catalog.page_rows(z, op)
        blocks = (rows - 1) // page
        return [desc(P, page, width), desc(B, W, dtype="INT64"), desc(B, N, width)], \
            {P: blocks * z.B + 1, W: blocks, N: rows - blocks * page}

    hca_pool, hca_at = paged("hca_attention_paged", z.d, z.hca_rows)
    csa_pool, csa_at = paged("csa_attention_paged", z.d, z.csa_rows)
    key_pool, key_at = paged("indexer_topk_paged", z.dI, z.csa_rows)
    indexer_q = [desc(B, S, z.h, z.dI), desc(B, S, z.h, dtype="FP32")]
    overlapped = [desc(B, L, z.csa_C), desc(B, L, z.csa_C), desc(B, dtype="INT64")]
    return {
        "SlidingAttention": ("sliding_attention", window + [sink], attention, at),
        "HcaAttentionPaged": ("hca_attention_paged", window + hca_pool + [desc(B, R, dtype="INT64"), sink],
                              attention | dict(ratio=z.hca_ratio), at | hca_at | {R: z.hca_rows}),
        "CsaAttentionPaged": ("csa_attention_paged", window + csa_pool + [desc(B, S, z.topk, dtype="INT64"), sink],
                              attention, at | csa_at),
        "IndexerTopKPaged": ("indexer_topk_paged", indexer_q + key_pool + [desc(B, R, dtype="INT64"),
                                                                          desc(B, S, dtype="INT64")],
                             dict(topk=z.topk, ratio=z.csa_ratio, scale=z.dI ** -0.5),
                             {B: z.B, S: z.S, R: z.csa_rows} | key_at),
        "HcaCompress": ("hca_compress", compressed, dict(ratio=z.hca_ratio, state_tokens=z.hca_ratio - 1),
                        {B: z.B, L: z.hca_ratio - 1 + z.S}),
        "CsaCompress": ("csa_compress", overlapped, dict(ratio=z.csa_ratio, state_tokens=2 * z.csa_ratio - 1),
                        {B: z.B, L: 2 * z.csa_ratio - 1 + z.S}),
    }


def aot_rows(target: str) -> list[dict[str, Any]]:
    """Run in the child: each op's aot_impl result next to its catalog plan, compiled."""
    trtp = fake_plugins(target)
    rows = []
    for op, (call, descs, attrs, at) in aot_cases().items():
        plugin_id = f"{DOMAIN}::{op}"
        outputs = trtp.outputs(plugin_id, descs, attrs)
        name, ptx, launch, scalars = trtp.aot(plugin_id, descs, attrs, outputs)
        (plan,) = catalog.plans("v4-flash")[call]
        want = compile_plan(plan, target)
        grid = [launch.grid_x, launch.grid_y, launch.grid_z]
        rows.append(dict(
            op=op, name=name, entries=re.findall(r"\.entry\s+(\w+)", ptx), params=aot.entry_params(ptx),
            same_ptx=ptx == want.asm["ptx"], symbolic_grid=[bool(_sym(g).free_symbols) for g in grid],
            scalars_are_sym_int32=all(isinstance(s, FakeSymInt32) for s in scalars),
            got=dict(grid=[value(g, at) for g in grid], block=[launch.block_x, launch.block_y, launch.block_z],
                     shared=launch.shared_mem, scalars=[value(s, at) for s in scalars]),
            want=dict(grid=list(plan.grid), block=[plan.num_warps * 32, 1, 1], shared=want.metadata.shared,
                      scalars=list(plan.scalars.values())),
            want_name=want.metadata.name, want_params=len(plan.inputs) + len(plan.scalars) + len(plan.outputs) + 2))
    return rows


def test_aot_impl_returns_the_catalog_kernel_with_its_launch():
    """Kernel name = the PTX's only .entry; the PTX is the catalog plan's (so it compiles, with exactly TensorRT's
    arguments plus Triton's two unused scratch pointers); grid, block = num_warps·32 and shared memory are the
    plan's; the scalars are SymInt32s in the plan's order (S, T, H, R, k for CSA: distinct values here). The grid
    stays symbolic in the batch and length dims."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}     # compiled, not interpreted
    done = subprocess.run([sys.executable, __file__, "sm90"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.splitlines()[-1])
    assert [row["op"] for row in rows] == [op.name for op in OPS if op.plan is not None]
    for row in rows:
        assert row["entries"] == [row["name"]] == [row["want_name"]], row
        assert row["same_ptx"] and row["params"] == row["want_params"], row
        assert row["got"] == row["want"], row
        assert row["scalars_are_sym_int32"] and any(row["symbolic_grid"]), row


def test_aot_impl_refuses_what_its_kernel_cannot_take():
    """A static dim left dynamic (the kernel bakes it in), and I/O types the kernel was not planned for."""
    trtp = fake_plugins()
    _, descs, attrs, _ = aot_cases()["CsaCompress"]
    B, L, C = (SymDim(sympy.Symbol(n, integer=True, positive=True)) for n in "BLC")
    dynamic = [FakeTensorDesc((B, L, C), "BF16"), FakeTensorDesc((B, L, C), "BF16"), descs[2]]
    with pytest.raises(ValueError, match="v4::CsaCompress: dim C is dynamic"):
        trtp.aot("v4::CsaCompress", dynamic, attrs, trtp.outputs("v4::CsaCompress", dynamic, attrs))
    _, descs, attrs, _ = aot_cases()["SlidingAttention"]
    descs[-1] = FakeTensorDesc(descs[-1].shape_expr, "BF16")                # no combination has a bf16 sink
    with pytest.raises(TypeError, match="differ from the kernel's"):
        trtp.aot("v4::SlidingAttention", descs, attrs, trtp.outputs("v4::SlidingAttention", descs, attrs))


def test_device_target_names_the_compile_target_of_a_gpu():
    assert (device_target((9, 0)), device_target((10, 0))) == ("sm90", "sm100")
    with pytest.raises(ValueError, match="no kernel target for sm_89"):
        device_target((8, 9))


# --------------------------------------------------------------------------- 3. without TensorRT
def test_register_plugins_without_tensorrt_fails_with_one_clear_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)          # import tensorrt fails, installed or not
    with pytest.raises(ImportError) as info:
        trt_plugins.register_plugins()
    assert isinstance(info.value, trt_plugins.TensorRTNotInstalled)
    assert str(info.value) == ("TensorRT is not installed: pip install tensorrt (10.15+/11.x) on a machine with an "
                               "NVIDIA GPU")


if __name__ == "__main__":         # the AOT rows of one target, from a process where Triton compiles for real
    print(json.dumps(aot_rows(sys.argv[1])))
