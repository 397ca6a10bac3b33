"""An engine folder cannot make the runtime read outside itself.

Every path engine.json or a graph names must stay inside the engine folder, or be the very checkpoint file a
weights link recorded at build time (same path, same safetensors header). Each attack below is refused in one
line before the file it aims at is opened, and nothing outside the engine folder changes."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import onnx
import pytest

from hostile import assert_never_shown, assert_one_line, files_opened, snapshot, v4generate
from v4engine.contract.engine import EngineFormatError
from v4engine.runtime.generator import Generator


@pytest.fixture
def engine(engine_copy) -> Path:
    return engine_copy


def manifest(engine: Path) -> dict:
    return json.loads((engine / "engine.json").read_text())


def rewrite(engine: Path, change: Callable[[dict], None]) -> None:
    data = manifest(engine)
    change(data)
    (engine / "engine.json").write_text(json.dumps(data))


def first_weight(engine: Path) -> Path:
    return engine / manifest(engine)["weights"]["files"][0]["file"]


def retarget_graph(engine: Path, location: str, offset: int | None = None) -> None:
    """Point the first external initializer of target.onnx at `location` (and `offset`)."""
    graph = onnx.load(engine / "target.onnx", load_external_data=False)
    tensor = next(t for t in graph.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL)
    for entry in tensor.external_data:
        if entry.key == "location":
            entry.value = location
        if entry.key == "offset" and offset is not None:
            entry.value = str(offset)
    onnx.save(graph, engine / "target.onnx")


def external(name: str, data_type: int, length: int, location: str) -> onnx.TensorProto:
    """A 16-byte tensor (`length` values) whose bytes are the first 16 of `location`."""
    tensor = onnx.TensorProto(name=name, data_type=data_type, dims=[length], data_location=onnx.TensorProto.EXTERNAL)
    for key, value in (("location", location), ("offset", "0"), ("length", "16")):
        tensor.external_data.add(key=key, value=value)
    return tensor


def weight_links_to_the_secret(engine, secret):
    target = first_weight(engine)
    target.unlink()
    target.symlink_to(secret)


def weight_links_to_the_secret_and_engine_json_says_so(engine, secret):
    weight_links_to_the_secret(engine, secret)
    def claim(data):
        data["weights"]["files"][0].update(link="symlink", source=str(secret), bytes=secret.stat().st_size,
                                           header_sha256=hashlib.sha256(b"").hexdigest())
    rewrite(engine, claim)


def weight_links_to_another_safetensors_file(engine, secret):
    other = secret.parent / "other.safetensors"
    shutil.copy(engine / manifest(engine)["weights"]["files"][1]["file"], other)
    weight_links_to_the_secret(engine, other)
    rewrite(engine, lambda d: d["weights"]["files"][0].update(link="symlink", source=str(other),
                                                               bytes=other.stat().st_size))


def weights_entry_climbs_out(engine, secret):
    rewrite(engine, lambda d: d["weights"]["files"][0].update(file=f"weights/../../outside/{secret.name}"))


def weights_entry_is_absolute(engine, secret):
    rewrite(engine, lambda d: d["weights"]["files"][0].update(file=str(secret)))


def graph_reads_a_file_outside(engine, secret):
    retarget_graph(engine, f"../outside/{secret.name}")


def graph_reads_an_absolute_path(engine, secret):
    retarget_graph(engine, str(secret))


def graph_reads_a_weight_file_past_its_end(engine, secret):
    data = manifest(engine)["weights"]["files"][0]
    retarget_graph(engine, data["file"], offset=data["bytes"] - 4)


def graph_reads_a_safetensors_header(engine, secret):
    retarget_graph(engine, manifest(engine)["weights"]["files"][0]["file"], offset=0)


def constant_node_reads_a_file_outside(engine, secret):
    graph = onnx.load(engine / "target.onnx", load_external_data=False)
    value = external("stolen", onnx.TensorProto.UINT8, 16, f"../outside/{secret.name}")
    graph.graph.node.insert(0, onnx.helper.make_node("Constant", [], ["stolen"], value=value))
    onnx.save(graph, engine / "target.onnx")


def graph_places_the_row_kernel_on_a_file_outside(engine, secret):
    """v4engine's own kernel for the embedding reads rows from a file by path: only the runtime may place it."""
    graph = onnx.load(engine / "target.onnx", load_external_data=False)
    ids = graph.graph.input[0].name
    graph.graph.node.insert(0, onnx.helper.make_node(
        "StoredRows", [ids], ["stolen"], domain="v4engine.cpu", path=str(secret), device=0, inode=0, file_bytes=16,
        offset=0, rows=1, columns=4, type=onnx.TensorProto.FLOAT))
    onnx.save(graph, engine / "target.onnx")


