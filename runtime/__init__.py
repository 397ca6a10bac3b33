"""v4engine.runtime: loads an engine directory and generates (numpy, onnx and onnxruntime; torch only where caches
live on a device: runtime/pool_arrays.py and the sessions).

    from v4engine.runtime import Generator, SamplingParams
    [result] = Generator.from_engine_dir("out/engine").generate(["def fib(n):"], SamplingParams(max_new_tokens=32))
"""
from v4engine.contract.config import V4Config
from v4engine.contract.errors import ConfigError, V4EngineError

from .budget import Limits
from .generator import GenerationResult, Generator
from .sampling import RequestError, SamplingParams

__all__ = ["Generator", "GenerationResult", "Limits", "SamplingParams", "RequestError", "V4Config", "ConfigError",
           "V4EngineError"]
