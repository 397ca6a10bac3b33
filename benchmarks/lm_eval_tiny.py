"""lm-evaluation-harness against v4serve, offline, on tasks made from the tiny V4's held-out Python.

Two tasks, written as lm-eval task files with local JSONL data (no download):
- tiny_python_next_line (generate_until, exact_match): six lines of a held-out standard-library file and the next
  line's indentation but its last space, then the model writes the rest of the line (until a newline); scored
  against the file's own.
- tiny_python_choice (multiple_choice, acc): the same context; the file's next line against three lines taken
  from other files, by loglikelihood (lm-eval sends echo + logprobs and sums the continuation's logprobs).

lm-eval talks to the server as `local-completions`, with the server's own tokenizer (/tokenizer_info, /tokenize),
token-id prompts and greedy generation; and as `local-chat-completions` (--apply_chat_template) for the generation
task, each context a user message encoded with V4's chat encoding (so a model that never saw that encoding, as the
tiny one, scores what it scores). Both tasks' scores must be the same at every --mtp: speculative decoding
is lossless.

    python -m benchmarks.lm_eval_tiny --engine out/tiny-v4 --mtp 0 3 --limit 100 --work /tmp/lm-eval-tiny
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from v4engine.testkit.corpus import stdlib_split
from v4engine.triton_repo.server import free_ports

CONTEXT_LINES = 6
TASKS = ("tiny_python_next_line", "tiny_python_choice")


def documents(count: int, seed: int = 0) -> list[dict]:
    """One document per held-out file (in path order) while any is left: a context of CONTEXT_LINES non-blank
    lines and the line after them (8 to 80 characters, code rather than a comment), at a seeded place."""
    rng = random.Random(seed)
    docs = []
    for path in stdlib_split()[1]:
        lines = [line.rstrip() for line in path.read_text(encoding="utf-8", errors="replace").splitlines()]
        starts = [i for i in range(len(lines) - CONTEXT_LINES) if all(lines[i: i + CONTEXT_LINES])
                  and 8 <= len(lines[i + CONTEXT_LINES].strip()) <= 80
                  and not lines[i + CONTEXT_LINES].strip().startswith("#")]
        if starts:
            i = rng.choice(starts)
            line = lines[i + CONTEXT_LINES]
            # the context ends inside the indentation: byte-level BPE writes its last space with the code's first
            # word (" return"), so a context ending after every space would ask for a token split never trained
            cut = max(len(line) - len(line.lstrip()) - 1, 0)
            docs.append({"context": "\n".join(lines[i: i + CONTEXT_LINES]) + "\n" + line[:cut],
                         "target": line[cut:]})
        if len(docs) == count:
            break
    for n, doc in enumerate(docs):                 # three distractors from other documents, the answer placed
        others = rng.sample([d["target"] for m, d in enumerate(docs) if m != n and d["target"] != doc["target"]], 3)
        label = rng.randrange(4)
        doc["choices"] = others[:label] + [doc["target"]] + others[label:]
        doc["label"] = label
    return docs


def write_tasks(folder: Path, count: int) -> Path:
    """The two tasks' YAML files and their data in `folder`; returns it (lm-eval's --include_path)."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "tiny_python.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in documents(count)), encoding="utf-8")
    common = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
              "doc_to_text: \"{{context}}\"\n")
    (folder / "tiny_python_next_line.yaml").write_text(
        "task: tiny_python_next_line\n" + common + "output_type: generate_until\ndoc_to_target: \"{{target}}\"\n"
        "target_delimiter: \"\"\ngeneration_kwargs:\n  until: [\"\\n\"]\n  do_sample: false\n  temperature: 0.0\n"
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
        "metadata:\n  version: 1.0\n", encoding="utf-8")
    (folder / "tiny_python_choice.yaml").write_text(
        "task: tiny_python_choice\n" + common + "output_type: multiple_choice\ndoc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: \"{{label}}\"\ntarget_delimiter: \"\"\nmetric_list:\n  - metric: acc\n"
        "    aggregation: mean\n    higher_is_better: true\nmetadata:\n  version: 1.0\n", encoding="utf-8")
    return folder


def serve(engine: Path, mtp: int, port: int, *flags: str) -> subprocess.Popen:
    """v4serve on `engine` at `port` (with v4serve's `flags`), once /health answers."""
    process = subprocess.Popen([sys.executable, "-m", "v4engine.server.cli", str(engine), "--port", str(port),
                                "--mtp", str(mtp), "--served-model-name", "tiny-v4", *flags],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"v4serve exited: {process.stderr.read()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                return process
        except OSError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError("v4serve did not come up in 180 s")


def evaluate(port: int, tasks: Path, out: Path, limit: int | None, chat: bool = False) -> dict[str, dict]:
    """lm-eval's results per task (its metrics), run offline against the server at `port`: as
    `local-completions` (both tasks), or with `chat` as `local-chat-completions` (the generation task: lm-eval's
    chat client has no loglikelihood), each context sent as a user message through V4's chat encoding."""
    if chat:
        client = ["--model", "local-chat-completions", "--model_args",
                  f"model=tiny-v4,base_url=http://127.0.0.1:{port}/v1/chat/completions,num_concurrent=1,"
                  "max_retries=1,max_gen_toks=48", "--apply_chat_template", "--tasks", TASKS[0]]
    else:
        client = ["--model", "local-completions", "--model_args",
                  f"model=tiny-v4,base_url=http://127.0.0.1:{port}/v1/completions,num_concurrent=1,max_retries=1,"
                  "max_gen_toks=48,max_length=4096,tokenized_requests=True", "--tasks", ",".join(TASKS)]
    args = [sys.executable, "-m", "lm_eval", "run", *client, "--include_path", str(tasks), "--batch_size", "1",
            "--output_path", str(out)]
    if limit is not None:
        args += ["--limit", str(limit)]
    env = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(out / "datasets-cache"), **os.environ}
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"lm_eval failed ({done.returncode}): {done.stderr[-2000:]}")
    [result] = sorted(out.rglob("results_*.json"), key=lambda p: p.stat().st_mtime)[-1:]
    return json.loads(result.read_text())["results"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", type=Path, required=True, help="engine directory of the trained tiny V4")
    p.add_argument("--mtp", type=int, nargs="+", default=[0, 3], help="draft tokens per step to compare")
    p.add_argument("--limit", type=int, default=None, help="documents per task (default: all)")
    p.add_argument("--documents", type=int, default=200, help="documents written per task (default 200)")
    p.add_argument("--work", type=Path, default=Path("lm-eval-tiny"), help="tasks, data and lm-eval's output")
    args = p.parse_args(argv)
    tasks = write_tasks(args.work / "tasks", args.documents)
    scores = {}
    for mtp in args.mtp:
        [port] = free_ports(1)
        server = serve(args.engine, mtp, port)
        try:
            start = time.perf_counter()
            results = evaluate(port, tasks, args.work / f"out-mtp{mtp}", args.limit)
            seconds = time.perf_counter() - start
            chat = evaluate(port, tasks, args.work / f"out-chat-mtp{mtp}", args.limit, chat=True)
            results["chat " + TASKS[0]] = chat[TASKS[0]]
        finally:
            server.terminate()
            server.wait(30)
        scores[mtp] = {task: {k: v for k, v in metrics.items() if isinstance(v, float)} for task, metrics in
                       results.items()}
        print(f"MTP {mtp} ({seconds:.0f} s): {json.dumps(scores[mtp])}")
    first = scores[args.mtp[0]]
    print("identical across --mtp:", all(s == first for s in scores.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
