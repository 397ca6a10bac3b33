"""Dense projections over stored FP8 and bf16 weights, and routed experts over stored MXFP4 ones, on v4engine's CPU
kernels (runtime/sessions/stored_weights.py): ONNX Runtime's own values (its DequantizeLinear or Cast, then its
MatMul or Gemm; its QMoE) and V4's definition up to the order of float32 sums, only what the kernels compute
rewritten, and the stock graph where the kernels cannot be built."""
import ml_dtypes
import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import ModelProto, TensorProto, helper

from v4engine.runtime.generator import Generator
from v4engine.runtime.sampling import SamplingParams
from v4engine.runtime.sessions import stored_weights
from v4engine.runtime.sessions.onnxruntime import stored_projections

E4M3, BF16 = TensorProto.FLOAT8E4M3FN, TensorProto.BFLOAT16


NAN_CODES = (0x7F, 0xFF)                     # e4m3's S.1111.111
CODES = np.array([c for c in range(256) if c not in NAN_CODES], np.uint8)


def e4m3_bytes(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """Every e4m3 code but NaN, subnormals and both zeros included, spread over [n, k]."""
    return rng.permutation(np.resize(CODES, n * k)).reshape(n, k)


def projection(stored: int, x_shape: list[int], n: int, k: int, rng: np.random.Generator, gemm: bool = False,
               block: int = 128, groups: int = 1) -> ModelProto:
    """X [..., k] times a stored weight [n, k] as the exporter writes it: widened (blocked DequantizeLinear with its
    float32 scales, or Cast), then Transpose and MatMul, or Gemm with transB; with `groups`, V4's grouped wo_a: the
    widened weight viewed as [groups, n / groups, k] (a Reshape to a Concat of constants), its last two axes
    transposed, and X [groups, M, k] (or one X for all) times each."""
    if stored == E4M3:
        weight = helper.make_tensor("w", E4M3, [n, k], e4m3_bytes(rng, n, k).tobytes(), raw=True)
        scales = (2.0 ** rng.integers(-8, 4, (n, -(-k // block)))).astype(np.float32)
        scales[0, 0] = 0.37                                         # a scale that is not a power of two
        nodes = [helper.make_node("DequantizeLinear", ["w", "s"], ["wide"], axis=1, block_size=block)]
        initializers = [weight, helper.make_tensor("s", TensorProto.FLOAT, scales.shape, scales.ravel())]
    else:
        values = rng.standard_normal((n, k)).astype(ml_dtypes.bfloat16)
        weight = helper.make_tensor("w", BF16, [n, k], values.view(np.uint16).tobytes(), raw=True)
        nodes = [helper.make_node("Cast", ["w"], ["wide"], to=TensorProto.FLOAT)]
        initializers = [weight]
    if gemm:
        nodes.append(helper.make_node("Gemm", ["x", "wide"], ["y"], transB=1))
    elif groups > 1:
        nodes += [helper.make_node("Constant", [], ["d0"], value_ints=[groups]),     # as torch's exporter writes
                  helper.make_node("Constant", [], ["d1"], value=helper.make_tensor("d1", TensorProto.INT64, [1],
                                                                                   [n // groups])),
                  helper.make_node("Constant", [], ["d2"], value_ints=[-1]),
                  helper.make_node("Concat", ["d0", "d1", "d2"], ["view"], axis=0),
                  helper.make_node("Reshape", ["wide", "view"], ["grouped"]),
                  helper.make_node("Transpose", ["grouped"], ["grouped_t"], perm=[0, 2, 1]),
                  helper.make_node("MatMul", ["x", "grouped_t"], ["y"])]
    else:
        nodes += [helper.make_node("Transpose", ["wide"], ["wide_t"], perm=[1, 0]),
                  helper.make_node("MatMul", ["x", "wide_t"], ["y"])]
    graph = helper.make_graph(nodes, "projection", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])


def run(model: bytes, x: np.ndarray, library=None) -> np.ndarray:
    options = ort.SessionOptions()
    if library is not None:
        options.register_custom_ops_library(str(library))
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


@pytest.fixture(scope="module")
def kernels():
    library = stored_weights.library()
    assert not isinstance(library, str), library          # make setup fetched the headers; g++ is on the machine
    return library


@pytest.mark.parametrize("stored, x_shape, n, k, gemm", [
    (E4M3, [1, 256], 8, 256, False),         # a decode: one token
    (E4M3, [3, 7, 200], 10, 200, False),     # three rows of 7 tokens, a last block of 72, N not a multiple of 4
    (E4M3, [13, 384], 33, 384, True),        # Gemm
    (E4M3, [256, 128], 16, 128, False),      # a prefill chunk
    (BF16, [5, 64], 33, 64, False),
    (BF16, [2, 1, 100], 7, 100, False),
    (BF16, [9, 48], 4, 48, True),
    (BF16, [100, 72], 21, 72, False),        # a prefill chunk's panels: a last panel of 21 columns, K % 16 = 8
])
def test_the_kernels_compute_what_onnx_runtime_computes_from_widened_weights(kernels, stored, x_shape, n, k, gemm):
    rng = np.random.default_rng(n * k)
    model = projection(stored, x_shape, n, k, rng, gemm)
    stock = model.SerializeToString()
    done = stored_weights.rewrite(model, smallest=0)
    assert done.projections == {"E4m3MatMul" if stored == E4M3 else "Bf16MatMul": 1}
    assert [node.op_type for node in model.graph.node] == [done.projections.popitem()[0]]
    x = rng.standard_normal(x_shape).astype(np.float32)
    want, got = run(stock, x), run(model.SerializeToString(), x, kernels)
    assert got.shape == want.shape
    assert np.allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("stored, x_shape, n, k, groups", [
    (E4M3, [4, 3, 256], 32, 256, 4),          # V4's wo_a: each group's rows of X times its weight, a decode
    (E4M3, [4, 70, 128], 64, 128, 4),         # a prefill chunk's panels
    (E4M3, [2, 20, 128], 24, 128, 2),         # a batch's verify
    (BF16, [5, 64], 24, 64, 3),               # one X [M, k] for every group
    (BF16, [1, 12, 64], 24, 64, 2),           # one X [1, M, k] for every group
])
def test_grouped_projections_compute_what_onnx_runtime_computes(kernels, stored, x_shape, n, k, groups):
    rng = np.random.default_rng(n * k + groups)
    model = projection(stored, x_shape, n, k, rng, groups=groups)
    stock = model.SerializeToString()
    op = "E4m3MatMul" if stored == E4M3 else "Bf16MatMul"
    assert stored_weights.rewrite(model, smallest=0).projections == {op: 1}
    [node] = model.graph.node
    assert node.op_type == op and helper.get_attribute_value(node.attribute[-1]) == groups
    x = rng.standard_normal(x_shape).astype(np.float32)
    want, got = run(stock, x), run(model.SerializeToString(), x, kernels)
    assert got.shape == want.shape == (groups, x_shape[-2], n // groups)
    assert np.allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_a_grouped_product_the_kernel_cannot_take_stays_with_the_stock_kernels():
    """Groups that do not divide the weight's rows, an X of unknown rank, another transpose: left as they are."""
    rng = np.random.default_rng(2)
    uneven = projection(BF16, [3, 4, 64], 24, 64, rng, groups=3)
    [rows] = [node for node in uneven.graph.node if node.output[0] == "d1"]
    rows.attribute[0].t.CopyFrom(helper.make_tensor("d1", TensorProto.INT64, [1], [7]))
    unknown = projection(BF16, [3, 4, 64], 24, 64, rng, groups=3)
    unknown.graph.input[0].type.tensor_type.ClearField("shape")
    swapped = projection(BF16, [3, 4, 64], 24, 64, rng, groups=3)
    swapped.graph.node[-2].attribute[0].ints[:] = [1, 2, 0]
    for model in (uneven, unknown, swapped):
        assert stored_weights.rewrite(model, smallest=0).projections == {}


@pytest.mark.parametrize("scale", [0.5, 2.0 ** -126, 2.0 ** 99, 0.37])
@pytest.mark.parametrize("x_rows", [1, 5])                   # the fused kernel (decode) and the buffered one
def test_every_e4m3_code_widens_to_dequantize_linears_value(kernels, scale, x_rows):
    """Weight row c holds code c throughout; X picks one column: Y[c] is code c times its scale, bit for bit (the
    subnormal codes, the smallest and largest scales the kernel takes, and one that is not a power of two)."""
    codes = np.repeat(CODES[:, None], 32, axis=1)
    model = projection(E4M3, [x_rows, 32], len(CODES), 32, np.random.default_rng(0), block=16)
    model.graph.initializer[0].raw_data = codes.tobytes()
    model.graph.initializer[1].CopyFrom(helper.make_tensor("s", TensorProto.FLOAT, [len(CODES), 2],
                                                           np.full(2 * len(CODES), scale, np.float32)))
    stock = model.SerializeToString()
    assert stored_weights.rewrite(model, smallest=0).projections == {"E4m3MatMul": 1}
    x = np.zeros((x_rows, 32), np.float32)
    x[:, 19] = 1.0
    got, want = run(model.SerializeToString(), x, kernels), run(stock, x)
    assert np.array_equal(got, want)
    assert np.array_equal(want[0], (codes[:, 0].view(ml_dtypes.float8_e4m3fn).astype(np.float64) * np.float32(scale)
                                    ).astype(np.float32))


@pytest.mark.parametrize("code", NAN_CODES)
def test_a_weight_holding_nan_or_a_huge_scale_stays_with_the_stock_kernels(code):
    """The e4m3 kernel would read S.1111.111 as 240, and multiplies a scale by 2^8 first: ONNX Runtime keeps
    those weights, and its NaN (or its inf) reaches the output as it would have."""
    rng = np.random.default_rng(1)
    with_nan = projection(E4M3, [1, 128], 4, 128, rng)
    codes = e4m3_bytes(rng, 4, 128)
    codes[2, 7] = code
    with_nan.graph.initializer[0].raw_data = codes.tobytes()
    huge = projection(E4M3, [1, 128], 4, 128, rng)
    huge.graph.initializer[1].CopyFrom(helper.make_tensor("s", TensorProto.FLOAT, [4, 1], [1.0, 1.0, 2.0 ** 100, 1.0]))
    for model in (with_nan, huge):
        assert stored_weights.rewrite(model, smallest=0).projections == {}


def test_small_projections_stay_with_the_stock_kernels():
    """Below SMALLEST weights MLAS over float32 from a core's L2 is faster: by default those are not moved."""
    rng = np.random.default_rng(0)
    small, large = projection(BF16, [1, 64], 64, 64, rng), projection(BF16, [1, 64], 64, 64, rng)
    assert stored_weights.rewrite(small).projections == {}
    assert stored_weights.rewrite(large, smallest=64 * 64).projections == {"Bf16MatMul": 1}


def test_only_chains_the_kernels_compute_are_rewritten():
    rng = np.random.default_rng(0)
    shared = projection(E4M3, [1, 128], 4, 128, rng)        # the widened weight read by a second node too
    shared.graph.node.append(helper.make_node("Relu", ["wide"], ["other"]))
    biased = projection(BF16, [2, 64], 4, 64, rng, gemm=True)
    biased.graph.node[-1].input.append("w")                  # Gemm with a bias: not X W^T alone
    transposed_a = projection(BF16, [64, 2], 4, 64, rng, gemm=True)
    transposed_a.graph.node[-1].attribute.append(helper.make_attribute("transA", 1))
    per_axis = projection(E4M3, [1, 128], 4, 128, rng)
    per_axis.graph.node[0].attribute[0].i = 0                  # scales along the output axis
    odd_blocks = projection(E4M3, [1, 120], 4, 120, rng, block=24)    # blocks of 24: not whole chunks of 16
    for model in (shared, biased, transposed_a, per_axis, odd_blocks):
        before = model.SerializeToString()
        assert stored_weights.rewrite(model, smallest=0).projections == {}
        assert model.SerializeToString() == before


def test_without_headers_the_graph_stays_stock_and_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv(stored_weights.HEADERS, str(tmp_path))
    reason = stored_weights.library()
    assert isinstance(reason, str) and str(tmp_path) in reason
    model = projection(E4M3, [1, 128], 4, 128, np.random.default_rng(0)).SerializeToString()
    monkeypatch.setattr(stored_weights, "_warned", False)
    monkeypatch.setattr(stored_weights, "SMALLEST", 0)
    with pytest.warns(RuntimeWarning, match="stored-weight kernels are off: no ONNX Runtime C API headers"):
        assert stored_projections(model) == (model, None)


def test_the_kernels_build_and_compute_on_a_cpu_without_avx512(monkeypatch, tmp_path):
    """On AVX2 alone (F16C widening, panels transposed lane by lane) the library builds and computes the same: a
    machine without AVX-512 keeps the kernels."""
    monkeypatch.setenv(stored_weights.CACHE_DIR, str(tmp_path))
    monkeypatch.setattr(stored_weights, "FLAGS", (*stored_weights.FLAGS, "-mno-avx512f"))
    library = stored_weights.library()
    assert not isinstance(library, str), library
    rng = np.random.default_rng(5)
    model = projection(E4M3, [70, 256], 40, 256, rng)           # a prefill chunk's panels, a partial last one
    stock = model.SerializeToString()
    stored_weights.rewrite(model, smallest=0)
    x = rng.standard_normal((70, 256)).astype(np.float32)
    want, got = run(stock, x), run(model.SerializeToString(), x, library)
    assert np.allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float64)


def mxfp4(rng: np.random.Generator, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A random MXFP4 weight [rows, cols]: its packed bytes (low nibble first) as the engine holds them, uint16
    [1, rows, cols / 4], its E8M0 bytes int8 [1, rows, cols / 32], and its values (float64), decoded apart."""
    packed = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
    exponents = rng.integers(120, 130, (rows, cols // 32), dtype=np.uint8)
    codes = np.stack([packed & 15, packed >> 4], axis=-1).reshape(rows, cols)
    values = E2M1[codes] * np.repeat(2.0 ** (exponents.astype(np.float64) - 127), 32, axis=1)
    return packed.view(np.uint16).reshape(1, rows, cols // 4), exponents.view(np.int8)[None], values


def test_the_experts_kernel_computes_v4s_routed_experts_from_mxfp4_bytes(kernels):
    """Mxfp4MoE against V4's definition written out in float64 from separately decoded weights: each token's
    experts with a weight above 1e-8 (a hash layer's repeated pick arrives as one weight, their sum), SwiGLU with
    its limit, the weighted sum; tokens of 1 (a decode), 5 and 40 rows (the buffered kernel)."""
    rng = np.random.default_rng(0)
    E, D, I, limit = 4, 64, 96, 1.5
    experts = [[mxfp4(rng, I, D), mxfp4(rng, I, D), mxfp4(rng, D, I)] for _ in range(E)]
    inputs, initializers = ["x", "mixing"], []
    for e, weights in enumerate(experts):
        for w, (packed, exponents, _) in zip(("w1", "w3", "w2"), weights):
            initializers += [
                helper.make_tensor(f"{w}.{e}", TensorProto.UINT16, packed.shape, packed.tobytes(), raw=True),
                helper.make_tensor(f"{w}.{e}.e8m0", TensorProto.INT8, exponents.shape, exponents.tobytes(), raw=True)]
            inputs += [f"{w}.{e}", f"{w}.{e}.e8m0"]
    node = helper.make_node("Mxfp4MoE", inputs, ["y"], domain=stored_weights.DOMAIN, swiglu_limit=limit)
    graph = helper.make_graph([node], "experts", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", D]),
                                                  helper.make_tensor_value_info("mixing", TensorProto.FLOAT, ["T", E])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23),
                                                    helper.make_opsetid(stored_weights.DOMAIN, 1)])
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(kernels))
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    for T in (1, 5, 40):
        x = rng.standard_normal((T, D)).astype(np.float32)
        mixing = np.where(rng.uniform(size=(T, E)) < 0.5, rng.uniform(0.1, 1, (T, E)), 0).astype(np.float32)
        mixing[0, 1] = 1e-9                                          # below QMoE's threshold: skipped
        want = np.zeros((T, D))
        for t in range(T):
            for e, ((_, _, w1), (_, _, w3), (_, _, w2)) in enumerate(experts):
                if mixing[t, e] > 1e-8:
                    gate, up = np.minimum(w1 @ x[t], limit), np.clip(w3 @ x[t], -limit, limit)
                    want[t] += mixing[t, e] * (w2 @ (gate / (1 + np.exp(-gate)) * up))
        got = session.run(None, {"x": x, "mixing": mixing})[0]
        assert np.allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max()), T


def qmoe_graph(exponent: int) -> ModelProto:
    """A QMoE as builder/backends/onnxruntime.py makes it over two MXFP4 experts, their packed bytes and E8M0 bytes
    as builder/weights.py names them, every E8M0 byte `exponent` (the int8 codes' widening left out: only names and
    bytes are read)."""
    rng = np.random.default_rng(0)
    initializers = []
    for base, parts in (("l.ffn.routed.fc1", 2), ("l.ffn.routed.w2", 1)):
        for part in range(parts):
            for e in range(2):
                packed, name = rng.integers(0, 2 ** 16, (1, 32, 8), dtype=np.uint16), f"{base}.{part}.{e}.fp4"
                initializers += [
                    helper.make_tensor(name, TensorProto.UINT16, packed.shape, packed.tobytes(), True),
                    helper.make_tensor(f"{name}.e8m0", TensorProto.INT8, [1, 32, 1],
                                       np.full(32, exponent, np.uint8).view(np.int8).tobytes(), True)]
    inputs = ["x", "chosen", "l.ffn.routed.fc1.codes", "l.ffn.routed.fc1.scales", "", "l.ffn.routed.w2.codes",
              "l.ffn.routed.w2.scales"] + [""] * 7 + ["mixing"]
    node = helper.make_node("QMoE", inputs, ["y"], domain="com.microsoft", k=2, swiglu_limit=7.0,
                            **stored_weights.QMOE)
    graph = helper.make_graph([node], "experts", [], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              initializers)
    return helper.make_model(graph)


@pytest.mark.parametrize("exponent, moved", [(127, True), (0, False), (255, False)])
def test_experts_move_to_the_kernel_unless_a_scale_is_e8m0s_edge(exponent, moved):
    """E8M0 0 and 255 (2^-127 and NaN) the stock path makes a subnormal and an inf: those experts stay in QMoE."""
    model = qmoe_graph(exponent)
    done = stored_weights.rewrite(model)
    assert done.projections == ({"Mxfp4MoE": 1} if moved else {})
    assert [n.op_type for n in model.graph.node] == (["Mxfp4MoE"] if moved else ["QMoE"])
    if moved:
        assert list(model.graph.node[0].input[2:8]) == ["l.ffn.routed.fc1.0.0.fp4", "l.ffn.routed.fc1.0.0.fp4.e8m0",
                                                         "l.ffn.routed.fc1.1.0.fp4", "l.ffn.routed.fc1.1.0.fp4.e8m0",
                                                         "l.ffn.routed.w2.0.0.fp4", "l.ffn.routed.w2.0.0.fp4.e8m0"]


def sinkhorn_model(rounds: int, eps: float = 1e-6) -> ModelProto:
    """One mHC Sinkhorn node as an engine's graph holds it: the plugins' op with its ONNX function (a Loop)."""
    from v4engine.plugins.common import DOMAIN, OPSET
    from v4engine.plugins.sinkhorn import NAME, sinkhorn_function

    node = helper.make_node(NAME, ["x"], ["y"], domain=DOMAIN, rounds=rounds, eps=eps)
    graph = helper.make_graph([node], "sinkhorn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(DOMAIN, 1)],
                             functions=[sinkhorn_function()])


@pytest.mark.parametrize("rounds, shape", [(19, [1, 1, 4, 4]), (19, [2, 7, 4, 4]), (19, [1, 300, 4, 4]),
                                           (0, [3, 4, 4]), (5, [2, 2, 3, 3])])
def test_mhc_sinkhorn_in_one_kernel_node_computes_what_onnx_runtimes_loop_computes(kernels, rounds, shape):
    """A decode's matrices, a verify's, a prefill chunk's (over the pool), no rounds at all, another N: the same
    divisions in the same order, so the same values up to the order of four-term sums."""
    model = sinkhorn_model(rounds)
    stock = model.SerializeToString()
    assert stored_weights.rewrite(model).projections == {"HcSinkhorn": 1}
    assert [(n.domain, n.op_type) for n in model.graph.node] == [(stored_weights.DOMAIN, "HcSinkhorn")]
    x = (np.random.default_rng(rounds).random(shape) + 0.01).astype(np.float32)
    want, got = run(stock, x), run(model.SerializeToString(), x, kernels)
    assert got.shape == want.shape and np.abs(got - want).max() < 1e-6


def table_model(folder, stored: int, rows: int, columns: int, rng: np.random.Generator):
    """An embedding as the engine graphs hold it: a [rows, columns] table in a weight file (after 100 bytes of
    something else), gathered by ids [2, 3] and, if bf16, cast to float; saved beside its file. Returns the model, its
    path and the table as float32."""
    values = rng.standard_normal((rows, columns)).astype(np.float32)
    raw = values.astype(ml_dtypes.bfloat16).view(np.uint16) if stored == BF16 else values
    (folder / "table.bin").write_bytes(bytes(100) + raw.tobytes())
    table = TensorProto(name="table", data_type=stored, dims=[rows, columns])
    table.data_location = TensorProto.EXTERNAL
    for key, value in (("location", "table.bin"), ("offset", "100"), ("length", str(raw.nbytes))):
        table.external_data.add(key=key, value=value)
    nodes = [helper.make_node("Gather", ["table", "ids"], ["rows" if stored == BF16 else "y"])]
    if stored == BF16:
        nodes.append(helper.make_node("Cast", ["rows"], ["y"], to=TensorProto.FLOAT))
    graph = helper.make_graph(nodes, "embedding", [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [table])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    (folder / "m.onnx").write_bytes(model.SerializeToString())
    return model, folder / "m.onnx", values.astype(ml_dtypes.bfloat16).astype(np.float32) if stored == BF16 else values


def opened_as_checked(path) -> dict:
    """The weight file as the engine's checks would have opened it (contract/engine_folder.py)."""
    from v4engine.contract.engine_folder import OpenedFile

    status = path.stat()
    return {path.name: OpenedFile(path, status.st_dev, status.st_ino, status.st_size)}


def rows_session(model: ModelProto, library) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(library))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("stored", [TensorProto.FLOAT, BF16])
def test_the_embeddings_rows_are_read_from_its_file_as_gather_reads_them(kernels, tmp_path, stored):
    """The table leaves the graph (nothing of it is mapped or held); the rows, a bf16 one widened, are Gather's and
    Cast's values exactly: repeated ids, the last row, ids counted from the end."""
    model, path, values = table_model(tmp_path, stored, 50, 40, np.random.default_rng(stored))
    ids = np.array([[0, 49, 7], [7, -1, -50]], np.int64)
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"ids": ids})[0]
    done = stored_weights.rewrite(model, smallest=0, opened=opened_as_checked(tmp_path / "table.bin"))
    assert done.projections == {"StoredRows": 1}
    assert [n.op_type for n in model.graph.node] == ["StoredRows"] and not model.graph.initializer
    session = rows_session(model, kernels)
    got = session.run(None, {"ids": ids})[0]
    assert got.dtype == np.float32 and np.array_equal(got, want) and np.array_equal(got, values[ids])
    with pytest.raises(Exception, match="StoredRows: an index is out of the table"):
        session.run(None, {"ids": np.array([[0, 1, 50], [0, 0, 0]], np.int64)})
    model.graph.input[0].type.tensor_type.elem_type = TensorProto.INT32        # Gather's other index type
    got = rows_session(model, kernels).run(None, {"ids": ids.astype(np.int32)})[0]
    assert np.array_equal(got, want)


def test_a_tables_file_that_is_no_longer_the_checked_one_is_not_read(kernels, tmp_path):
    """Replaced between the engine's checks and the session (another file now at the path), or cut short: the
    session is not made, and says why."""
    model, _, _ = table_model(tmp_path, BF16, 50, 40, np.random.default_rng(0))
    opened = opened_as_checked(tmp_path / "table.bin")
    stored_weights.rewrite(model, smallest=0, opened=opened)
    (tmp_path / "other.bin").write_bytes((tmp_path / "table.bin").read_bytes())
    (tmp_path / "other.bin").replace(tmp_path / "table.bin")
    with pytest.raises(Exception, match="StoredRows: .*table.bin cannot be opened, is no longer the file"):
        rows_session(model, kernels)


def also_read_by_a_transpose(model: ModelProto) -> None:        # a tied head, say
    model.graph.node.append(helper.make_node("Transpose", ["table"], ["tied"]))


def also_a_graph_output(model: ModelProto) -> None:
    model.graph.output.append(helper.make_tensor_value_info("table", TensorProto.FLOAT, None))


def with_a_length_other_than_its_dims(model: ModelProto) -> None:     # ONNX Runtime refuses it where it stays
    [length] = [e for e in model.graph.initializer[0].external_data if e.key == "length"]
    length.value = "16"


@pytest.mark.parametrize("change", [also_read_by_a_transpose, also_a_graph_output, with_a_length_other_than_its_dims])
def test_only_a_table_that_nothing_but_gathers_reads_moves(tmp_path, change):
    """A table something else reads too, or whose bytes are not its dims', stays in the graph as it is."""
    model, _, _ = table_model(tmp_path, TensorProto.FLOAT, 50, 40, np.random.default_rng(0))
    change(model)
    assert stored_weights.rewrite(model, smallest=0, opened=opened_as_checked(tmp_path / "table.bin")
                                  ).projections == {}


def test_a_graph_that_places_the_kernels_itself_is_refused():
    """Only the runtime's rewrite may put v4engine's kernels in a graph, after checking what they read: an engine
    whose graph names them (a StoredRows reading some other file, say) is refused before anything is loaded."""
    from v4engine.contract.engine_folder import EngineFormatError

    node = helper.make_node("StoredRows", ["ids"], ["y"], domain=stored_weights.DOMAIN, path="/etc/passwd")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)]).SerializeToString()
    with pytest.raises(EngineFormatError, match=r"^target.onnx: its nodes use the domain v4engine.cpu, which only "
                                                r"the runtime places; refused$"):
        stored_projections(model, graph="target.onnx")


@pytest.fixture(scope="module")
def stored_engine(tiny_engine):
    """FP8 dense weights, MXFP4 routed experts and bf16 tensors, as the releases store them."""
    return tiny_engine("flash_like", quantize="mxfp4", dtype="bfloat16")[1]


@pytest.mark.parametrize("mtp", [0, 3])
def test_an_engine_generates_the_same_tokens_on_the_kernels(stored_engine, mtp, monkeypatch):
    """Greedy tokens and acceptance equal, log-probabilities within 1e-5 of the stock kernels' (the oracle tests
    hold the kernels' engine within 1e-4 of transformers), every projection of this small engine moved."""
    monkeypatch.setattr(stored_weights, "SMALLEST", 0)
    ids = torch.randint(0, 200, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    results = [Generator.from_engine_dir(stored_engine, mtp=mtp, backend_options={"stored_weights": on}).generate(
        [ids], SamplingParams(max_new_tokens=12, ignore_eos=True, prompt_logprobs=0, logprobs=0))[0] for on in
        (False, True)]
    stock, kernels = results
    assert kernels.token_ids == stock.token_ids
    assert kernels.metrics["accepted_per_step"] == stock.metrics["accepted_per_step"]
    for a, b in ((stock.prompt_logprobs, kernels.prompt_logprobs), (stock.logprobs, kernels.logprobs)):
        assert np.abs(np.array([p.logprob for p in a]) - np.array([p.logprob for p in b])).max() < 1e-5


def test_an_engines_dense_projections_all_move_to_the_kernels(stored_engine):
    """Every FP8 and bf16 weight that only an X W^T reads is read as stored: what keeps a stored type after the
    rewrite is read otherwise (the grouped output projection's reshape, the embedding's gathered rows)."""
    from v4engine.contract.engine import EngineManifest
    from v4engine.contract.engine_folder import EngineFolder, read_graph

    manifest = EngineManifest.read(stored_engine)
    folder = EngineFolder(stored_engine)
    weights = folder.map_weights(manifest.weights)
    model = ModelProto.FromString(read_graph(folder, manifest.graphs["target"], weights))
    experts = sum(n.op_type == "QMoE" for n in model.graph.node)
    sinkhorns = sum((n.domain, n.op_type) == stored_weights.SINKHORN for n in model.graph.node)
    done = stored_weights.rewrite(model, weights.maps, smallest=0)
    assert done.projections["HcSinkhorn"] == sinkhorns > 0
    assert done.projections["E4m3MatMul"] > 0 and done.projections["Bf16MatMul"] > 0
    assert done.projections["Mxfp4MoE"] == experts > 0
    ops = {n.op_type for n in model.graph.node}
    assert "QMoE" not in ops and "Gather" not in {n.op_type for n in model.graph.node if "routed" in n.output[0]}
    readers = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    for tensor in model.graph.initializer:
        if tensor.data_type in (E4M3, BF16) and len(tensor.dims) == 2:
            (widening,) = readers[tensor.name]
            users = [n.op_type for n in readers.get(widening.output[0], [])]
            assert users and "MatMul" not in users and "Gemm" not in users and (
                "Transpose" not in users or "MatMul" not in [n.op_type for u in readers[widening.output[0]]
                                                           for n in readers.get(u.output[0], [])]), tensor.name
