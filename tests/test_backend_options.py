"""Options that belong to their backend: each backend's record lists the build and session options it takes
(contract/backend_options.py); a generic entry point refuses, in one line, one the engine's backend does not take,
or a value of another type, instead of dropping it."""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from v4engine.builder.build import BuildError, BuildOptions, build
from v4engine.contract.backend_options import BackendOptions
from v4engine.contract.backends import BACKENDS
from v4engine.runtime.budget import Limits
from v4engine.runtime.generator import Generator
from v4engine.runtime.sampling import RequestError


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_every_backend_record_names_its_options_and_artifacts(name):
    backend = BACKENDS[name]
    for options in (backend.build_options, backend.session_options):
        assert issubclass(options, BackendOptions) and dataclasses.is_dataclass(options)
        assert options() == options.read({}, name, ValueError), "every option has a default"
    assert all(a.startswith("*.") or "/" not in a for a in backend.artifacts)


def test_an_option_the_engines_backend_does_not_take_is_refused_in_one_line(tiny_engine):
    _, engine = tiny_engine("mixed")
    with pytest.raises(RequestError, match=r"^option 'builder_optimization_level' is not one onnxruntime engines "
                                           r"take \(their session options: providers, threads, device_pools, "
                                           r"cuda_graphs, runtime_widening, stored_weights\)$"):
        Generator.from_engine_dir(engine, backend_options={"builder_optimization_level": 3})
    with pytest.raises(RequestError, match=r"^onnxruntime session option 'threads' must be an integer >= 0 or None "
                                           r"\(got '2'\)$"):
        Generator.from_engine_dir(engine, backend_options={"threads": "2"})
    with pytest.raises(RequestError, match="max_cache_bytes must be a positive integer"):
        Generator.from_engine_dir(engine, limits=Limits(max_cache_bytes="1000000"))
    options = Generator.from_engine_dir(engine, backend_options={"threads": 1, "device_pools": False})
    assert options.scheduler.target_session.pool_device is None


def test_a_tensorrt_engine_refuses_onnxruntime_options_before_anything_opens(tiny_engine, tmp_path):
    """TensorRT engines built --cuda-graphs always replay them: `cuda_graphs=False` is an error, not a silence. The
    options are read before any session is made (this machine has no TensorRT)."""
    checkpoint, _ = tiny_engine("mixed")
    build(BuildOptions(checkpoint=checkpoint, output=tmp_path / "trt", mtp=3, backend="tensorrt", dtype="fp32",
                       backend_options={"onnx_only": True}, progress=False))
    with pytest.raises(RequestError, match=r"^option 'cuda_graphs' is not one tensorrt engines take \(their session "
                                           r"options: none\)$"):
        Generator.from_engine_dir(tmp_path / "trt", backend_options={"cuda_graphs": False})


def test_a_build_option_of_another_backend_is_refused_and_nothing_is_written(tiny_engine, tmp_path):
    checkpoint, _ = tiny_engine("mixed")
    with pytest.raises(BuildError, match=r"^option 'onnx_only' is not one onnxruntime engines take \(their build "
                                         r"options: device, cuda_graphs, int8_moe_activations\)$"):
        build(BuildOptions(checkpoint=checkpoint, output=tmp_path / "out", backend_options={"onnx_only": True}))
    assert not (tmp_path / "out").exists()
    run = subprocess.run([sys.executable, "-m", "v4engine.builder.cli", "--checkpoint", str(checkpoint), "--output",
                          str(tmp_path / "out"), "--timing-cache", str(tmp_path / "cache")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 1 and run.stderr.strip().count("\n") == 0
    assert "option 'timing_cache' is not one onnxruntime engines take" in run.stderr
    assert not (tmp_path / "out").exists()
