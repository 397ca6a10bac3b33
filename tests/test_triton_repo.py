"""The rendered model repository: every config.pbtxt is a valid Triton ModelConfig, the ensemble is wired
completely and consistently (CPU and GPU variants alike), and bad input fails with one line naming the culprit,
leaving nothing behind."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from v4engine.builder.cli import main as v4build
from v4engine.contract.errors import V4EngineError
from v4engine.triton_repo import render

MODELS = ("preprocessing", "v4_generate", "postprocessing", "ensemble")
KIND = model_config_pb2.ModelInstanceGroup.Kind


def configs(repo: Path) -> dict[str, model_config_pb2.ModelConfig]:
    """Parse every config.pbtxt as Triton does (unknown fields and bad enum values are errors)."""
    parsed = {}
    for name in MODELS:
        config = text_format.Parse((repo / name / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
        assert config.name == name
        parsed[name] = config
    return parsed


@pytest.fixture(scope="module", params=[False, True], ids=["cpu", "gpu"])
def variant(request, trained_engine, tmp_path_factory) -> tuple[bool, dict[str, model_config_pb2.ModelConfig]]:
    gpu = request.param
    repo = render(trained_engine, tmp_path_factory.mktemp("repo") / "repo", gpu=gpu, max_queue_size=5)
    return gpu, configs(repo)


def test_every_model_has_its_folder_and_code(trained_engine, tmp_path):
    repo = render(trained_engine, tmp_path / "repo")
    assert sorted(p.name for p in repo.iterdir()) == sorted(MODELS)
    for name in MODELS[:3]:
        code = (repo / name / "1" / "model.py").read_text()
        assert f"from v4engine.triton_repo.models.{name} import TritonPythonModel" in code
    assert (repo / "ensemble" / "1").is_dir() and not any((repo / "ensemble" / "1").iterdir())


def test_ensemble_steps_are_fed_and_agree_on_types_and_shapes(variant):
    _, models = variant
    ensemble = models["ensemble"]
    available = {t.name: (t.data_type, list(t.dims), t.optional) for t in ensemble.input}
    for step in ensemble.ensemble_scheduling.step:
        model = models[step.model_name]
        inputs = {t.name: t for t in model.input}
        assert set(step.input_map) <= set(inputs), f"{step.model_name}: maps an input it does not have"
        for t in model.input:
            assert t.optional or t.name in step.input_map, f"{step.model_name}.{t.name} is not fed"
        for key, source in step.input_map.items():
            assert source in available, f"{step.model_name}.{key} reads {source}, which nothing produced before"
            dtype, dims, optional = available[source]
            assert (dtype, dims) == (inputs[key].data_type, list(inputs[key].dims)), f"{step.model_name}.{key}"
            # max_tokens is optional in the ensemble only so that preprocessing, which requires it, runs and names it
            assert inputs[key].optional or not optional or source == "max_tokens", \
                f"optional {source} feeds required {step.model_name}.{key}"
        outputs = {t.name: t for t in model.output}
        for key, target in step.output_map.items():
            assert target not in available, f"{target} is produced twice"
            available[target] = (outputs[key].data_type, list(outputs[key].dims), False)
    for t in ensemble.output:
        assert available.get(t.name, (None, None))[:2] == (t.data_type, list(t.dims)), f"ensemble output {t.name}"


def test_the_client_facing_contract(variant):
    _, models = variant
    inputs = {t.name: t for t in models["ensemble"].input}
    expected = ["text_input", "input_ids", "messages", "max_tokens", "stop", "temperature", "top_p", "top_k", "seed",
                "presence_penalty", "frequency_penalty", "repetition_penalty", "num_draft_tokens",
                "draft_sample_method", "cache_salt", "ignore_eos", "stream", "exclude_input_in_output"]
    assert list(inputs) == expected
    # every input is optional to Triton, whose ensemble answers nothing at all when a required one is missing;
    # preprocessing requires max_tokens and says so by name (config.MAX_TOKENS)
    assert not [n for n, t in inputs.items() if not t.optional]
    assert [t.name for t in models["preprocessing"].input if not t.optional] == ["max_tokens"]
    assert [t.name for t in models["ensemble"].output] == ["text_output", "output_ids", "finish_reason", "metrics"]
    # the cancel key (models/relay.py) stays between the steps: a client never sees one
    steps = {step.model_name: step for step in models["ensemble"].ensemble_scheduling.step}
    assert steps["v4_generate"].output_map["cancel_key"] == steps["postprocessing"].input_map["cancel_key"] \
        == "_cancel_key"


def test_generation_is_decoupled_and_requests_reach_each_step_without_a_batcher(variant):
    _, models = variant
    generate = models["v4_generate"]
    assert generate.model_transaction_policy.decoupled
    params = {k: v.string_value for k, v in generate.parameters.items()}
    assert Path(params["engine_dir"]).is_absolute() and params["max_queue_size"] == "5"   # the loop's own bound
    # Triton's dynamic batcher would drop cancelled requests before postprocessing relays them, and hold a
    # request that arrives while v4_generate's instance is busy for its 500 ms idle timeout
    assert not any(m.HasField("dynamic_batching") for m in models.values())
    assert all(m.max_batch_size == 0 for m in models.values())


def test_only_the_gpu_variant_puts_generation_on_the_gpu(variant):
    gpu, models = variant
    kinds = {name: {g.kind for g in m.instance_group} for name, m in models.items() if name != "ensemble"}
    assert kinds["v4_generate"] == {KIND.KIND_GPU if gpu else KIND.KIND_CPU}
    assert kinds["preprocessing"] == kinds["postprocessing"] == {KIND.KIND_CPU}
    assert ("providers" in models["v4_generate"].parameters) == gpu


def test_an_instance_spans_one_gpu_per_pipeline_stage(trained_engine, tmp_path):
    """--gpus: Triton places nothing (KIND_MODEL); the model puts stage i of the engine on the i-th GPU listed."""
    generate = configs(render(trained_engine, tmp_path / "repo", gpus=[1]))["v4_generate"]
    assert {g.kind for g in generate.instance_group} == {KIND.KIND_MODEL}
    assert generate.parameters["gpus"].string_value == "1" and "providers" in generate.parameters
    with pytest.raises(V4EngineError, match=r"has 1 pipeline stage\(s\), which need 1 GPU number\(s\)"):
        render(trained_engine, tmp_path / "other", gpus=[0, 1])
    assert not (tmp_path / "other").exists()


def test_the_cli_renders_and_explains_every_flag(trained_engine, tmp_path, capsys):
    assert v4build(["triton-repo", str(trained_engine), str(tmp_path / "repo"), "--gpu", "--max-batch", "4",
                    "--max-queue-size", "2", "--instance-count", "2"]) == 0
    generate = configs(tmp_path / "repo")["v4_generate"]
    assert generate.instance_group[0].count == 2 and generate.parameters["max_batch"].string_value == "4"
    with pytest.raises(SystemExit):
        v4build(["triton-repo", "--help"])
    help_text = capsys.readouterr().out
    for flag in ("--gpu", "--gpus", "--max-batch", "--max-queue-size", "--instance-count", "--confidence-scheduling",
                 "--force"):
        assert flag in help_text


@pytest.mark.parametrize("case, message", [
    ("not an engine", "engine.json: not found"),
    ("no tokenizer", "tokenizer.json"),
    ("batch too large", "max_batch must be an integer from 1 to 8"),
    ("negative queue", "max_queue_size must be an integer >= 0"),
    ("exists", "already exists"),
    ("not a repository", "is not a model repository"),
])
def test_bad_input_is_one_clear_line_and_leaves_nothing(trained_engine, tmp_path, case, message):
    engine, out, options = trained_engine, tmp_path / "repo", {}
    if case == "not an engine":
        engine = tmp_path
    elif case == "no tokenizer":
        engine = Path(shutil.copytree(trained_engine, tmp_path / "engine", symlinks=True))
        (engine / "tokenizer.json").unlink()
    elif case == "batch too large":
        options = {"max_batch": 9}
    elif case == "negative queue":
        options = {"max_queue_size": -1}
    elif case == "exists":
        render(trained_engine, out)
    elif case == "not a repository":
        out.mkdir()
        options = {"force": True}
    before = sorted(tmp_path.iterdir())
    with pytest.raises(V4EngineError, match=message) as error:
        render(engine, out, **options)
    assert "\n" not in str(error.value)
    assert sorted(tmp_path.iterdir()) == before, "no half-written repository, no temporary folder"


def test_force_replaces_a_repository(trained_engine, tmp_path):
    out = render(trained_engine, tmp_path / "repo", max_queue_size=1)
    render(trained_engine, out, max_queue_size=7, force=True)
    assert configs(out)["v4_generate"].parameters["max_queue_size"].string_value == "7"
    assert [p.name for p in tmp_path.iterdir()] == ["repo"]
