"""Serve an engine with Triton: render its model repository and start the server that nvidia-pytriton bundles.

    .venv/bin/python examples/triton/serve.py [ENGINE_DIR] [--work out/triton] [--http-port 8000] [--drafter NAME]
        [--max-queue-size N]

Without ENGINE_DIR it builds the shipped trained tiny V4 (examples/tiny-v4, --mtp 3) into WORK/engine first. The
server runs until Ctrl-C, SIGTERM or SIGHUP, each of which stops it and every process it started, and frees its
shared memory (v4engine.triton_repo.server); if this launcher is killed outright, tritonserver gets SIGTERM and
stops the same way. Its addresses are printed and written to WORK/server.json for query.py.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

from v4engine.builder.cli import main as v4build
from v4engine.contract.errors import V4EngineError
from v4engine.runtime.drafters import DRAFTERS
from v4engine.triton_repo import render
from v4engine.triton_repo.server import TritonServer

ROOT = Path(__file__).resolve().parents[2]
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def stop_on_signal(signum: int, frame) -> None:
    """Leave through `with`, which stops the server; a second signal must not cut that stop short."""
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    raise SystemExit(0)


def main() -> None:
    p = argparse.ArgumentParser(description="Render the Triton repository for an engine and serve it.")
    p.add_argument("engine", type=Path, nargs="?", help="engine directory (default: build examples/tiny-v4)")
    p.add_argument("--work", type=Path, default=ROOT / "out" / "triton", help="repository, engine and server log")
    p.add_argument("--env", type=Path, default=ROOT / ".venv-triton", help="the serving environment "
                   "(`make triton-env`)")
    p.add_argument("--http-port", type=int, default=None, help="HTTP port on 127.0.0.1 (default: a free one; "
                   "gRPC and metrics always take free ones: see WORK/server.json)")
    p.add_argument("--max-queue-size", type=int, default=32, help="requests that may wait for a batch slot; beyond "
                   "that a request is refused at once (default 32)")
    p.add_argument("--drafter", choices=list(DRAFTERS), default=None, help="drafting method (default: the engine's "
                   "own; prompt_lookup: n-grams of each request's context, on any engine)")
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    engine = args.engine or args.work / "engine"
    if args.engine is None and not (engine / "engine.json").is_file():
        v4build(["--checkpoint", str(ROOT / "examples" / "tiny-v4"), "--mtp", "3", "--output", str(engine)])
    repo = render(engine, args.work / "repo", drafter=args.drafter, max_queue_size=args.max_queue_size, force=True)
    with TritonServer(repo, args.env, work_dir=args.work / "server", http_port=args.http_port) as server:
        urls = {"http": server.http_url, "grpc": server.grpc_url, "metrics": server.metrics_url}
        (args.work / "server.json").write_text(json.dumps(urls))
        print(f"serving {engine}: HTTP {urls['http']}, gRPC {urls['grpc']}, metrics {urls['metrics']} "
              f"(log: {server.log_path}); Ctrl-C stops", flush=True)
        while True:
            signal.pause()                              # until a stop signal leaves `with`


if __name__ == "__main__":
    for s in STOP_SIGNALS:
        signal.signal(s, stop_on_signal)
    try:
        main()
    except V4EngineError as e:                  # one line, never a traceback (a folder without a tokenizer, ...)
        sys.exit(f"serve.py: error: {e}")
