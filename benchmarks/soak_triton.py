"""Soak the real Triton server: many concurrent requests, some cancelled, some abandoned, and nothing may be left.

--requests requests (2,000), --concurrency at a time (50), through the ensemble of a repository rendered from the
trained tiny V4 (built with --mtp 3) or --engine, on the nvidia-pytriton 2.51 server (v4engine.triton_repo.server).
Each request is one of five kinds, drawn with --seed: HTTP generate; HTTP generate_stream read to its end; a gRPC
stream read to its end; a gRPC stream cancelled after its first response (`stop_stream(cancel_requests=True)`);
an HTTP generate_stream whose client hangs up after its first event. The two last ask for --long-tokens so that
they are still generating when they are cut; the others for at most --max-tokens.

Afterwards it checks, from outside the server:
- the cut requests stopped early: the engine generated fewer tokens (v4_generated_tokens_total) than the requests
  run to their end asked for plus half of what the cut ones asked for;
- the serving loop holds nothing: v4_pending_requests and v4_cache_bytes (Triton's metrics port) are 0;
- v4_generate's stub process (found among the server's processes through /proc) grew less than 5 % in RSS from
  after --warmup requests of every kind to the end;
- a normal request still gets exactly the tokens of v4engine.runtime's Generator for the same prompt.
It prints a table and exits 1 if a check fails.

    .venv/bin/python -m benchmarks.soak_triton [--engine ENGINE_DIR] [--requests 2000] [--concurrency 50] \\
        [--max-tokens 16] [--long-tokens 256] [--warmup 100] [--seed 0] [--env .venv-triton] [--work /tmp/soak-triton]
"""
from __future__ import annotations

import argparse
import collections
import http.client
import json
import queue
import random
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from benchmarks import built_engine
from v4engine.runtime.generator import Generator
from v4engine.runtime.sampling import SamplingParams
from v4engine.triton_repo import render
from v4engine.triton_repo.server import TritonServer

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n", "class Parser:\n    def __init__(self, text):",
           "for i in range(10):", "# Read the configuration file", "while True:", "x = ["]
KINDS = ("http generate", "http stream", "grpc stream", "grpc cancelled", "http hung up")
CUT = KINDS[3:]                         # asked for --long-tokens, cut after their first response
TIMEOUT = 300.0


# ---------------------------------------------------------------------- the five kinds of request
def http_generate(url: str, body: dict) -> str:
    connection = http.client.HTTPConnection(url, timeout=TIMEOUT)
    try:
        connection.request("POST", "/v2/models/ensemble/generate", json.dumps(body))
        answer = connection.getresponse()
        reply = json.loads(answer.read())
    finally:
        connection.close()
    return "completed" if answer.status == 200 and reply.get("finish_reason") else f"error: {reply.get('error')}"


def http_stream(url: str, body: dict, hang_up: bool) -> str:
    """generate_stream read to its end, or closed after the first event."""
    connection = http.client.HTTPConnection(url, timeout=TIMEOUT)
    try:
        connection.request("POST", "/v2/models/ensemble/generate_stream", json.dumps({**body, "stream": True}))
        answer = connection.getresponse()
        events = []
        for line in answer:
            if line.startswith(b"data: "):
                events.append(json.loads(line[len(b"data: "):]))
                if "error" in events[-1]:
                    return f"error: {events[-1]['error']}"
                if hang_up:
                    return "hung up"
    finally:
        connection.close()
    return "completed" if events and events[-1].get("finish_reason") else "error: the stream ended early"


def grpc_stream(url: str, body: dict, cancel: bool) -> str:
    """A gRPC stream read to its final response, or cancelled after its first."""
    def tensor(name: str, value, dtype: str):
        t = grpcclient.InferInput(name, [1], dtype)
        t.set_data_from_numpy(np.array([value], dtype=object if dtype == "BYTES" else None))
        return t

    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    try:
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        client.async_stream_infer("ensemble", [tensor("text_input", body["text_input"].encode(), "BYTES"),
                                               tensor("max_tokens", np.int32(body["max_tokens"]), "INT32"),
                                               tensor("ignore_eos", body["ignore_eos"], "BOOL"),
                                               tensor("stream", True, "BOOL")],
                                  enable_empty_final_response=True)
        while True:
            result, error = answers.get(timeout=TIMEOUT)
            if error is not None:
                return f"error: {error}"
            if cancel:
                client.stop_stream(cancel_requests=True)
                return "cancelled"
            if result.get_response().parameters["triton_final_response"].bool_param:
                return "completed"
    finally:
        client.stop_stream()
        client.close()


def one_request(server: TritonServer, kind: str, rng: random.Random, args) -> tuple[str, str, int]:
    """(kind, outcome: completed, cancelled, hung up or error: ..., max_tokens asked for)."""
    cut = kind in CUT
    body = {"text_input": rng.choice(PROMPTS), "ignore_eos": cut or rng.random() < 0.5,
            "max_tokens": args.long_tokens if cut else rng.randint(1, args.max_tokens)}
    try:
        if kind == "http generate":
            outcome = http_generate(server.http_url, body)
        elif kind in ("http stream", "http hung up"):
            outcome = http_stream(server.http_url, body, hang_up=cut)
        else:
            outcome = grpc_stream(server.grpc_url, body, cancel=cut)
    except Exception as e:                                   # noqa: BLE001 - counted and shown, the soak goes on
        outcome = f"error: {type(e).__name__}: {e}"
    return kind, outcome, body["max_tokens"]


