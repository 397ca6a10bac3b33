"""Reading requests and writing responses: what the three Python models share."""
from __future__ import annotations

import json

import numpy as np
import triton_python_backend_utils as pb_utils

from v4engine.runtime.sampling import RequestError


def parameters(args: dict) -> dict[str, str]:
    """The `parameters` of the model's config.pbtxt (render() writes them)."""
    config = json.loads(args["model_config"])
    return {key: value["string_value"] for key, value in config.get("parameters", {}).items()}


def array(request, name: str) -> np.ndarray | None:
    """The input as a flat array, or None when the client left it out."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy().reshape(-1)


def scalar(request, name: str):
    """A one-value input as a Python value, or None when absent."""
    values = array(request, name)
    if values is None:
        return None
    if values.size != 1:
        raise RequestError(f"{name} must hold one value (got {values.size})")
    value = values[0]
    return value.decode() if isinstance(value, bytes) else value.item()


def strings(request, name: str) -> list[str]:
    """A list of UTF-8 strings (bytes that are not UTF-8 are refused with the offending position)."""
    values = array(request, name)
    out = []
    for value in [] if values is None else values:
        try:
            out.append(value.decode("utf-8") if isinstance(value, bytes) else str(value))
        except UnicodeDecodeError as e:
            raise RequestError(f"{name} is not valid UTF-8 (byte {value[e.start]:#04x} at offset {e.start})") from None
    return out


def tensor(name: str, values, dtype) -> "pb_utils.Tensor":
    return pb_utils.Tensor(name, np.asarray(values, dtype=dtype).reshape(-1))


def text(name: str, value: str) -> "pb_utils.Tensor":
    return pb_utils.Tensor(name, np.array([value.encode("utf-8")], dtype=np.object_))


def error(message: str) -> "pb_utils.InferenceResponse":
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message))
