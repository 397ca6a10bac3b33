"""v4serve, the OpenAI-compatible server, driven by clients nobody here wrote: the `openai` Python client and raw
HTTP (as curl sends it) against a real v4serve process on the trained tiny-v4 engine.

What it must hold: greedy completions are exactly the Generator's tokens; streamed chunks join to the non-streamed
text; chat goes through V4's chat encoding (the prompt /tokenize reports is the encoder's) and its answer is parsed;
bad requests are refused in the OpenAI error shape naming the field; a full server answers 429 at once; a client
that hangs up frees its batch slot.
"""
from __future__ import annotations

import http.client
import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

from v4engine.chat.encoding import encode_messages  # noqa: E402
from v4engine.chat.parsing import parse_answer  # noqa: E402
from v4engine.runtime.generator import Generator  # noqa: E402
from v4engine.runtime.sampling import SamplingParams  # noqa: E402
from v4engine.triton_repo.server import free_ports  # noqa: E402

pytestmark = pytest.mark.xdist_group("openai_server")
MODEL = "tiny-v4"
PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n\ndef main(", "class Stack:\n    def __init__(self):"]
KEY = "sk-test-key"


class Served:
    """A v4serve process on a free port, stopped at teardown."""

    def __init__(self, engine: Path, *args: str):
        [self.port] = free_ports(1)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "v4engine.server.cli", str(engine), "--port", str(self.port),
             "--served-model-name", MODEL, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"v4serve exited: {self.process.stdout.read()}")
            try:
                if self.request("GET", "/health")[0] == 200:
                    return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError("v4serve did not come up in 180 s")

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def request(self, method: str, path: str, body: dict | None = None, headers: dict | None = None
                ) -> tuple[int, bytes]:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        try:
            connection.request(method, path, json.dumps(body) if body is not None else None,
                               {"Content-Type": "application/json", **(headers or {})})
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()

    def post(self, path: str, body: dict, **headers: str) -> tuple[int, dict]:
        status, data = self.request("POST", path, body, headers)
        return status, json.loads(data)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()


@pytest.fixture(scope="module")
def server(trained_engine):
    served = Served(trained_engine)
    yield served
    served.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def generator(trained_engine):
    return Generator.from_engine_dir(trained_engine)


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert server.request("GET", "/health")[0] == 200
    status, text = server.request("GET", "/metrics")
    assert status == 200
    for name in ("v4_generated_tokens_total", "v4_accepted_at_position_total", "v4_queue_size", "v4_cache_bytes"):
        assert name.encode() in text


def test_greedy_completions_are_the_generators_tokens(client, generator):
    expected = generator.generate(PROMPTS, SamplingParams(max_new_tokens=24))
    answer = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=24, temperature=0)
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert [c.text for c in answer.choices] == [r.text for r in expected]
    assert answer.usage.completion_tokens == sum(len(r.token_ids) for r in expected)
    assert answer.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in expected)
    speculative = answer.model_extra["usage"]["speculative"] if "usage" in answer.model_extra else \
        answer.usage.model_extra["speculative"]
    assert speculative["verify_steps"] > 0 and speculative["mean_acceptance_length"] >= 1
    # token-id prompts give the same
    ids = [r.prompt_token_ids for r in expected]
    again = client.completions.create(model=MODEL, prompt=ids, max_tokens=24, temperature=0)
    assert [c.text for c in again.choices] == [r.text for r in expected]


def test_streamed_chunks_join_to_the_whole_text(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=40, temperature=0)
    pieces, finish = [], None
    for chunk in client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=40, temperature=0,
                                           stream=True, stream_options={"include_usage": True}):
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        else:
            usage = chunk.usage
    assert "".join(pieces) == whole.choices[0].text
    assert finish == whole.choices[0].finish_reason
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_sampled_choices_are_reproducible_by_seed_and_differ_from_each_other(client):
    first = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=24, temperature=1.0, n=3, seed=7)
    again = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=24, temperature=1.0, n=3, seed=7)
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert len({c.text for c in first.choices}) > 1


