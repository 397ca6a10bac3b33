"""The backend registry (contract/backends.py): every entry is complete, and its compile record is engine.json's.

1. Each backend has a session class, a frozen compile record, a builder module with preflight, prepare_graph and
   compile_engine, and quantized formats the builder knows; `v4build --backend` offers exactly the registry.
2. Each backend's compile record, as a tiny build for that backend writes it, reads back from engine.json to the
   same record, and writing it again changes no byte.
3. engine.json is untrusted: a compile record field of the wrong type, a profile of an input the graph lacks, or
   programs out of the profiles' order is refused in one line naming the field.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from importlib import import_module
from pathlib import Path

import pytest

from v4engine.builder.build import BuildOptions, build
from v4engine.builder.cli import build_parser
from v4engine.contract.backends import BACKENDS, CompileRecord
from v4engine.contract.engine import EngineManifest
from v4engine.contract.engine_folder import EngineFormatError
from v4engine.runtime.sessions import EngineSession

pytestmark = pytest.mark.xdist_group("backends")

# What lets a backend build on a machine without its GPU compiler (a backend missing here builds with defaults)
WITHOUT_COMPILER = {"tensorrt": {"onnx_only": True}}


@pytest.fixture(scope="module")
def engines(tiny_engine, tmp_path_factory) -> Callable[[str], Path]:
    """backend -> a tiny engine (target and draft) built for it; ONNX Runtime's is the one other tests share."""
    checkpoint, onnxruntime_engine = tiny_engine("mixed")
    made: dict[str, Path] = {"onnxruntime": onnxruntime_engine}

    def make(name: str) -> Path:
        if name not in made:
            out = tmp_path_factory.mktemp("backends") / name
            build(BuildOptions(checkpoint=checkpoint, output=out, mtp=3, backend=name, progress=False,
                               backend_options=WITHOUT_COMPILER.get(name, {})))
            made[name] = out
        return made[name]

    return make


def engine_json(engine: Path) -> dict:
    return json.loads((engine / "engine.json").read_text())


def damaged(engine: Path, tmp_path: Path, change: Callable[[dict], None]) -> Path:
    """A copy of `engine` whose engine.json's build.compile went through `change`."""
    copy = Path(shutil.copytree(engine, tmp_path / "engine", symlinks=True))
    data = engine_json(copy)
    change(data["build"]["compile"])
    (copy / "engine.json").write_text(json.dumps(data))
    return copy


def refused(engine: Path) -> str:
    with pytest.raises(EngineFormatError) as failure:
        EngineManifest.read(engine)
    message = str(failure.value)
    assert "\n" not in message
    return message


# --------------------------------------------------------------------------- 1. complete entries
@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_every_backend_is_complete(name):
    backend = BACKENDS[name]
    assert backend.name == name
    assert issubclass(backend.session_class(), EngineSession)
    assert issubclass(backend.compiled, CompileRecord) and dataclasses.is_dataclass(backend.compiled)
    assert backend.compiled.__dataclass_params__.frozen
    module = import_module(backend.builder)
    assert all(callable(getattr(module, step, None)) for step in ("preflight", "prepare_graph", "compile_engine"))
    assert backend.quantized_in_place <= {"fp8_block", "mxfp4"}


def test_v4build_offers_exactly_the_registered_backends():
    [choice] = [a for a in build_parser()._actions if a.dest == "backend"]
    assert list(choice.choices) == list(BACKENDS)


# --------------------------------------------------------------------------- 2. engine.json round trip
@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_compile_record_round_trips_through_engine_json(engines, name, tmp_path):
    engine = engines(name)
    manifest = EngineManifest.read(engine)
    record = manifest.compiled
    assert type(record) is BACKENDS[name].compiled
    on_disk = engine_json(engine)["build"]["compile"]
    assert json.loads(json.dumps(record.to_dict())) == on_disk
    assert type(record).from_dict(on_disk, "engine.json", manifest.graphs) == record
    manifest.write(tmp_path)
    assert (tmp_path / "engine.json").read_text() == (engine / "engine.json").read_text()


# --------------------------------------------------------------------------- 3. untrusted records
@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_a_compile_field_of_the_wrong_type_is_refused_in_one_line_naming_it(engines, name, tmp_path):
    engine = engines(name)
    for i, field in enumerate(engine_json(engine)["build"]["compile"]):
        copy = damaged(engine, tmp_path / str(i), lambda record: record.update({field: True}))
        assert f"'build.compile.{field}'" in refused(copy)


def test_onnx_runtime_moe_activations_are_fp32_or_int8_and_nothing_else(engines, tmp_path):
    message = refused(damaged(engines("onnxruntime"), tmp_path, lambda record: record.update(moe_activations="int4")))
    assert "'build.compile.moe_activations' must be one of ('fp32', 'int8')" in message


