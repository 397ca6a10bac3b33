"""Query the served ensemble three ways: HTTP generate, HTTP generate_stream, and a gRPC stream.

    .venv/bin/python examples/triton/query.py ["a prompt"] [--server out/triton/server.json]
"""
from __future__ import annotations

import argparse
import http.client
import json
import queue
import urllib.request
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    p = argparse.ArgumentParser(description="Query the v4engine ensemble served by serve.py.")
    p.add_argument("prompt", nargs="?", default="def fibonacci(n):", help="the text continued (default: %(default)r)")
    p.add_argument("--server", type=Path, default=ROOT / "out" / "triton" / "server.json",
                   help="the server.json serve.py wrote, which names its ports (default out/triton/server.json)")
    args = p.parse_args()
    urls = json.loads(args.server.read_text())
    body = {"text_input": args.prompt, "max_tokens": 48}

    # 1. HTTP generate: one JSON answer with the text, the ids and the acceptance metrics
    request = urllib.request.Request(f"http://{urls['http']}/v2/models/ensemble/generate", json.dumps(body).encode())
    answer = json.loads(urllib.request.urlopen(request).read())
    metrics = json.loads(answer["metrics"])
    print(f"generate: {args.prompt}{answer['text_output']}\n  finish {answer['finish_reason']}, acceptance rate "
          f"{metrics['acceptance_rate']:.2f}, mean acceptance length {metrics['mean_acceptance_length']:.2f}, "
          f"time to first token {1000 * metrics['time_to_first_token']:.1f} ms\n")

    # 2. HTTP generate_stream: server-sent events, one per engine step (1..k+1 tokens each)
    connection = http.client.HTTPConnection(urls["http"])
    connection.request("POST", "/v2/models/ensemble/generate_stream", json.dumps({**body, "stream": True}))
    print("generate_stream: " + args.prompt, end="")
    for line in connection.getresponse():
        if line.startswith(b"data: "):
            print(json.loads(line[6:])["text_output"], end="", flush=True)
    print("\n")

    # 3. gRPC streaming (tritonclient): the token ids of each step
    def tensor(name, value, dtype):
        t = grpcclient.InferInput(name, [1], dtype)
        t.set_data_from_numpy(np.array([value], dtype=object if dtype == "BYTES" else None))
        return t

    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(urls["grpc"])
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    client.async_stream_infer("ensemble", [tensor("text_input", args.prompt.encode(), "BYTES"),
                                           tensor("max_tokens", np.int32(48), "INT32"), tensor("stream", True, "BOOL")],
                              enable_empty_final_response=True)
    print("gRPC stream, token ids per step:")
    while True:
        result, error = answers.get()
        if error is not None:
            raise SystemExit(error)
        if result.get_response().outputs:
            print(" ", result.as_numpy("output_ids").tolist())
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
    client.stop_stream()


if __name__ == "__main__":
    main()
