"""The slice against llama.cpp on this CPU: decode tokens/s, time to first token, memory, and logit agreement.

llama.cpp runs DeepSeek-V4 (architecture `deepseek4`) through its converter, which takes the release layout as
it is: FP8 block weights dequantized to the output type, MXFP4 routed experts repacked byte for byte into GGUF's
MXFP4. Both sides here read the same checkpoint, `v4build make-tiny --config slice --quantize mxfp4 --dtype
bfloat16` (hidden 1024; a sliding, a CSA and an HCA layer; 64 experts top-6), and run batch 1, greedy, two threads:
- llama.cpp through llama-cpp-python (its sdist vendors llama.cpp; built here once with -DGGML_NATIVE=ON in a
  venv of its own under --work: about ten minutes on two cores), the GGUF made by the converter it vendors
  (`--outtype bf16`, llama.cpp's own recipe for V4 before quantizing; the tiny tokenizer is not one llama.cpp
  knows, so the converter is told what it needs of it, see CONVERT: only token ids are fed here);
- v4engine MTP 0 (the target alone, as llama.cpp decodes), own_process=True as v4generate runs it.
llama.cpp runs without its CPU weight repacking (`use_extra_bufts = False`): with it, 0.3.36 computes the grouped
output projection wo_a (a 3-D Q8_0 weight) wrongly on this checkpoint (layer 0's attention output correlates 0.33
with the reference, everything before it agrees) and aborts on graphs of more than one token
(`GGML_ASSERT(*cur_backend_id != -1)`, ggml-backend.cpp). `--repack` measures it anyway, one token at a time.
Each system runs in a process of its own (resident memory is that process's), the rounds interleaved. llama.cpp
is fed v4engine's greedy tokens (teacher forcing: the same calls as its own greedy decode), so each position
compares the two on the same context: the log-probability of v4engine's token under each, and llama.cpp's argmax.

    .venv/bin/python -m benchmarks.bench_llamacpp --work /work/scratch/llama
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
from pathlib import Path

from benchmarks import built_engine
from v4engine.builder.tiny import make_tiny

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"

# Both children print one JSON line: per prompt the seconds to the first token and of the decode after it, the
# tokens, the log-probabilities; and the process's resident memory after load and at its peak (MiB).
MEMORY = """
def memory():
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {k: int(status[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM")}
"""

OURS = MEMORY + """
import json, sys, time
from v4engine.runtime import Generator, SamplingParams
engine, threads, prompts, new = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4])
generator = Generator.from_engine_dir(engine, mtp=0, prefix_cache=False, own_process=True,
                                      backend_options={"threads": threads})
loaded = memory()
generator.generate([prompts[0][:16]], SamplingParams(max_new_tokens=4, ignore_eos=True))      # warm-up, untimed
runs = []
for prompt in prompts:
    started = time.perf_counter()
    [result] = generator.generate([prompt], SamplingParams(max_new_tokens=new, ignore_eos=True, logprobs=0))
    seconds = time.perf_counter() - started
    first = result.metrics["time_to_first_token"]
    runs.append({"ttft": first, "decode": seconds - first, "tokens": result.token_ids,
                 "logprobs": [t.logprob for t in result.logprobs]})
print(json.dumps({"loaded": loaded, "end": memory(), "runs": runs}))
"""

LLAMA = MEMORY + """
import json, sys, time
import numpy as np
import llama_cpp.llama_cpp as api
from llama_cpp import Llama
gguf, threads, prompts, forced = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), json.loads(sys.argv[4])
repack = sys.argv[5] == "repack"
context = max(len(p) + len(t) for p, t in zip(prompts, forced)) + 8
defaults = api.llama_model_default_params

def model_params():                                 # what Llama() starts from, repacking as asked
    params = defaults()
    params.use_extra_bufts = repack
    return params

api.llama_model_default_params = model_params
batch = 1 if repack else 512
llm = Llama(model_path=gguf, n_ctx=context, n_batch=batch, n_ubatch=batch, n_threads=threads,
            n_threads_batch=threads, verbose=False)
loaded = memory()

def log_softmax():                                  # of the last position's logits
    row = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).astype(np.float64)
    return row - row.max() - np.log(np.exp(row - row.max()).sum())

llm.eval(prompts[0][:16]); llm.reset()                                                       # warm-up, untimed
runs = []
for prompt, tokens in zip(prompts, forced):
    llm.reset()
    started = time.perf_counter()
    llm.eval(prompt)
    rows = [log_softmax()]
    first = time.perf_counter() - started
    for token in tokens[:-1]:                       # v4engine's tokens fed back: the calls of a greedy decode
        llm.eval([token])
        rows.append(log_softmax())
    seconds = time.perf_counter() - started
    runs.append({"ttft": first, "decode": seconds - first, "tokens": [int(r.argmax()) for r in rows],
                 "logprobs": [float(r[t]) for r, t in zip(rows, tokens)]})