@pytest.mark.parametrize("name", sorted(n for n, b in BACKENDS.items() if b.shape_specialized))
def test_a_profile_of_an_input_the_graph_lacks_is_refused(engines, name, tmp_path):
    def plant(record: dict) -> None:
        record["profiles"]["draft"][1]["shapes"]["secret"] = [[1], [1], [1]]

    message = refused(damaged(engines(name), tmp_path, plant))
    assert "'build.compile.profiles.draft[1].shapes.secret'" in message and "input of the graph" in message


@pytest.mark.parametrize("axis, value", [(0, 2**31 - 1), (1, 100_000)])
def test_a_profile_beyond_the_engines_own_limits_is_refused(engines, tmp_path, axis, value):
    """Static buffers (CUDA graphs, MIGraphX's pools) are sized from the profiles: they may not exceed max_batch and
    the prefill chunk engine.json records."""
    def plant(record: dict) -> None:
        record["profiles"]["target"][0]["shapes"]["input_ids"][2][axis] = value

    message = refused(damaged(engines("tensorrt"), tmp_path, plant))
    assert "'build.compile.profiles.target' profile" in message and "within the engine's limits" in message


def test_a_profile_named_twice_is_refused(engines, tmp_path):
    def plant(record: dict) -> None:
        record["profiles"]["draft"][1]["name"] = record["profiles"]["draft"][0]["name"]

    assert "must name each profile once" in refused(damaged(engines("tensorrt"), tmp_path, plant))


def test_a_profile_shape_of_another_rank_is_refused(engines, tmp_path):
    def plant(record: dict) -> None:
        record["profiles"]["target"][0]["shapes"]["input_ids"][2] = [8]

    assert "'build.compile.profiles.target[0].shapes.input_ids'" in refused(damaged(engines("tensorrt"), tmp_path,
                                                                                      plant))


def test_migraphx_programs_must_follow_the_buckets_order(engines, tmp_path):
    """One program per bucket of static shapes (contract/buckets.py) of the profiles, in their order."""
    engine = engines("migraphx")
    manifest = EngineManifest.read(engine)
    buckets = {graph: [b.name for b in manifest.compiled.buckets(graph, entry.inputs)]
               for graph, entry in manifest.graphs.items()}
    programs = {graph: [{"bucket": name, "file": f"{graph}.{name}.mxr"} for name in names]
                for graph, names in buckets.items()}
    compiled = EngineManifest.read(damaged(engine, tmp_path / "ordered", lambda r: r.update(programs=programs)))
    assert [p.file for p in compiled.compiled.programs["draft"]] == [f"draft.{n}.mxr" for n in buckets["draft"]]
    assert buckets["draft"][0] == "extend.b1" and buckets["draft"][-1].startswith("cycle.b")
    swapped = {**programs, "draft": programs["draft"][::-1]}
    message = refused(damaged(engine, tmp_path / "swapped", lambda r: r.update(programs=swapped)))
    assert "'build.compile.programs.draft[0].bucket' must be 'extend.b1'" in message
    missing = {**programs, "draft": programs["draft"][:1]}
    message = refused(damaged(engine, tmp_path / "missing", lambda r: r.update(programs=missing)))
    assert "'build.compile.programs.draft' must list one program per bucket" in message


def test_a_profile_name_that_is_not_a_word_is_refused(engines, tmp_path):
    """Profile names name a MIGraphX engine's program files (`{graph}.{bucket}.mxr`, written by
    compile_migraphx.sh on an engine folder from elsewhere): a name with a path in it is refused on reading."""
    def plant(record: dict) -> None:
        record["profiles"]["draft"][0]["name"] = "../../outside"

    message = refused(damaged(engines("migraphx"), tmp_path, plant))
    assert "'build.compile.profiles.draft[0].name' must be a word" in message


def test_migraphx_profiles_must_give_every_dynamic_input(engines, tmp_path):
    """The buckets are derived from the profiles: a profile leaving an input out is refused in one line, not met
    as a KeyError when a session opens."""
    def plant(record: dict) -> None:
        del record["profiles"]["draft"][0]["shapes"]["uniforms"]

    message = refused(damaged(engines("migraphx"), tmp_path, plant))
    assert "'build.compile.profiles'" in message and "uniforms" in message


def test_plans_for_other_graphs_are_refused(engines, tmp_path):
    plans = {"target": {"plan": "target.plan", "bytes": 1, "seconds": 0.1}}
    message = refused(damaged(engines("tensorrt"), tmp_path, lambda r: r.update(plans=plans)))
    assert "'build.compile.plans'" in message and "one entry per graph" in message