def graph_file_climbs_out(engine, secret):
    shutil.copy(engine / "target.onnx", secret.parent / "target.onnx")
    rewrite(engine, lambda d: d["graphs"]["target"].update(file="../outside/target.onnx"))


def graph_is_a_symlink_out(engine, secret):
    (engine / "target.onnx").unlink()
    (engine / "target.onnx").symlink_to(secret)


def manifest_is_a_symlink_out(engine, secret):
    shutil.copy(engine / "engine.json", secret.parent / "engine.json")
    (engine / "engine.json").unlink()
    (engine / "engine.json").symlink_to(secret.parent / "engine.json")


def tokenizer_is_a_symlink_out(engine, secret):
    (engine / "tokenizer.json").unlink()
    (engine / "tokenizer.json").symlink_to(secret)


def weight_is_a_fifo(engine, secret):
    target = first_weight(engine)
    target.unlink()
    os.mkfifo(target)


ATTACKS = {
    weight_links_to_the_secret: "leads outside the engine folder",
    weight_links_to_the_secret_and_engine_json_says_so: "which is not a checkpoint file",
    weight_links_to_another_safetensors_file: "not the one the build linked",
    weights_entry_climbs_out: "not a normal path inside the engine folder",
    weights_entry_is_absolute: "not a normal path inside the engine folder",
    graph_reads_a_file_outside: "which is not a weight file of engine.json",
    graph_reads_an_absolute_path: "which is not a weight file of engine.json",
    graph_reads_a_weight_file_past_its_end: "outside its data",
    graph_reads_a_safetensors_header: "outside its data",
    constant_node_reads_a_file_outside: "outside the main graph's initializers",
    graph_places_the_row_kernel_on_a_file_outside: "use the domain v4engine.cpu, which only the runtime places",
    graph_file_climbs_out: "not a normal path inside the engine folder",
    graph_is_a_symlink_out: "leads outside the engine folder",
    manifest_is_a_symlink_out: "leads outside the engine folder",
    tokenizer_is_a_symlink_out: "leads outside the engine folder",
    weight_is_a_fifo: "not a regular file",
}


@pytest.mark.parametrize("attack", ATTACKS, ids=lambda f: f.__name__)
def test_the_runtime_refuses_before_reading_outside(engine, secret, attack):
    attack(engine, secret)
    outside = snapshot(secret.parent)
    with files_opened() as opened, pytest.raises(EngineFormatError, match=ATTACKS[attack]) as refused:
        Generator.from_engine_dir(engine)
    assert "\n" not in str(refused.value)
    assert not [p for p in opened if Path(p).name == secret.name], opened
    if attack is not weight_links_to_another_safetensors_file:   # whose header is read: that is the check
        assert not [p for p in opened if Path(p).resolve().is_relative_to(secret.parent.resolve())], opened
    assert snapshot(secret.parent) == outside


@pytest.mark.parametrize("attack", [weight_links_to_the_secret_and_engine_json_says_so, graph_reads_a_file_outside,
                                    tokenizer_is_a_symlink_out], ids=lambda f: f.__name__)
