"""Weights widened by the runtime at load (runtime/sessions/widening.py): the same bits as ONNX Runtime's constant
folding makes, only the weights ONNX Runtime's GEMMs pack left for it to fold, and no widening larger than a stored
format allows."""
import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from v4engine.contract.engine import EngineManifest
from v4engine.contract.engine_folder import EngineFolder, EngineFormatError, MappedWeights, read_graph
from v4engine.runtime.generator import Generator
from v4engine.runtime.sampling import SamplingParams
from v4engine.runtime.sessions.onnxruntime import session_options
from v4engine.runtime.sessions.widening import LOCATION, PACKED, widen_weights


@pytest.fixture(scope="module")
def stored_engine(tiny_engine):
    """FP8 dense weights, MXFP4 routed experts and bf16 tensors, as the releases store them."""
    return tiny_engine("flash_like", quantize="mxfp4", dtype="bfloat16")[1]


def generated(engine, widening: bool, mtp: int):
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(7)).tolist()
    [result] = Generator.from_engine_dir(engine, mtp=mtp, backend_options={"runtime_widening": widening}).generate(
        [ids], SamplingParams(max_new_tokens=12, ignore_eos=True, prompt_logprobs=0, logprobs=0))
    return result


@pytest.mark.parametrize("mtp", [0, 3])
def test_weights_widened_by_the_runtime_generate_the_bits_onnx_runtimes_folding_does(stored_engine, mtp):
    folded, widened = (generated(stored_engine, widening, mtp) for widening in (False, True))
    assert widened.token_ids == folded.token_ids
    assert widened.metrics["accepted_per_step"] == folded.metrics["accepted_per_step"]
    assert [p.logprob for p in widened.prompt_logprobs] == [p.logprob for p in folded.prompt_logprobs]
    assert [p.logprob for p in widened.logprobs] == [p.logprob for p in folded.logprobs]


def test_onnx_runtime_folds_only_the_weights_its_gemms_pack(stored_engine):
    """The routed experts (QMoE's codes and scales) are widened by the runtime; what reads a weight file and still
    folds in ONNX Runtime is read by MatMul or Gemm alone, which pack it (widening.PACKED)."""
    manifest = EngineManifest.read(stored_engine)
    folder = EngineFolder(stored_engine)
    for graph, entry in manifest.graphs.items():
        weights = folder.map_weights(manifest.weights)
        widened = widen_weights(read_graph(folder, entry, weights), weights,
                                lambda files: session_options(files, 1, False, False))
        model = onnx.ModelProto.FromString(widened.model)
        initializers = {t.name: t for t in model.graph.initializer}
        made = {n for n, t in initializers.items() if t.external_data and t.external_data[0].value.startswith(LOCATION)}
        experts = [n for n in model.graph.node if n.op_type == "QMoE"]
        assert experts and widened.buffers, graph
        for node in experts:
            assert all(name in made for name in node.input[2:] if name in initializers or name.endswith(".codes"))
        constant = set(initializers)
        stored = {n for n, t in initializers.items() if t.external_data} - made     # read from the weight files
        for node in model.graph.node:
            if set(node.input) - {""} <= constant and node.domain in ("", "ai.onnx"):
                constant.update(node.output)
                if stored.intersection(node.input):
                    stored.update(node.output)
        for node in model.graph.node:
            if not set(node.output) <= constant:
                folded = [i for i in node.input if i in stored and i not in initializers]
                assert not folded or node.op_type in PACKED, (graph, node.op_type, folded)


def test_a_graph_that_widens_a_weight_more_than_any_format_does_is_refused(tmp_path):
    """A hostile engine could make a few stored bytes into gigabytes at load: widened weights may take at most
    eight times what they read (MXFP4 to float32), checked before the buffer is allocated."""
    stored = np.arange(64, dtype=np.uint8)
    weight = TensorProto(name="w", data_type=TensorProto.UINT8, dims=[64], data_location=TensorProto.EXTERNAL)
    for key, value in (("location", "w.bin"), ("offset", "0"), ("length", "64")):
        entry = weight.external_data.add()
        entry.key, entry.value = key, value
    shape = helper.make_tensor("shape", TensorProto.INT64, [2], [1000, 64])
    graph = helper.make_graph(
        [helper.make_node("Cast", ["w"], ["wide"], to=TensorProto.FLOAT),
         helper.make_node("Expand", ["wide", "shape"], ["huge"]),
         helper.make_node("Add", ["x", "huge"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1000, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1000, 64])], [weight, shape])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]).SerializeToString()
    weights = MappedWeights({"w.bin": stored}, {}, {})
    with pytest.raises(EngineFormatError, match=r"^hostile.onnx: its weight 'huge' widens to more than 8 times the "
                                                 r"bytes it is made from, which no stored format does; refused$"):
        widen_weights(model, weights, lambda files: session_options(files, 1, False, False), "hostile.onnx")
    graph.node[1].input[1] = "row"              # 64 floats from 64 bytes: 4x, as FP8 to float32
    graph.initializer.append(helper.make_tensor("row", TensorProto.INT64, [2], [1, 64]))
    graph.input[0].CopyFrom(helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64]))
    graph.output[0].CopyFrom(helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64]))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]).SerializeToString()
    widened = widen_weights(model, weights, lambda files: session_options(files, 1, False, False))
    [buffer] = widened.buffers.values()
    np.testing.assert_array_equal(buffer.view(np.float32), stored)
    assert [n.op_type for n in onnx.ModelProto.FromString(widened.model).graph.node] == ["Add"]
