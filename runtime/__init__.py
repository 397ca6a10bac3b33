"""v4engine.runtime: loads an engine directory and generates (numpy, onnx and onnxruntime; torch only for the
device buffers of the TensorRT session).

    from v4engine.runtime import Generator, SamplingParams
    [result] = Generator.from_engine_dir("out/engine").generate(["def fib(n):"], SamplingParams(max_new_tokens=32))
"""
from v4engine.contract.config import V4Config
from v4engine.contract.errors import ConfigError, V4EngineError

from .generator import GenerationResult, Generator
from .sampling import RequestError, SamplingParams

__all__ = ["Generator", "GenerationResult", "SamplingParams", "RequestError", "V4Config", "ConfigError",
           "V4EngineError"]