def test_v4generate_answers_in_one_line_and_shows_nothing_of_the_file(engine, secret, attack):
    attack(engine, secret)
    result = v4generate(engine, "--prompt-ids", "3,4,5", "--max-new-tokens", "4", timeout=120)
    assert_one_line(result, ATTACKS[attack])
    assert_never_shown(result)


def test_the_checkpoint_file_a_build_linked_is_still_read_through_its_symlink(engine, tiny_engine):
    """The legitimate case the rules allow: weights/ links to the checkpoint file the build recorded."""
    data = manifest(engine)
    first = data["weights"]["files"][0]
    source = Path(first["source"])
    (engine / first["file"]).unlink()
    (engine / first["file"]).symlink_to(source)
    first["link"] = "symlink"
    (engine / "engine.json").write_text(json.dumps(data))
    ids = [3, 4, 5, 6]
    assert (Generator.from_engine_dir(engine).generate([ids])[0].token_ids
            == Generator.from_engine_dir(tiny_engine("mixed")[1]).generate([ids])[0].token_ids)


def subgraph_initializer_reads_a_file(engine, secret):
    """ONNX Runtime serves only the main graph's initializers from memory: one in an If branch it would open."""
    graph = onnx.load(engine / "target.onnx", load_external_data=False)
    stolen = external("stolen", onnx.TensorProto.UINT8, 16, manifest(engine)["weights"]["files"][0]["file"])
    branch = onnx.helper.make_graph([onnx.helper.make_node("Identity", ["stolen"], ["taken"])], "branch", [],
                                    [onnx.helper.make_tensor_value_info("taken", onnx.TensorProto.UINT8, [16])],
                                    initializer=[stolen])
    condition = onnx.helper.make_tensor("always", onnx.TensorProto.BOOL, [], [True])
    graph.graph.node.insert(0, onnx.helper.make_node("Constant", [], ["always"], value=condition))
    graph.graph.node.insert(1, onnx.helper.make_node("If", ["always"], ["taken_out"], then_branch=branch,
                                                     else_branch=branch))
    onnx.save(graph, engine / "target.onnx")


def sparse_initializer_reads_a_file(engine, secret):
    graph = onnx.load(engine / "target.onnx", load_external_data=False)
    values = external("sparse", onnx.TensorProto.FLOAT, 4, f"../outside/{secret.name}")
    indices = onnx.helper.make_tensor("sparse_indices", onnx.TensorProto.INT64, [4], [0, 1, 2, 3])
    graph.graph.sparse_initializer.append(onnx.helper.make_sparse_tensor(values, indices, [8]))
    onnx.save(graph, engine / "target.onnx")


def weights_entry_is_spelled_another_way(engine, secret):
    rewrite(engine, lambda d: d["weights"]["files"][0].update(file=d["weights"]["files"][0]["file"].replace("/", "/./")))


MORE_ATTACKS = {
    subgraph_initializer_reads_a_file: "outside the main graph's initializers",
    sparse_initializer_reads_a_file: "outside the main graph's initializers",
    weights_entry_is_spelled_another_way: "not a normal path inside the engine folder",
}


@pytest.mark.parametrize("attack", MORE_ATTACKS, ids=lambda f: f.__name__)
def test_external_data_only_where_onnx_runtime_takes_it_from_memory(engine, secret, attack, tmp_path, monkeypatch):
    """Run from a folder holding a planted copy of each location: ONNX Runtime, given the graph as bytes, would
    resolve what it opens itself against the working directory."""
    monkeypatch.chdir(secret.parent)
    (secret.parent / "weights").mkdir()
    for w in manifest(engine)["weights"]["files"]:
        (secret.parent / w["file"]).write_bytes(b"\xff" * w["bytes"])
    attack(engine, secret)
    with pytest.raises(EngineFormatError, match=MORE_ATTACKS[attack]):
        Generator.from_engine_dir(engine)
