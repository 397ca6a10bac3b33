"""Triton overhead at batch 1 (tokens/s and time to first token through Triton vs the same runtime in-process),
and a burst of concurrent streams (how soon each starts, how many engine calls they share).

The same engine (the trained tiny V4, built with --mtp 3), prompts and settings (greedy, a fixed number of new
tokens) run one request at a time, interleaved: for each prompt, the runtime in this process
(`Generator.generate`, then `Generator.stream` for the first token), then the Triton ensemble over HTTP
(`/generate`, then `/generate_stream` for the first token), so that machine noise hits both alike. Triton is the
nvidia-pytriton 2.51 server (v4engine.triton_repo.server) on a repository rendered from the engine. The client
side uses only the standard library: a gRPC client's threads in this process would slow the in-process runtime
(ONNX Runtime runs two threads on this machine's two cores).

The burst: --concurrent streams sent at once (`/generate_stream`, one client thread each), --rounds times. Each
stream's time to first token, the burst's wall time and its engine calls (Triton's metrics port) are set against
the engine calls the same requests take one after another in-process.

    .venv/bin/python -m benchmarks.bench_triton [--engine ENGINE_DIR | --checkpoint examples/tiny-v4] \\
        [--rounds 5] [--max-tokens 64] [--concurrent 8] [--env .venv-triton] [--work /tmp/bench-triton]
"""
from __future__ import annotations

import argparse
import http.client
import json
import statistics
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks import built_engine
from v4engine.runtime.generator import Generator
from v4engine.runtime.sampling import SamplingParams
from v4engine.triton_repo import render
from v4engine.triton_repo.server import TritonServer

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n", "class Parser:\n    def __init__(self, text):",
           "for i in range(10):", "# Read the configuration file"]


def http_generate(url: str, prompt: str, max_tokens: int) -> tuple[float, dict]:
    body = json.dumps({"text_input": prompt, "max_tokens": max_tokens, "ignore_eos": True}).encode()
    started = time.perf_counter()
    with urllib.request.urlopen(urllib.request.Request(f"http://{url}/v2/models/ensemble/generate", body)) as r:
        answer = json.loads(r.read())
    return time.perf_counter() - started, answer


def http_first_token(url: str, prompt: str, max_tokens: int) -> float:
    """Seconds to the first chunk of /generate_stream (the stream is then read to its end)."""
    body = json.dumps({"text_input": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True})
    connection = http.client.HTTPConnection(url)
    started = time.perf_counter()
    connection.request("POST", "/v2/models/ensemble/generate_stream", body)
    answer = connection.getresponse()
    while not answer.readline().startswith(b"data: "):
        pass
    first = time.perf_counter() - started
    answer.read()
    connection.close()
    return first


def engine_steps(metrics_url: str) -> float:
    """v4_engine_steps_total from Triton's metrics port."""
    for line in urllib.request.urlopen(metrics_url).read().decode().splitlines():
        if line.startswith("v4_engine_steps_total{"):
            return float(line.split()[-1])
    raise RuntimeError(f"no v4_engine_steps_total at {metrics_url}")


def burst(server, prompts: list[str], max_tokens: int) -> tuple[list[float], float, float]:
    """Send every prompt at once as a stream: (each stream's time to first token, wall time, engine calls)."""
    steps = engine_steps(server.metrics_url)
    started = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        ttfts = list(pool.map(lambda p: http_first_token(server.http_url, p, max_tokens), prompts))
    return ttfts, time.perf_counter() - started, engine_steps(server.metrics_url) - steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", type=Path, help="an engine directory (default: build --checkpoint into --work)")
    p.add_argument("--checkpoint", type=Path, default=ROOT / "examples" / "tiny-v4",
                   help="built into --work when --engine is not given (default examples/tiny-v4)")
    p.add_argument("--env", type=Path, default=ROOT / ".venv-triton", help="the serving environment")
    p.add_argument("--work", type=Path, default=Path("/tmp/bench-triton"),
                   help="the engine, the model repository and the server's files (default /tmp/bench-triton)")
    p.add_argument("--rounds", type=int, default=5, help="bursts of --concurrent streams measured (default 5)")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens of every request (default 64)")
    p.add_argument("--concurrent", type=int, default=8, help="streams per burst (at most the repository's max_batch)")
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    engine = args.engine or built_engine(args.checkpoint, args.work)
    repo = render(engine, args.work / "repo", force=True)
    generator = Generator.from_engine_dir(engine)
    params = SamplingParams(max_new_tokens=args.max_tokens, ignore_eos=True)
    local = {"seconds": [], "ttft": []}
    served = {"seconds": [], "ttft": [], "steps": []}    # steps: the runtime's own step time inside the server
    with TritonServer(repo, args.env, work_dir=args.work / "server") as server:
        for prompt in PROMPTS[:1]:                       # warm both paths up
            generator.generate([prompt], params)
            http_generate(server.http_url, prompt, args.max_tokens)
        for _ in range(args.rounds):
            for prompt in PROMPTS:
                started = time.perf_counter()
                [result] = generator.generate([prompt], params)
                local["seconds"].append(time.perf_counter() - started)
                started = time.perf_counter()
                stream = generator.stream(prompt, params)
                next(stream)
                local["ttft"].append(time.perf_counter() - started)
                stream.close()                           # cancels the rest of the request
                seconds, answer = http_generate(server.http_url, prompt, args.max_tokens)
                assert answer["output_ids"] == result.token_ids, "Triton and the runtime disagree"
                served["seconds"].append(seconds)
                served["steps"].append(args.max_tokens / json.loads(answer["metrics"])["tokens_per_second"])
                served["ttft"].append(http_first_token(server.http_url, prompt, args.max_tokens))
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.concurrent)]
        before = generator.scheduler.engine_steps
        for prompt in prompts:
            generator.generate([prompt], params)
        one_by_one = generator.scheduler.engine_steps - before
        bursts = [burst(server, prompts, args.max_tokens) for _ in range(args.rounds)]
    n = args.max_tokens
    rows = [("in-process runtime", local), ("Triton ensemble (HTTP generate; generate_stream for TTFT)", served)]
    print(f"engine {engine}, greedy, {n} new tokens, batch 1, {args.rounds} rounds x {len(PROMPTS)} prompts\n")
    print("| path | tokens/s (median) | time to first token (median) |\n|---|---|---|")
    for name, figures in rows:
        print(f"| {name} | {n / statistics.median(figures['seconds']):.1f} | "
              f"{1000 * statistics.median(figures['ttft']):.1f} ms |")
    overhead = statistics.median(served["seconds"]) / statistics.median(local["seconds"]) - 1
    inside = statistics.median(s / r for s, r in zip(served["seconds"], served["steps"])) - 1
    print(f"\nTriton vs in-process, time per request: {100 * overhead:+.1f} % "
          f"(tokens/s ratio {statistics.median(local['seconds']) / statistics.median(served['seconds']):.3f})")
    print(f"Triton's own share, per request: client time vs the runtime's step time inside the server: "
          f"{100 * inside:+.1f} % (median)")
    print(f"\n{args.concurrent} concurrent streams, {args.rounds} bursts; one after another in-process they take "
          f"{one_by_one} engine calls\n")
    print("| burst | first token, median | first token, slowest stream | wall | engine calls |\n|---|---|---|---|---|")
    for i, (ttfts, wall, steps) in enumerate(bursts, 1):
        print(f"| {i} | {1000 * statistics.median(ttfts):.0f} ms | {1000 * max(ttfts):.0f} ms | {wall:.2f} s | "
              f"{steps:.0f} |")


if __name__ == "__main__":
    main()
