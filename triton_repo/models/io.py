"""Reading requests and writing responses: what the three Python models share."""
from __future__ import annotations

import json
from collections.abc import Callable

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


def scalar(request, name: str, required: bool = False):
    """A one-value input as a Python value; None when absent, unless `required`."""
    values = array(request, name)
    if values is None:
        if required:
            raise RequestError(f"{name} is required")
        return None
    if values.size != 1:
        raise RequestError(f"{name} must hold one value (got {values.size})")
    return decode(name, values[0]) if isinstance(values[0], bytes) else values[0].item()


def strings(request, name: str) -> list[str]:
    """A list of UTF-8 strings; [] when absent."""
    values = array(request, name)
    return [] if values is None else [decode(name, value) for value in values]


def decode(name: str, value: bytes) -> str:
    """The text of one STRING element; bytes that are not UTF-8 are refused with the offending position."""
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(f"{name} is not valid UTF-8 (byte {value[e.start]:#04x} at offset {e.start})") from None


def tensor(name: str, values, dtype) -> "pb_utils.Tensor":
    return pb_utils.Tensor(name, np.asarray(values, dtype=dtype).reshape(-1))


def text(name: str, value: str) -> "pb_utils.Tensor":
    return pb_utils.Tensor(name, np.array([value.encode("utf-8")], dtype=np.object_))


def error(message: str) -> "pb_utils.InferenceResponse":
    """An error response; its message is one line whatever the exception said."""
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(" ".join(message.split())))


def failure(model: str, e: Exception) -> "pb_utils.InferenceResponse":
    """The answer to a request that failed: a RequestError says what the client got wrong, anything else is
    logged and named (never a traceback, which would only tell a client about our code)."""
    if isinstance(e, RequestError):
        return error(str(e))
    pb_utils.Logger.log_error(f"{model}: {type(e).__name__}: {e}")
    return error(f"{model} failed: {type(e).__name__}: {e}")


def answer_each(model: str, requests: list, answer: Callable) -> list:
    """One response per request from `answer(request)`, a failure() where it raises."""
    responses = []
    for request in requests:
        try:
            responses.append(answer(request))
        except Exception as e:                   # noqa: BLE001 - the client must hear of it, and the others go on
            responses.append(failure(model, e))
    return responses
