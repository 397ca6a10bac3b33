"""A real Triton server (the tritonserver 2.51 that nvidia-pytriton bundles, started from `.venv-triton`) serving
the repository rendered from the trained tiny engine: its answers are exactly the runtime's, streamed in several
pieces, batched when concurrent, cancellable, measured, and it refuses bad requests clearly and keeps serving."""
from __future__ import annotations

import http.client
import json
import os
import queue
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from v4engine.chat.encoding import encode_messages
from v4engine.runtime.generator import Generator
from v4engine.runtime.sampling import SamplingParams
from v4engine.triton_repo import render
from v4engine.triton_repo.server import TritonServer

ENV = Path(os.environ.get("V4ENGINE_TRITON_ENV", Path(__file__).resolve().parent.parent / ".venv-triton"))
MAX_BATCH, MAX_QUEUE = 8, 4
PROMPT = "def fibonacci(n):"
PROMPTS = [PROMPT, "import os\nimport sys", "class Stack:", "for i in range(10):", "# Read the file",
           "def main():", "x = [", "while True:"]
pytestmark = pytest.mark.xdist_group("triton-server")   # one server per session with `pytest --dist loadgroup`


@pytest.fixture(scope="module")
def server(trained_engine, tmp_path_factory):
    if not (ENV / "bin" / "python").is_file():
        pytest.fail(f"{ENV}: no serving environment; `make triton-env` makes it (`make test` does)")
    work = tmp_path_factory.mktemp("triton")
    repo = render(trained_engine, work / "repo", max_batch=MAX_BATCH, max_queue_size=MAX_QUEUE)
    with TritonServer(repo, ENV, work_dir=work / "server") as running:
        yield running


@pytest.fixture(scope="module")
def runtime(trained_engine) -> Generator:
    return Generator.from_engine_dir(trained_engine)


def expected(runtime: Generator, prompt: str, **settings) -> tuple[str, list[int]]:
    [result] = runtime.generate([prompt], SamplingParams(**settings))
    return result.text, result.token_ids


# ---------------------------------------------------------------------- clients
def generate(server, body: dict, model: str = "ensemble") -> dict:
    """POST /generate; an error answer comes back as {"error": ...} with its HTTP status."""
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/{model}/generate", json.dumps(body).encode())
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return json.loads(answer.read())
    except urllib.error.HTTPError as e:
        return {**json.loads(e.read()), "status": e.code}


