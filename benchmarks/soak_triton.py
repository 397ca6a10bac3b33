"""Soak the real Triton server: many concurrent requests, some cancelled, some abandoned, and nothing may be left.

--requests requests (2,000), --concurrency at a time (50), through the ensemble of a repository rendered from the
trained tiny V4 (built with --mtp 3) or --engine, on the nvidia-pytriton 2.51 server (v4engine.triton_repo.server).
Each request is one of five kinds, drawn with --seed: HTTP generate; HTTP generate_stream read to its end; a gRPC
stream read to its end; a gRPC stream cancelled after its first response (`stop_stream(cancel_requests=True)`);
an HTTP generate_stream whose client hangs up after its first event. The two last ask for --long-tokens so that
they are still generating when they are cut; the others for at most --max-tokens.

With --kill-restarts N (default 2) the server is started by examples/triton/serve.py, as a user starts it, and
the requests are served by N + 1 servers in turn: after each of the first N parts, while --concurrency long
streams are live, the launcher is killed with SIGKILL (`kill -9`), and the soak checks that no process of that
server is left, no /dev/shm region of its prefix and no temporary folder of its own, before the next one starts.

Afterwards it checks, from outside the server:
- the cut requests stopped early: the engine generated fewer tokens (v4_generated_tokens_total) than the requests
  run to their end asked for plus half of what the cut ones asked for;
- the serving loop holds nothing: v4_pending_requests and v4_cache_bytes (Triton's metrics port) are 0;
- v4_generate's stub process (found among the server's processes through /proc) grew less than 5 % in RSS from
  after --warmup requests of every kind to the end;
- a normal request still gets exactly the tokens of v4engine.runtime's Generator for the same prompt.
It prints a table and exits 1 if a check fails.

    .venv/bin/python -m benchmarks.soak_triton [--engine ENGINE_DIR] [--requests 2000] [--concurrency 50] \\
        [--max-tokens 16] [--long-tokens 256] [--warmup 100] [--kill-restarts 2] [--seed 0] [--env .venv-triton] \\
        [--work /tmp/soak-triton]
"""
from __future__ import annotations

import argparse
import collections
import http.client
import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
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
from v4engine.triton_repo.server import SHM, TritonServer, group_processes

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


def one_request(server: TritonServer | Launched, kind: str, rng: random.Random, args, hang_up: bool = True
                ) -> tuple[str, str, int]:
    """(kind, outcome: completed, cancelled, hung up or error: ..., max_tokens asked for); `hang_up` False: a cut
    kind's long request read to its end (or to its server's death)."""
    cut = kind in CUT
    body = {"text_input": rng.choice(PROMPTS), "ignore_eos": cut or rng.random() < 0.5,
            "max_tokens": args.long_tokens if cut else rng.randint(1, args.max_tokens)}
    try:
        if kind == "http generate":
            outcome = http_generate(server.http_url, body)
        elif kind in ("http stream", "http hung up"):
            outcome = http_stream(server.http_url, body, hang_up=cut and hang_up)
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