def run(server: TritonServer, count: int, args, rng: random.Random) -> list[tuple[str, str, int]]:
    """`count` requests of random kinds, `args.concurrency` at a time: one_request's answer for each."""
    plan = [(rng.choice(KINDS), random.Random(rng.random())) for _ in range(count)]
    with ThreadPoolExecutor(args.concurrency) as pool:
        return list(pool.map(lambda item: one_request(server, item[0], item[1], args), plan))


# ---------------------------------------------------------------------- what is measured from outside
def metrics(server: TritonServer) -> dict[str, float]:
    """The serving loop's gauges and the generated-token counter, from Triton's metrics port."""
    text = urllib.request.urlopen(server.metrics_url, timeout=30).read().decode()
    return {line.split("{")[0]: float(line.split()[-1]) for line in text.splitlines()
            if line.startswith(("v4_pending_requests{", "v4_cache_bytes{", "v4_generated_tokens_total{"))}


def settled(server: TritonServer, timeout: float = 60.0) -> dict[str, float]:
    """The metrics once both gauges are 0, or as they are after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        now = metrics(server)
        if not (now["v4_pending_requests"] or now["v4_cache_bytes"]) or time.monotonic() > deadline:
            return now
        time.sleep(0.5)


def generate_rss(server: TritonServer) -> int:
    """Resident bytes of v4_generate's Python-backend stub."""
    [pid] = [pid for pid, command in server.processes().items() if "/v4_generate/1/model.py" in command]
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", type=Path, help="an engine directory (default: build examples/tiny-v4 into --work)")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=50)
    p.add_argument("--max-tokens", type=int, default=16, help="at most this many new tokens per request run to its end")
    p.add_argument("--long-tokens", type=int, default=256, help="max_tokens of the requests that are cut")
    p.add_argument("--warmup", type=int, default=100, help="requests before the first RSS reading")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--env", type=Path, default=ROOT / ".venv-triton", help="the serving environment")
    p.add_argument("--work", type=Path, default=Path("/tmp/soak-triton"))
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    engine = args.engine or built_engine(ROOT / "examples" / "tiny-v4", args.work)
    # room for every concurrent request: the soak is about what is left behind, not about refusals
    repo = render(engine, args.work / "repo", max_queue_size=args.concurrency, force=True)
    rng = random.Random(args.seed)
    prompt, check_tokens = PROMPTS[0], 24
    [expected] = Generator.from_engine_dir(engine).generate([prompt], SamplingParams(max_new_tokens=check_tokens))
    with TritonServer(repo, args.env, work_dir=args.work / "server") as server:
        warmup = run(server, args.warmup, args, rng)
        before = settled(server)
        rss_before = generate_rss(server)
        started = time.perf_counter()
        requests = run(server, args.requests, args, rng)
        seconds = time.perf_counter() - started
        after = settled(server)
        rss_after = generate_rss(server)
        answer = json.loads(urllib.request.urlopen(urllib.request.Request(
            f"http://{server.http_url}/v2/models/ensemble/generate",
            json.dumps({"text_input": prompt, "max_tokens": check_tokens}).encode()), timeout=TIMEOUT).read())
    growth = rss_after / rss_before - 1
    exact = answer["output_ids"] == expected.token_ids
    outcomes = collections.Counter((kind, outcome) for kind, outcome, _ in requests)
    errors = collections.Counter((k, o) for k, o, _ in warmup + requests if o.startswith("error"))
    generated = after["v4_generated_tokens_total"] - before["v4_generated_tokens_total"]
    run_through = sum(asked for kind, _, asked in requests if kind not in CUT)
    cut = sum(asked for kind, _, asked in requests if kind in CUT)
    checks = {"the cut requests stopped early": generated < run_through + cut / 2,
              "v4_pending_requests = 0": after["v4_pending_requests"] == 0,
              "v4_cache_bytes = 0": after["v4_cache_bytes"] == 0,
              "v4_generate RSS grew < 5 %": growth < 0.05,
              "a normal request's tokens = Generator's": exact,
              "no request failed": not errors}

    print(f"engine {engine}; {args.requests} requests, {args.concurrency} concurrent, seed {args.seed}, "
          f"after {args.warmup} warm-up requests\n")
    print("| kind | requests | completed | cancelled | hung up | errors |\n|---|---|---|---|---|---|")
    for kind in KINDS:
        row = {o: n for (k, o), n in outcomes.items() if k == kind}
        failed = sum(n for o, n in row.items() if o.startswith("error"))
        print(f"| {kind} | {sum(row.values())} | {row.get('completed', 0)} | {row.get('cancelled', 0)} | "
              f"{row.get('hung up', 0)} | {failed} |")
    print(f"\n| figure | value |\n|---|---|\n"
          f"| wall time | {seconds:.0f} s ({args.requests / seconds:.1f} requests/s) |")
    print(f"| tokens generated | {generated:.0f} (run to their end: at most {run_through} asked; cut: {cut} asked) |")
    print(f"| v4_pending_requests, v4_cache_bytes after | {after['v4_pending_requests']:.0f}, "
          f"{after['v4_cache_bytes']:.0f} |")
    print(f"| v4_generate RSS after warm-up, at the end | {rss_before / 2**20:.1f} MiB, {rss_after / 2**20:.1f} MiB "
          f"({100 * growth:+.2f} %) |")
    print(f"| normal request after the soak | {'the' if exact else 'NOT the'} Generator's {check_tokens} tokens |\n")
    for (kind, outcome), n in errors.items():
        print(f"{n} x {kind}: {outcome}")
    for name, ok in checks.items():
        print(f"{'ok    ' if ok else 'FAILED'} {name}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