def test_chat_goes_through_v4s_encoding_and_its_answer_is_parsed(server, client, generator):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]
    prompt = encode_messages(messages, thinking=False)
    status, tokenized = server.post("/tokenize", {"model": MODEL, "messages": messages})
    assert status == 200 and tokenized["tokens"] == generator.encode(prompt)
    expected = generator.generate(prompt, SamplingParams(max_new_tokens=20))[0]
    answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    assert answer.choices[0].message.content == parse_answer(expected.text, thinking=False).content
    assert answer.usage.completion_tokens == len(expected.token_ids)
    # thinking: the prompt opens the reasoning, the answer's text is reasoning until </think>
    thinking = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                              extra_body={"thinking": {"type": "enabled"}})
    text = generator.generate(encode_messages(messages, thinking=True), SamplingParams(max_new_tokens=20))[0].text
    parsed = parse_answer(text, thinking=True)
    message = thinking.choices[0].message
    assert message.model_extra["reasoning_content"] == parsed.reasoning
    assert message.content == parsed.content
    assert thinking.usage.completion_tokens_details.reasoning_tokens <= thinking.usage.completion_tokens


def test_streamed_chat_deltas_join_to_the_whole_message(client):
    messages = [{"role": "user", "content": "class Queue:"}]
    for extra in ({}, {"thinking": {"type": "enabled"}}):
        whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0,
                                               extra_body=extra)
        content, reasoning, roles = [], [], []
        for chunk in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0,
                                                    stream=True, extra_body=extra):
            delta = chunk.choices[0].delta
            roles += [delta.role] if delta.role else []
            content.append(delta.content or "")
            reasoning.append((delta.model_extra or {}).get("reasoning_content") or "")
        assert roles == ["assistant"]
        assert "".join(content) == (whole.choices[0].message.content or "")
        assert "".join(reasoning) == (whole.choices[0].message.model_extra.get("reasoning_content") or "")


def test_logprobs_are_the_generators_and_echo_scores_the_prompt(client, generator):
    expected = generator.generate(PROMPTS[0], SamplingParams(max_new_tokens=6, logprobs=2, prompt_logprobs=2))[0]
    answer = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=2,
                                       echo=True)
    logprobs = answer.choices[0].logprobs
    scored = expected.prompt_logprobs + expected.logprobs
    assert answer.choices[0].text == PROMPTS[0] + expected.text
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None     # nothing scores token 0
    assert len(logprobs.token_logprobs) == len(expected.prompt_token_ids) + len(expected.token_ids)
    assert all(abs(got - want.logprob) <= 1e-6 for got, want in zip(logprobs.token_logprobs[1:], scored))
    assert all(max(top.values()) >= got - 1e-9 for got, top in zip(logprobs.token_logprobs[1:],
                                                                   logprobs.top_logprobs[1:]))
    assert "".join(logprobs.tokens) == answer.choices[0].text
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 3 for c in content)
    assert all(c.top_logprobs[0].logprob == c.logprob for c in content)                 # greedy: the best


def test_lm_eval_scores_what_the_generator_generates(server, generator, tmp_path):
    """lm-evaluation-harness as the field runs it (local-completions, the server's tokenizer, token-id prompts),
    offline on tasks made from held-out Python: a generation task and a loglikelihood (multiple choice) one."""
    pytest.importorskip("lm_eval")
    from benchmarks.lm_eval_tiny import documents, evaluate, write_tasks

    tasks = write_tasks(tmp_path / "tasks", count=24)
    results = evaluate(server.port, tasks, tmp_path / "out", limit=12)
    docs = documents(24)[:12]
    generated = generator.generate([d["context"] for d in docs], SamplingParams(max_new_tokens=48, stop=("\n",)))
    exact = sum(g.text.strip() == d["target"].strip() for g, d in zip(generated, docs)) / len(docs)
    assert results["tiny_python_next_line"]["exact_match,none"] == pytest.approx(exact)
    assert 0.0 <= results["tiny_python_choice"]["acc,none"] <= 1.0
    # lm-eval's chat client: each context a user message, through V4's chat encoding
    chat = evaluate(server.port, tasks, tmp_path / "chat", limit=4, chat=True)
    prompts = [encode_messages([{"role": "user", "content": d["context"]}], thinking=False) for d in docs[:4]]
    answers = generator.generate(prompts, SamplingParams(max_new_tokens=48, stop=("\n",)))
    exact = sum(a.text.strip() == d["target"].strip() for a, d in zip(answers, docs)) / 4
    assert chat["tiny_python_next_line"]["exact_match,none"] == pytest.approx(exact)