# ---------------------------------------------------------------------- serve.py, and its kill -9
class Launched:
    """A server that examples/triton/serve.py started, seen from outside: its addresses (WORK/server.json), its
    process group, shared-memory prefix and temporary folder (from tritonserver's command line and environment)."""

    def __init__(self, engine: Path, work: Path, env: Path, queue_size: int):
        self.launcher = subprocess.Popen([sys.executable, str(ROOT / "examples" / "triton" / "serve.py"), str(engine),
                                          "--work", str(work), "--env", str(env), "--max-queue-size", str(queue_size)],
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        line = self.launcher.stdout.readline()
        if not line.startswith("serving "):
            raise SystemExit(f"serve.py did not start: {line}{self.launcher.stdout.read()}")
        urls = json.loads((work / "server.json").read_text())
        self.http_url, self.grpc_url, self.metrics_url = urls["http"], urls["grpc"], urls["metrics"]
        children = Path(f"/proc/{self.launcher.pid}/task/{self.launcher.pid}/children").read_text()
        [self.group] = map(int, children.split())                       # tritonserver, its group's leader
        command = Path(f"/proc/{self.group}/cmdline").read_bytes().split(b"\0")
        [self.shm_prefix] = [a.decode().rpartition("=")[2] for a in command if b"shm-region-prefix-name" in a]
        [self.temp_dir] = [Path(v[len(b"TMPDIR="):].decode()) for v in
                           Path(f"/proc/{self.group}/environ").read_bytes().split(b"\0") if v.startswith(b"TMPDIR=")]

    def processes(self) -> dict[int, str]:
        return group_processes(self.group)

    def leftovers(self) -> list[str]:
        """What is left of this server: processes, /dev/shm regions, its temporary folder."""
        return ([f"process {pid}: {command[:60]}" for pid, command in self.processes().items()]
                + [f"/dev/shm/{p.name}" for p in SHM.glob(self.shm_prefix + "*")]
                + ([str(self.temp_dir)] if self.temp_dir.exists() else []))

    def kill_under_load(self, args, rng: random.Random) -> tuple[int, list[str]]:
        """SIGKILL the launcher while --concurrency long streams are live; (streams live then, what is left after
        tritonserver's exit timeout and the stubs' watch)."""
        live = [threading.Thread(target=one_request, args=(self, "http hung up", random.Random(rng.random()), args),
                                 kwargs={"hang_up": False}, daemon=True) for _ in range(args.concurrency)]
        for thread in live:
            thread.start()
        deadline = time.monotonic() + 60
        while metrics(self)["v4_pending_requests"] < args.concurrency // 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        streams = int(metrics(self)["v4_pending_requests"])
        os.kill(self.launcher.pid, signal.SIGKILL)
        self.launcher.wait()
        deadline = time.monotonic() + 90
        while self.leftovers() and time.monotonic() < deadline:
            time.sleep(0.5)
        return streams, self.leftovers()


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
    p.add_argument("--requests", type=int, default=2000, help="requests sent in all (default 2000)")
    p.add_argument("--concurrency", type=int, default=50, help="requests in flight at once (default 50)")
    p.add_argument("--max-tokens", type=int, default=16, help="at most this many new tokens per request run to its end")
    p.add_argument("--long-tokens", type=int, default=256, help="max_tokens of the requests that are cut")
    p.add_argument("--warmup", type=int, default=100, help="requests before the first RSS reading")
    p.add_argument("--kill-restarts", type=int, default=2, help="servers started by serve.py and killed with SIGKILL "
                   "under load before the last one (0: one server, started in this process)")
    p.add_argument("--seed", type=int, default=0, help="seed of the requests' prompts, lengths and cuts (default 0)")
    p.add_argument("--env", type=Path, default=ROOT / ".venv-triton", help="the serving environment")
    p.add_argument("--work", type=Path, default=Path("/tmp/soak-triton"),
                   help="the engine, the model repository and the server's files (default /tmp/soak-triton)")
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    engine = args.engine or built_engine(ROOT / "examples" / "tiny-v4", args.work)
    # room for every concurrent request: the soak is about what is left behind, not about refusals
    repo = render(engine, args.work / "repo", max_queue_size=args.concurrency, force=True)
    rng = random.Random(args.seed)
    prompt, check_tokens = PROMPTS[0], 24
    [expected] = Generator.from_engine_dir(engine).generate([prompt], SamplingParams(max_new_tokens=check_tokens))
    killed, earlier = [], []         # (streams live, what was left) per kill -9; the requests of the killed servers
    part = args.requests // (args.kill_restarts + 1)
    for restart in range(args.kill_restarts):
        server = Launched(engine, args.work / f"serve-{restart}", args.env, args.concurrency)
        earlier += run(server, part, args, rng)
        killed.append(server.kill_under_load(args, rng))
    last = Launched(engine, args.work / "serve-last", args.env, args.concurrency) if args.kill_restarts else \
        TritonServer(repo, args.env, work_dir=args.work / "server").start()
    try:
        server = last
        warmup = run(server, args.warmup, args, rng)
        before = settled(server)
        rss_before = generate_rss(server)
        started = time.perf_counter()
        requests = run(server, args.requests - len(earlier), args, rng)
        seconds = time.perf_counter() - started
        after = settled(server)
        rss_after = generate_rss(server)
        answer = json.loads(urllib.request.urlopen(urllib.request.Request(
            f"http://{server.http_url}/v2/models/ensemble/generate",
            json.dumps({"text_input": prompt, "max_tokens": check_tokens}).encode()), timeout=TIMEOUT).read())
    finally:
        if isinstance(last, Launched):
            last.launcher.send_signal(signal.SIGTERM)
            last.launcher.wait(120)
        else:
            last.stop()
    growth = rss_after / rss_before - 1
    exact = answer["output_ids"] == expected.token_ids
    outcomes = collections.Counter((kind, outcome) for kind, outcome, _ in earlier + requests)
    errors = collections.Counter((k, o) for k, o, _ in earlier + warmup + requests if o.startswith("error"))
    generated = after["v4_generated_tokens_total"] - before["v4_generated_tokens_total"]
    run_through = sum(asked for kind, _, asked in requests if kind not in CUT)
    cut = sum(asked for kind, _, asked in requests if kind in CUT)
    checks = {"the cut requests stopped early": generated < run_through + cut / 2,
              "v4_pending_requests = 0": after["v4_pending_requests"] == 0,
              "v4_cache_bytes = 0": after["v4_cache_bytes"] == 0,
              "v4_generate RSS grew < 5 %": growth < 0.05,
              "a normal request's tokens = Generator's": exact,
              "no request failed": not errors,
              "nothing left after each kill -9 under load": all(not left for _, left in killed)}

    print(f"engine {engine}; {args.requests} requests, {args.concurrency} concurrent, seed {args.seed}, "
          f"{args.kill_restarts} servers killed under load before the last, which served "
          f"{len(requests)} of them after {args.warmup} warm-up requests\n")
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
    print(f"| normal request after the soak | {'the' if exact else 'NOT the'} Generator's {check_tokens} tokens |")
    for i, (streams, left) in enumerate(killed, 1):
        print(f"| kill -9 of serve.py #{i} | {streams} requests live; left after: {', '.join(left) or 'nothing'} |")
    print()
    for (kind, outcome), n in errors.items():
        print(f"{n} x {kind}: {outcome}")
    for name, ok in checks.items():
        print(f"{'ok    ' if ok else 'FAILED'} {name}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