def generate_stream(server, body: dict) -> list[dict]:
    """POST /generate_stream; the server-sent events' JSON chunks."""
    connection = http.client.HTTPConnection(server.http_url, timeout=60)
    connection.request("POST", "/v2/models/ensemble/generate_stream", json.dumps({**body, "stream": True}))
    lines = connection.getresponse().read().decode().splitlines()
    return [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ")]


def tensors(prompt: str | bytes | list[int], max_tokens: int, **settings) -> list[grpcclient.InferInput]:
    def tensor(name, values, dtype):
        t = grpcclient.InferInput(name, [len(values)], dtype)
        t.set_data_from_numpy(np.array(values, dtype=object if dtype == "BYTES" else None))
        return t

    if isinstance(prompt, list):
        inputs = [tensor("input_ids", np.array(prompt, np.int32), "INT32")]
    else:
        inputs = [tensor("text_input", [prompt.encode() if isinstance(prompt, str) else prompt], "BYTES")]
    inputs.append(tensor("max_tokens", np.array([max_tokens], np.int32), "INT32"))
    types = {"stream": ("BOOL", bool), "ignore_eos": ("BOOL", bool), "num_draft_tokens": ("INT32", np.int32)}
    for name, value in settings.items():
        dtype, numpy = types[name]
        inputs.append(tensor(name, np.array([value], numpy), dtype))
    return inputs


def grpc_stream(server, requests: list[list[grpcclient.InferInput]], cancel_after: float | None = None
                ) -> tuple[dict[str, list], list[Exception]]:
    """Send requests on one gRPC stream and read until each is final: (responses by request id, errors).

    An error reaches the callback without its request's id, so errors are only counted."""
    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    for i, inputs in enumerate(requests):
        client.async_stream_infer("ensemble", inputs, request_id=str(i), enable_empty_final_response=True)
    if cancel_after is not None:                     # cancel while the first request is generating
        answers.get(timeout=120)
        time.sleep(cancel_after)
        client.stop_stream(cancel_requests=True)
        return {}, []
    responses: dict[str, list] = {str(i): [] for i in range(len(requests))}
    errors, finished = [], 0
    while finished < len(requests):
        result, error = answers.get(timeout=120)
        if error is not None:
            errors.append(error)
            finished += 1
            continue
        response = result.get_response()
        if response.outputs:
            responses[response.id].append(result)
        finished += response.parameters["triton_final_response"].bool_param
    client.stop_stream()
    return responses, errors


def token_ids(responses: list) -> list[int]:
    return [t for r in responses for t in r.as_numpy("output_ids").tolist()]


def metric(server, name: str) -> float:
    for line in urllib.request.urlopen(server.metrics_url, timeout=10).read().decode().splitlines():
        if line.startswith(name + "{"):
            return float(line.split()[-1])
    raise AssertionError(f"no {name} on the metrics port")


def wait_for(condition, what: str | Callable[[], str], timeout: float = 30.0) -> None:
    """Poll `condition` until it holds; after `timeout` fail, saying `what` (called then, if it is a function: a
    message that shows what was left)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout:.0f} s for {what() if callable(what) else what}"
        time.sleep(0.1)


# ---------------------------------------------------------------------- what clients get
def test_every_model_is_ready(server):
    client = httpclient.InferenceServerClient(server.http_url)
    assert client.is_server_ready()
    assert all(client.is_model_ready(m) for m in ("preprocessing", "v4_generate", "postprocessing", "ensemble"))


def test_generate_returns_the_runtime_text(server, runtime):
    text, ids = expected(runtime, PROMPT, max_new_tokens=24)
    answer = generate(server, {"text_input": PROMPT, "max_tokens": 24})
    assert answer["text_output"] == text and answer["output_ids"] == ids
    metrics = json.loads(answer["metrics"])
    assert answer["finish_reason"] == "length" and metrics["generated_tokens"] == 24
    assert len(metrics["per_position_acceptance"]) == 3 and metrics["time_to_first_token"] > 0


def test_messages_go_through_v4s_chat_encoding_as_v4serve_encodes_them(server, runtime):
    chat = {"messages": [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def f("}],
            "thinking": True, "reasoning_effort": "high"}
    prompt = encode_messages(chat["messages"], thinking=True, reasoning_effort="high")
    text, ids = expected(runtime, prompt, max_new_tokens=12)
    answer = generate(server, {"messages": json.dumps(chat), "max_tokens": 12})
    assert answer["text_output"] == text and answer["output_ids"] == ids
    refused = generate(server, {"messages": json.dumps([{"role": "wizard"}]), "max_tokens": 4})
    assert refused["status"] == 400 and "messages[0].role must be one of" in refused["error"]


def test_the_prefix_cache_is_no_oracle_on_other_clients_prompts(server):
    """Responses carry no hit count (only the Prometheus total does), and a cache_salt keys the prefix cache: a
    prompt sent under one salt is found again under that salt only."""
    secret = "# tenant a's own prompt, which no other test sends\n" * 4
    hits = lambda: metric(server, "v4_prefix_hit_tokens_total")                        # noqa: E731
    first = generate(server, {"text_input": secret, "max_tokens": 2, "cache_salt": "tenant-a"})
    assert "prefix_hit_tokens" not in json.loads(first["metrics"])
    before = hits()
    generate(server, {"text_input": secret, "max_tokens": 2, "cache_salt": "tenant-b"})
    generate(server, {"text_input": secret, "max_tokens": 2})
    assert hits() == before, "another salt, or none, finds nothing of tenant-a's"
    generate(server, {"text_input": secret, "max_tokens": 2, "cache_salt": "tenant-a"})
    wait_for(lambda: hits() > before, what="the same salt to find its own prompt again")


def test_sampling_settings_reach_the_runtime(server, runtime):
    settings = {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "seed": 7}
    text, _ = expected(runtime, PROMPT, max_new_tokens=20, **settings)
    assert generate(server, {"text_input": PROMPT, "max_tokens": 20, **settings})["text_output"] == text
    penalties = {"presence_penalty": 1.5, "frequency_penalty": 0.25, "repetition_penalty": 1.25}   # exact in fp32
    text, _ = expected(runtime, PROMPT, max_new_tokens=20, **penalties)
    assert text != expected(runtime, PROMPT, max_new_tokens=20)[0]
    assert generate(server, {"text_input": PROMPT, "max_tokens": 20, **penalties})["text_output"] == text


def test_generate_stream_pieces_join_to_the_runtime_text(server, runtime):
    text, ids = expected(runtime, PROMPT, max_new_tokens=24)
    chunks = generate_stream(server, {"text_input": PROMPT, "max_tokens": 24})
    assert len(chunks) > 1 and "".join(c["text_output"] for c in chunks) == text
    assert [t for c in chunks for t in np.atleast_1d(c["output_ids"]).tolist()] == ids
    assert chunks[-1]["finish_reason"] == "length" and json.loads(chunks[-1]["metrics"])["generated_tokens"] == 24


def test_grpc_stream_tokens_are_the_runtime_tokens(server, runtime):
    _, ids = expected(runtime, PROMPT, max_new_tokens=24)
    responses, errors = grpc_stream(server, [tensors(PROMPT, 24, stream=True)])
    assert not errors and len(responses["0"]) > 1 and token_ids(responses["0"]) == ids


def test_stop_strings_end_the_text_where_they_begin(server, runtime):
    free, _ = expected(runtime, PROMPT, max_new_tokens=24)
    stop = free[len(free) // 2: len(free) // 2 + 3]
    text, ids = expected(runtime, PROMPT, max_new_tokens=24, stop=(stop,))
    answer = generate(server, {"text_input": PROMPT, "max_tokens": 24, "stop": [stop, "never appears"]})
    assert answer["text_output"] == text == free[:free.index(stop)] and answer["finish_reason"] == "stop"
    chunks = generate_stream(server, {"text_input": PROMPT, "max_tokens": 24, "stop": stop})
    assert "".join(c["text_output"] for c in chunks) == text


def test_input_ids_fewer_drafts_and_the_prompt_in_the_output(server, runtime):
    text, ids = expected(runtime, PROMPT, max_new_tokens=16)
    prompt_ids = runtime.encode(PROMPT)
    answer = generate(server, {"input_ids": prompt_ids, "max_tokens": 16, "num_draft_tokens": 1,
                               "exclude_input_in_output": False})
    assert answer["output_ids"] == prompt_ids + ids and answer["text_output"] == PROMPT + text
    assert len(json.loads(answer["metrics"])["per_position_acceptance"]) == 1


# ---------------------------------------------------------------------- batching, cancellation, metrics
def test_concurrent_streams_are_batched_and_each_gets_its_solo_output(server, runtime):
    steps = runtime.scheduler.engine_steps
    solo_ids = [expected(runtime, p, max_new_tokens=24, ignore_eos=True)[1] for p in PROMPTS]
    one_after_another = runtime.scheduler.engine_steps - steps
    started = time.perf_counter()
    grpc_stream(server, [tensors(PROMPTS[0], 24, stream=True, ignore_eos=True)])
    one = time.perf_counter() - started
    steps, started = metric(server, "v4_engine_steps_total"), time.perf_counter()
    responses, errors = grpc_stream(server, [tensors(p, 24, stream=True, ignore_eos=True) for p in PROMPTS])
    eight, eight_steps = time.perf_counter() - started, metric(server, "v4_engine_steps_total") - steps
    assert not errors
    for i, ids in enumerate(solo_ids):
        assert token_ids(responses[str(i)]) == ids, PROMPTS[i]
    assert eight_steps < one_after_another / 2, f"{eight_steps} engine calls, {one_after_another} one by one"
    # wall time is a figure, not a verdict (benchmarks/bench_triton.py measures it; RESULTS.md records it)
    print(f"8 concurrent streams: {eight:.2f} s in {eight_steps} engine calls; one alone: {one:.2f} s")


@pytest.mark.parametrize("client", ["grpc cancel_requests", "closed http stream"])
def test_cancelling_a_stream_stops_generation(server, client):
    generated = metric(server, "v4_generated_tokens_total")
    if client == "grpc cancel_requests":
        grpc_stream(server, [tensors(PROMPT, 3000, stream=True, ignore_eos=True)], cancel_after=0.5)
    else:
        connection = http.client.HTTPConnection(server.http_url, timeout=60)
        body = {"text_input": PROMPT, "max_tokens": 3000, "stream": True, "ignore_eos": True}
        connection.request("POST", "/v2/models/ensemble/generate_stream", json.dumps(body))
        assert connection.getresponse().readline().startswith(b"data: ")
        time.sleep(0.5)
        connection.close()
    wait_for(lambda: metric(server, "v4_generated_tokens_total") > generated, what="the cancelled request to end")
    assert metric(server, "v4_generated_tokens_total") - generated < 3000, "the cancelled request ran to its end"
    # nothing pending: the serving loop steps only while a request is live, so no engine call follows
    wait_for(lambda: metric(server, "v4_pending_requests") == 0 and metric(server, "v4_cache_bytes") == 0,
             what="the cancelled request to leave the scheduler and free its caches")


def test_metrics_are_on_the_metrics_port(server):
    generate(server, {"text_input": PROMPT, "max_tokens": 8})
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    series = {line.split("{")[0].split(" ")[0]: line for line in text.splitlines() if line.startswith("v4_")}
    for name in ("v4_time_to_first_token_seconds_count", "v4_inter_token_latency_seconds_count",
                 "v4_draft_tokens_total", "v4_accepted_draft_tokens_total", "v4_accepted_at_position_total",
                 "v4_verify_steps_total", "v4_queue_size", "v4_engine_steps_total", "v4_pending_requests",
                 "v4_cache_bytes"):
        assert name in series, name
    first_token_observations = float(series["v4_time_to_first_token_seconds_count"].split()[-1])   # a count
    assert first_token_observations >= 1, "the request's time to first token was observed"
    assert sum(line.startswith("v4_accepted_at_position_total") for line in text.splitlines()) == 3


# ---------------------------------------------------------------------- bad requests
@pytest.mark.parametrize("body, message", [
    ({"text_input": PROMPT}, "max_tokens is required"),
    ({"input_ids": [5, 6], "stream": False}, "max_tokens is required"),
    ({}, "missing required input(s) ['max_tokens']"),                # Triton's own words: no input at all
    ({"max_tokens": 8}, "give the prompt as text_input, input_ids or messages"),
    ({"text_input": PROMPT, "max_tokens": 0}, "max_tokens must be from 1 to the engine's max_seq_len"),
    ({"text_input": PROMPT, "max_tokens": 100_000}, "max_tokens must be from 1 to the engine's max_seq_len"),
    ({"text_input": PROMPT, "max_tokens": 8, "num_draft_tokens": 4}, "num_draft_tokens must be an integer from 0 to 3"),
    ({"input_ids": [5] * 5000, "max_tokens": 8}, "the prompt has 5000 tokens; this engine serves at most"),
    ({"input_ids": [5, 10_000_000], "max_tokens": 8}, "outside the vocabulary"),
    ({"text_input": "x" * 4_000_000, "max_tokens": 8}, "more than a prompt this engine serves can hold"),
])
def test_bad_requests_get_a_clear_error_and_the_server_keeps_serving(server, body, message):
    answer = generate(server, body)
    assert answer["status"] == 400 and message in answer["error"], answer
    assert "\n" not in answer["error"] and "Traceback" not in answer["error"]
    assert generate(server, {"text_input": PROMPT, "max_tokens": 4})["finish_reason"] == "length"


def test_postprocessing_called_directly_with_ids_outside_the_vocabulary_names_the_input(server):
    body = {"echo_ids": [3], "generated_ids": [5, 99_999_999], "new_tokens": 1, "finish_reason": "",
            "cancel_key": "x", "stop_strings": ["zz"]}
    answer = generate(server, body, model="postprocessing")
    assert answer["status"] == 400 and "generated_ids: 99999999 is not a token id" in answer["error"], answer


def test_text_that_is_not_utf8_is_refused(server):
    _, [error] = grpc_stream(server, [tensors(b"def \xff\xfe(n):", 8)])
    assert "text_input is not valid UTF-8 (byte 0xff at offset 4)" in str(error)


def test_an_overload_beyond_the_queue_is_refused_and_the_server_goes_on(server):
    filler = grpcclient.InferenceServerClient(server.grpc_url)
    filler.start_stream(callback=lambda result, error: None)
    for i in range(MAX_BATCH + MAX_QUEUE):
        filler.async_stream_infer("ensemble", tensors(PROMPTS[i % len(PROMPTS)], 3000, stream=True, ignore_eos=True))
    try:
        wait_for(lambda: metric(server, "v4_running_requests") == MAX_BATCH
                 and metric(server, "v4_queue_size") == MAX_QUEUE, what="a full batch and a full queue")
        _, refused = grpc_stream(server, [tensors(PROMPT, 8)] * 3)
    finally:
        filler.stop_stream(cancel_requests=True)
    assert len(refused) == 3 and all("the server is full" in str(e) for e in refused), refused
    wait_for(lambda: metric(server, "v4_running_requests") == 0, what="the cancelled fillers to leave the batch")
    assert generate(server, {"text_input": PROMPT, "max_tokens": 4})["finish_reason"] == "length"