print(json.dumps({"loaded": loaded, "end": memory(), "runs": runs}))
"""


def llama_python(work: Path) -> Path:
    """work/llama-venv's Python with llama-cpp-python built from its sdist (once), and the sdist's llama.cpp."""
    venv, sdist = work / "llama-venv", work / "sdist"
    python = venv / "bin" / "python"
    if not any(sdist.glob("llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py")):
        subprocess.run([sys.executable, "-m", "pip", "download", LLAMA_CPP_PYTHON, "--no-binary", ":all:",
                        "--no-deps", "-d", str(sdist)], check=True)
        with tarfile.open(next(sdist.glob("llama_cpp_python-*.tar.gz"))) as archive:
            archive.extractall(sdist, filter="data")
    if subprocess.run([str(python), "-c", "import llama_cpp"], capture_output=True).returncode != 0:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        print("building llama-cpp-python (llama.cpp, -DGGML_NATIVE=ON): about ten minutes on two cores", flush=True)
        subprocess.run([str(python), "-m", "pip", "install", "numpy", str(next(sdist.glob("llama_cpp_python-*/")))],
                       check=True, env=os.environ | {"CMAKE_ARGS": "-DGGML_NATIVE=ON -DLLAMA_CURL=OFF",
                                                     "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count())})
    return python


# The converter, told two things about the tiny tokenizer (a word-level vocabulary llama.cpp does not know): its
# pre-tokenizer is DeepSeek-V3's, and it has one merge (llama.cpp's BPE loader needs the key). Only token ids are
# fed to llama.cpp here, so neither changes anything measured.
CONVERT = """
import json, runpy, sys
from pathlib import Path
root, checkpoint = Path(sys.argv.pop(1)), Path(sys.argv[1])
sys.path[:0] = [str(root), str(root / "gguf-py")]
import conversion.base, gguf
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "deepseek-v3"
words = [w for w in json.loads((checkpoint / "tokenizer.json").read_text())["model"]["vocab"] if w.isalnum()]
add_to_gguf = gguf.SpecialVocab.add_to_gguf
def with_a_merge(self, writer, quiet=False):
    self.merges = self.merges or [f"{words[0]} {words[1]}"]
    return add_to_gguf(self, writer, quiet)
gguf.SpecialVocab.add_to_gguf = with_a_merge
runpy.run_path(str(root / "convert_hf_to_gguf.py"), run_name="__main__")
"""


def converted(checkpoint: Path, work: Path) -> Path:
    """work/slice-bf16.gguf, made by the converter the sdist vendors (with this process's torch)."""
    gguf = work / "slice-bf16.gguf"
    if not gguf.is_file():
        root = next((work / "sdist").glob("llama_cpp_python-*/vendor/llama.cpp"))
        subprocess.run([sys.executable, "-c", CONVERT, str(root), str(checkpoint), "--outtype", "bf16",
                        "--outfile", str(gguf)], check=True)
    return gguf


def child(python: Path | str, script: str, *args: object) -> dict:
    done = subprocess.run([str(python), "-c", script, *map(str, args)], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"a benchmark child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, required=True, help="checkpoint, engine, llama.cpp build and GGUF go here")
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2, help="threads of each system")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians are reported")
    p.add_argument("--repack", action="store_true",
                   help="llama.cpp with its CPU weight repacking (wrong on this checkpoint in 0.3.36; batch of one)")
    args = p.parse_args()
    checkpoint = args.work / "slice"
    if not (checkpoint / "config.json").is_file():
        make_tiny(checkpoint, config="slice", quantize="mxfp4", dtype="bfloat16")
    engine = built_engine(checkpoint, args.work, mtp=0, name="engine-mtp0")
    python = llama_python(args.work)
    gguf = converted(checkpoint, args.work)
    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    import numpy as np
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, vocab, args.prompt_tokens).tolist() for _ in range(args.prompts)]
    ours, theirs = [], []
    for _ in range(args.rounds):
        ours.append(child(sys.executable, OURS, engine, args.threads, json.dumps(prompts), args.new_tokens))
        forced = [run["tokens"] for run in ours[0]["runs"]]
        theirs.append(child(python, LLAMA, gguf, args.threads, json.dumps(prompts), json.dumps(forced),
                            "repack" if args.repack else "plain"))
    report(ours, theirs, args)


def report(ours: list[dict], theirs: list[dict], args: argparse.Namespace) -> None:
    def decode_rate(result: dict) -> float:
        return sum(len(r["tokens"]) - 1 for r in result["runs"]) / sum(r["decode"] for r in result["runs"])

    def ttft_ms(result: dict) -> float:
        return 1000 * statistics.mean(r["ttft"] for r in result["runs"])

    print(f"\nslice, batch 1, greedy, {args.threads} threads, {args.prompts} prompts of {args.prompt_tokens} random "
          f"tokens, {args.new_tokens} new each; medians of {args.rounds} interleaved rounds\n")
    print("| system | decode tokens/s | time to first token | RSS after load | peak RSS |\n|---|---|---|---|---|")
    llama = "llama.cpp (llama-cpp-python 0.3.36" + (", repacked weights, batch of 1)" if args.repack else ")")
    rows = {"v4engine MTP 0 (ONNX Runtime)": ours, llama: theirs}
    rates = {}
    for name, results in rows.items():
        rates[name] = statistics.median(decode_rate(r) for r in results)
        print(f"| {name} | {rates[name]:.1f} | {statistics.median(ttft_ms(r) for r in results):.0f} ms | "
              f"{statistics.median(r['loaded']['VmRSS'] for r in results):.0f} MiB | "
              f"{statistics.median(r['end']['VmHWM'] for r in results):.0f} MiB |")
    mine, other = rates.values()
    print(f"\nllama.cpp / v4engine decode: {other / mine:.2f}x")
    ours_lp = [lp for run in ours[0]["runs"] for lp in run["logprobs"]]
    theirs_lp = [lp for run in theirs[0]["runs"] for lp in run["logprobs"]]
    gaps = [abs(a - b) for a, b in zip(ours_lp, theirs_lp)]
    same = sum(a == b for run_a, run_b in zip(ours[0]["runs"], theirs[0]["runs"])
               for a, b in zip(run_a["tokens"], run_b["tokens"]))
    total = sum(len(run["tokens"]) for run in ours[0]["runs"])
    print(f"agreement on v4engine's greedy continuation: llama.cpp's argmax is v4engine's token at {same}/{total} "
          f"positions; |log p(token)| differs by {statistics.median(gaps):.4f} (median), {max(gaps):.4f} (max)")


if __name__ == "__main__":
    main()
