"""v4serve's overhead: the OpenAI server against the same runtime in-process, at batch 1 and with concurrent streams.

The trained tiny V4 (--mtp 3), held-out prompts, greedy, a fixed number of new tokens (ignore_eos). Interleaved
round by round, so that machine noise hits both alike:
- batch 1: each prompt in turn: `Generator.generate` in this process, then `/v1/completions` over HTTP to a
  v4serve process, for tokens/s; then each streamed (`Generator.stream`, "stream": true) for time to first token;
- concurrent: --concurrent prompts at once: `Generator.generate` of all of them (batched by the scheduler; time to
  first token from each request's metrics), then as many streams sent to v4serve at once, one client thread
  each.
Each system's tokens/s (tokens over wall time) and time to first token (first streamed text or tokens) are the
medians over rounds. The client uses only the standard library (http.client), as curl would: the openai
client's own cost is not v4serve's.

    python -m benchmarks.bench_openai --work /tmp/bench-openai [--rounds 5] [--new-tokens 64] [--concurrent 8]
"""
from __future__ import annotations

import argparse
import http.client
import json
import statistics
import threading
import time
from pathlib import Path

from benchmarks import built_engine
from benchmarks.bench_generate import held_out_prompts
from benchmarks.lm_eval_tiny import serve
from v4engine.runtime.budget import Limits
from v4engine.runtime.generator import Generator
from v4engine.runtime.sampling import SamplingParams
from v4engine.triton_repo.server import free_ports

TRAINED = Path(__file__).resolve().parent.parent / "examples" / "tiny-v4"


def served(port: int, prompt: list[int], new_tokens: int) -> tuple[float, int]:
    """(seconds, completion tokens) of one completion, not streamed."""
    start = time.perf_counter()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    connection.request("POST", "/v1/completions", json.dumps({
        "model": "tiny-v4", "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True}),
        {"Content-Type": "application/json"})
    tokens = json.loads(connection.getresponse().read())["usage"]["completion_tokens"]
    connection.close()
    return time.perf_counter() - start, tokens


def served_stream(port: int, prompt: list[int], new_tokens: int) -> tuple[float, float, int]:
    """(seconds to the first text, seconds in all, completion tokens) of one streamed completion."""
    start = time.perf_counter()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    connection.request("POST", "/v1/completions", json.dumps({
        "model": "tiny-v4", "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True}}), {"Content-Type": "application/json"})
    response = connection.getresponse()
    first, tokens = None, 0
    for line in response:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if first is None and chunk["choices"] and chunk["choices"][0]["text"]:
            first = time.perf_counter() - start
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
    connection.close()
    return first or 0.0, time.perf_counter() - start, tokens


def one_at_a_time(request, first_token) -> tuple[float, float, int]:
    """(first-token seconds of a streamed run, seconds and tokens of a plain run): tokens/s of one request the way
    a client that waits for the whole answer sees them (streaming clients also parse every chunk meanwhile, on the
    same two cores), time to first token the way a streaming client sees it."""
    seconds, tokens = request()
    return first_token()[0], seconds, tokens


def direct_stream(generator: Generator, prompt: list[int], params: SamplingParams) -> tuple[float, float, int]:
    start, first, tokens = time.perf_counter(), None, 0
    for chunk in generator.stream(prompt, params):
        first = first if first is not None else time.perf_counter() - start
        tokens += len(chunk)
    return first, time.perf_counter() - start, tokens


def direct(generator: Generator, prompt: list[int], params: SamplingParams) -> tuple[float, int]:
    start = time.perf_counter()
    [result] = generator.generate([prompt], params)
    return time.perf_counter() - start, len(result.token_ids)


def direct_batch(generator: Generator, prompts: list[list[int]], params: SamplingParams) -> tuple[float, float, int]:
    """(median first-token seconds, wall seconds, tokens) of the prompts generated together in-process."""
    start = time.perf_counter()
    results = generator.generate(prompts, params)
    return (statistics.median(r.metrics["time_to_first_token"] for r in results), time.perf_counter() - start,
            sum(len(r.token_ids) for r in results))


def burst(run, prompts: list[list[int]]) -> tuple[float, float, int]:
    """(median first-token seconds, wall seconds, tokens) of `run(prompt)` for every prompt at once."""
    results: list = [None] * len(prompts)

    def one(i: int) -> None:
        results[i] = run(prompts[i])

    start = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return statistics.median(r[0] for r in results), time.perf_counter() - start, sum(r[2] for r in results)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, default=Path("bench-openai"), help="where the engine is built")
    p.add_argument("--rounds", type=int, default=5, help="rounds, each with every system (default 5)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per request (default 64)")
    p.add_argument("--prompt-tokens", type=int, default=128, help="prompt length (default 128)")
    p.add_argument("--concurrent", type=int, default=8, help="streams sent at once (default 8)")
    args = p.parse_args(argv)
    engine = built_engine(TRAINED, args.work, 3)
    prompts = held_out_prompts(engine / "tokenizer.json", args.rounds * (1 + args.concurrent), args.prompt_tokens,
                               args.new_tokens, seed=0)
    generator = Generator.from_engine_dir(engine, limits=Limits(max_batch=args.concurrent), own_process=True,
                                          prefix_cache=False)
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    [port] = free_ports(1)
    server = serve(engine, 3, port, "--max-batch", str(args.concurrent), "--no-prefix-cache")
    rows: dict[str, list[tuple[float, float]]] = {k: [] for k in ("direct 1", "v4serve 1", "direct n", "v4serve n")}
    try:
        served_stream(port, prompts[0], 4)                                  # warm both once
        direct_stream(generator, prompts[0], params)
        for r in range(args.rounds):
            one = prompts[r * (1 + args.concurrent)]
            group = prompts[r * (1 + args.concurrent) + 1: (r + 1) * (1 + args.concurrent)]
            for name, (first, seconds, tokens) in (
                    ("direct 1", one_at_a_time(lambda: direct(generator, one, params),
                                               lambda: direct_stream(generator, one, params))),
                    ("v4serve 1", one_at_a_time(lambda: served(port, one, args.new_tokens),
                                                lambda: served_stream(port, one, args.new_tokens))),
                    ("direct n", direct_batch(generator, group, params)),
                    ("v4serve n", burst(lambda x: served_stream(port, x, args.new_tokens), group))):
                rows[name].append((tokens / seconds, first))
    finally:
        server.terminate()
        server.wait(30)
    print(f"{args.rounds} rounds, {args.prompt_tokens}-token prompts, {args.new_tokens} new tokens, greedy, MTP 3; "
          f"concurrent: {args.concurrent} streams")
    print("| system | tokens/s | time to first token | tokens/s vs in-process |")
    print("|---|---|---|---|")
    for name, values in rows.items():
        rate = statistics.median(v[0] for v in values)
        base = statistics.median(v[0] for v in rows["direct " + name.split()[-1]])
        label = name.replace(" 1", ", batch 1").replace(" n", f", {args.concurrent} streams")
        print(f"| {label} | {rate:.1f} | {1000 * statistics.median(v[1] for v in values):.0f} ms | "
              f"{rate / base:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
