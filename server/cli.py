"""v4serve ENGINE_DIR: serve an engine directory with the OpenAI API (server/app.py) on uvicorn.

    v4serve out/engine --port 8000
    curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "engine", "prompt": "def add(a, b):", "max_tokens": 16, "temperature": 0}'
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from v4engine.chat.encoding import EFFORT_PROFILES
from v4engine.contract.errors import V4EngineError
from v4engine.contract.stages import gpu_list
from v4engine.runtime.budget import Limits
from v4engine.runtime.drafters import DRAFTERS
from v4engine.runtime.generator import Generator

from .app import MiB, ServerOptions, create_app

API_KEY_ENV = "V4SERVE_API_KEY"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="v4serve", description="Serve a v4engine engine directory with the OpenAI "
                                "API: /v1/models, /v1/completions, /v1/chat/completions (DeepSeek-V4's chat "
                                "encoding), /tokenize, /detokenize, /health, /metrics.")
    p.add_argument("engine_dir", type=Path, help="engine directory built by v4build (with its tokenizer.json)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine "
                   "only; 0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    p.add_argument("--served-model-name", default=None, help="the model name clients send and /v1/models lists "
                   "(default: the engine directory's name)")
    p.add_argument("--api-key", default=None, help=f"require 'Authorization: Bearer KEY' on /v1 and the tokenizer "
                   f"endpoints (default: ${API_KEY_ENV} if set, else none)")
    p.add_argument("--max-queue-size", type=int, default=64, help="requests that may wait for a batch slot; "
                   "beyond them a request is answered 429 at once (default 64)")
    p.add_argument("--max-batch", type=int, default=None, help="requests generating together (default: the "
                   "engine's build limit)")
    p.add_argument("--drafter", choices=list(DRAFTERS), default=None, help="drafting method (default: the "
                   "engine's own draft graph's)")
    p.add_argument("--mtp", type=int, default=None, help="draft tokens per step, 0 (no drafting) to what the "
                   "drafter makes (default: the engine's k)")
    p.add_argument("--devices", default=None, help="GPU of each pipeline stage, comma-separated, e.g. 0,1 for an "
                   "engine built with --pipeline-stages 2 (default: where the backend runs by default)")
    p.add_argument("--no-prefix-cache", action="store_true", help="compute every prompt whole instead of reusing "
                   "the caches of an earlier prompt's prefix (the tokens are the same either way)")
    p.add_argument("--chat-profile", choices=list(EFFORT_PROFILES), default=None, help="the release whose "
                   "reasoning efforts the chat encoding renders: 0731 (V4-Flash-0731, low/high/max) or preview "
                   "(the first V4 releases, high/max); default: the one engine.json names (read from the "
                   "checkpoint's encoding/encoding_dsv4.py at build time), else 0731")
    p.add_argument("--report-prefix-hits", action="store_true", help="report usage.prompt_tokens_details."
                   "cached_tokens (off by default: a client could learn from it what others sent)")
    p.add_argument("--max-body-bytes", type=int, default=16 * MiB, help="largest request body accepted, in "
                   "bytes (default 16 MiB)")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default warning)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    for name, low, high in (("port", 0, 65535), ("max_queue_size", 0, None), ("max_body_bytes", 1, None)):
        value = getattr(args, name)
        if value < low or (high is not None and value > high):
            print(f"v4serve: --{name.replace('_', '-')} must be from {low}{f' to {high}' if high else ' up'} (got "
                  f"{value})", file=sys.stderr)
            return 2
    try:
        import uvicorn

        devices = gpu_list(args.devices, "--devices") if args.devices is not None else None
        generator = Generator.from_engine_dir(args.engine_dir, drafter=args.drafter, mtp=args.mtp, devices=devices,
                                              limits=Limits(max_batch=args.max_batch), own_process=True,
                                              prefix_cache=not args.no_prefix_cache)
        options = ServerOptions(model_name=args.served_model_name or args.engine_dir.resolve().name,
                                max_queue_size=args.max_queue_size,
                                api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
                                chat_profile=args.chat_profile or generator.chat_profile,
                                report_prefix_hits=args.report_prefix_hits,
                                max_body_bytes=args.max_body_bytes)
        app = create_app(generator, options)
    except V4EngineError as e:
        print(f"v4serve: {e}", file=sys.stderr)
        return 1
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