def test_sse_stream_as_curl_sees_it(server):
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    connection.request("POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 8,
                                                              "temperature": 0, "stream": True}),
                       {"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200 and response.getheader("content-type").startswith("text/event-stream")
    events = [line for line in response.read().decode().splitlines() if line.startswith("data: ")]
    connection.close()
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl on this machine")
def test_curl_reads_the_chat_stream_to_its_end(server):
    """curl -N, as the README shows it: server-sent events, the role first, text deltas, [DONE] last."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "stream": True,
            "temperature": 0}
    run = subprocess.run(["curl", "-sN", f"http://127.0.0.1:{server.port}/v1/chat/completions", "-H",
                          "Content-Type: application/json", "-d", json.dumps(body)],
                         capture_output=True, text=True, timeout=60)
    events = [line.removeprefix("data: ") for line in run.stdout.splitlines() if line.startswith("data: ")]
    assert run.returncode == 0 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("path, body, status, param, words", [
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1}, 400, None, "temperature must be"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": "0.5"}, 400, "temperature", "valid number"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"5": 1.0}}, 400, "logit_bias", "not served"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "presence_penalty": 3}, 400, None,
     "presence_penalty must be a number from -2 to 2"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 21}, 400, None, "logprobs must be an integer"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 99}, 400, "n", "less than or equal to 16"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model", "not served here"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt", "Field required"),
    ("/v1/completions", {"model": MODEL, "prompt": [999999]}, 400, None, "token id"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages",
     "messages[0].role must be one of"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "reasoning_effort": "extreme"}, 400, "reasoning_effort", "must be one of none"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "tool_choice": "required"}, 400, "tool_choice", "structured output"),
    ("/detokenize", {"tokens": [1, -5]}, 400, "tokens", "tokens[1] = -5 is not a token id"),
    ("/detokenize", {"tokens": [1] * 5000}, 400, "tokens", "more than a sequence of this server (4096"),
    ("/tokenize", {"prompt": "x" * 4_000_000}, 400, "prompt", "more than a prompt this server serves can hold"),
])
def test_bad_requests_get_the_openai_error_shape_naming_the_field(server, path, body, status, param, words):
    got, answer = server.post(path, body)
    assert got == status
    error = answer["error"]
    assert error["code"] == status and words in error["message"] and "\n" not in error["message"]
    if param is not None:
        assert error["param"] == param


def test_the_openai_client_raises_on_a_refused_request(client):
    with pytest.raises(openai.BadRequestError, match="top_p must be a number in"):
        client.completions.create(model=MODEL, prompt="x", top_p=0)


def test_a_body_over_the_limit_is_refused_before_it_is_parsed(server):
    status, answer = server.post("/v1/completions", {"model": MODEL, "prompt": "x" * (17 << 20)})
    assert status == 413 and "max_body_bytes" in answer["error"]["message"]


@pytest.fixture(scope="module")
def small_server(trained_engine):
    """One batch slot, no queue, an API key."""
    served = Served(trained_engine, "--max-batch", "1", "--max-queue-size", "0", "--api-key", KEY)
    yield served
    served.stop()


def test_an_api_key_is_required_when_set(small_server):
    assert small_server.post("/v1/completions", {"model": MODEL, "prompt": "x"})[0] == 401
    assert small_server.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2},
                             Authorization="Bearer wrong")[0] == 401
    assert small_server.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2},
                             Authorization=f"Bearer {KEY}")[0] == 200
    assert small_server.request("GET", "/health")[0] == 200          # liveness needs no key


def test_a_full_server_answers_429_and_a_client_that_hangs_up_frees_its_slot(small_server):
    long = json.dumps({"model": MODEL, "prompt": "def f(x):", "max_tokens": 3000, "ignore_eos": True,
                       "temperature": 0}).encode()
    hanging = socket.create_connection(("127.0.0.1", small_server.port))
    hanging.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: " + str(len(long)).encode()
                    + b"\r\n\r\n" + long)
    auth = {"Authorization": f"Bearer {KEY}"}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:                  # until the long request holds the only slot
        status, answer = small_server.post("/v1/completions", {"model": MODEL, "prompt": "y", "max_tokens": 1},
                                           **auth)
        if status == 429:
            break
        time.sleep(0.05)
    assert status == 429 and answer["error"]["type"] == "rate_limit_error"
    hanging.close()                                     # the client hangs up: its request ends at the next step
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        status, _ = small_server.post("/v1/completions", {"model": MODEL, "prompt": "y", "max_tokens": 1}, **auth)
        if status == 200:
            break
        time.sleep(0.05)
    assert status == 200


def test_v4serve_refuses_an_engine_without_a_tokenizer_in_one_line(engine_copy):
    (engine_copy / "tokenizer.json").unlink()
    result = subprocess.run([sys.executable, "-m", "v4engine.server.cli", str(engine_copy), "--port",
                             str(free_ports(1)[0])], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0 and "tokenizer.json is missing" in result.stderr
