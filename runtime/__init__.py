"""v4engine.runtime: loads an engine directory and generates (numpy + onnxruntime; torch only for the device
buffers of the TensorRT session)."""
from .config import V4Config
from .errors import ConfigError, V4EngineError

__all__ = ["V4Config", "ConfigError", "V4EngineError"]
