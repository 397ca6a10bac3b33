"""The slice against llama.cpp and transformers on this CPU: decode tokens/s, time to first token, memory, and
agreement with transformers.

llama.cpp runs DeepSeek-V4 (architecture `deepseek4`) through its converter, which takes the release layout as
it is: FP8 block weights written as Q8_0 (whatever `--outtype` says), MXFP4 routed experts repacked byte for byte
into GGUF's MXFP4. All read the same checkpoint, `v4build make-tiny --config slice --quantize mxfp4 --dtype
bfloat16` (hidden 1024; a sliding, a CSA and an HCA layer; 64 experts top-6), and run batch 1, greedy, two threads:
- transformers eager (5.23, the oracle), on an fp32 copy of the target dequantized as the engine dequantizes it;
- v4engine MTP 0 (the target alone, as llama.cpp decodes), own_process=True as v4generate runs it, twice: with its
  dense FP8 and bf16 projections reading the stored bytes in v4engine's kernels (the default,
  runtime/sessions/stored_weights.py), and on ONNX Runtime's stock kernels over float32 weights (`stored_weights`
  off), so the kernels' gain is measured in the same run;
- llama.cpp through llama-cpp-python (its sdist vendors llama.cpp; built here once with -DGGML_NATIVE=ON in a
  venv of its own under --work: about ten minutes on two cores), flash attention off (its default), twice:
  - exact: a GGUF of F32 weights throughout, converted (`--outtype f32`) from the same dequantized fp32 copy in the
    release's names, so nothing is rounded (llama.cpp's exact path);
  - its default GGUF: the release layout converted `--outtype bf16` (FP8 as Q8_0, experts MXFP4, the rest bf16);
  the tiny tokenizer is not one llama.cpp knows, so the converter is told what it needs of it (see CONVERT: only
  token ids are fed here).
llama.cpp runs without its CPU weight repacking (`use_extra_bufts = False`): with it, 0.3.36 computes the grouped
output projection wo_a (a 3-D Q8_0 weight) wrongly on this checkpoint (layer 0's attention output correlates 0.33
with the reference, everything before it agrees) and aborts on graphs of more than one token
(`GGML_ASSERT(*cur_backend_id != -1)`, ggml-backend.cpp). `--repack` measures its default GGUF that way anyway,
one token at a time. Each system runs in a process of its own (resident memory is that process's), the rounds
interleaved. llama.cpp is fed v4engine's greedy tokens (teacher forcing: the same calls as its own greedy decode),
and transformers computes the same positions in one forward, so each position compares every system on the same
context: the log-probability of v4engine's token under each against transformers', and each one's argmax.

    .venv/bin/python -m benchmarks.bench_llamacpp --work /work/scratch/llama
    .venv/bin/python -m benchmarks.bench_llamacpp --work /work/scratch/llama --prompt-tokens 4000 --prompts 2 \
        --rounds 2                                          # at 4K context (the slice's engine holds 4,096)
    .venv/bin/python -m benchmarks.bench_llamacpp --work /work/scratch/tiny-v4 --checkpoint examples/tiny-v4 \
        --without-llama                                     # llama.cpp's deepseek4 refuses tiny-v4's ratio 16

A disagreement far above rounding is worth a look with benchmarks/topk_ties.py (`--save` a run for it).
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
from v4engine.runtime.sessions import stored_weights
from v4engine.testkit import oracle

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"

# Every child prints one JSON line: per prompt the seconds to the first token and of the decode after it, the
# tokens (its argmax at each position), the log-probabilities of v4engine's tokens; and the process's resident
# memory after load and at the end, with its peak (MiB).
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
                                      backend_options={"threads": threads, "stored_weights": sys.argv[5] == "stored"})
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

TRANSFORMERS = MEMORY + """
import json, sys, time
import torch
from v4engine.testkit import oracle
checkpoint, threads, prompts, forced = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), json.loads(sys.argv[4])
torch.set_num_threads(threads)
model = oracle.load_transformers(checkpoint)
loaded = memory()

class FirstToken:                                   # a streamer noting when the first new token arrives
    def __init__(self):
        self.puts, self.at = 0, None
    def put(self, value):
        self.puts += 1
        if self.puts == 2:
            self.at = time.perf_counter()
    def end(self):
        pass

with torch.no_grad():
    model.generate(torch.tensor([prompts[0][:16]]), max_new_tokens=4, do_sample=False)       # warm-up, untimed
runs = []
for prompt, tokens in zip(prompts, forced):
    clock = FirstToken()
    started = time.perf_counter()
    with torch.no_grad():
        model.generate(torch.tensor([prompt]), max_new_tokens=len(tokens), do_sample=False, streamer=clock)
    seconds = time.perf_counter() - started
    logits = oracle.transformers_logits(model, torch.tensor([prompt + tokens[:-1]]))[0, len(prompt) - 1:]
    rows = torch.log_softmax(logits.double(), -1)   # untimed: the positions of v4engine's tokens, in one forward
    runs.append({"ttft": clock.at - started, "decode": seconds - (clock.at - started),
                 "tokens": rows.argmax(-1).tolist(), "logprobs": rows[range(len(tokens)), tokens].tolist()})
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
    if not python.is_file() or subprocess.run([str(python), "-c", "import llama_cpp"], capture_output=True).returncode:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        print("building llama-cpp-python (llama.cpp, -DGGML_NATIVE=ON): about ten minutes on two cores", flush=True)
        subprocess.run([str(python), "-m", "pip", "install", "numpy", str(next(sdist.glob("llama_cpp_python-*/")))],
                       check=True, env=os.environ | {"CMAKE_ARGS": "-DGGML_NATIVE=ON -DLLAMA_CURL=OFF",
                                                     "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count())})
    return python


# The converter, told three things: about the tiny tokenizer (a word-level vocabulary llama.cpp does not know), that
# its pre-tokenizer is DeepSeek-V3's and that it has one merge (llama.cpp's BPE loader needs the key): only token
# ids are fed to llama.cpp here, so neither changes anything measured; and, for the exact GGUF, that routed experts
# stored as plain floats are written as they are (F32, stacked per layer as its MXFP4 ones are): the converter
# otherwise takes MXFP4 experts only.
CONVERT = """
import json, runpy, sys
from pathlib import Path
import numpy as np
root, checkpoint = Path(sys.argv.pop(1)), Path(sys.argv[1])
sys.path[:0] = [str(root), str(root / "gguf-py")]
import conversion.base, conversion.deepseek, gguf
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "deepseek-v3"
words = [w for w in json.loads((checkpoint / "tokenizer.json").read_text())["model"]["vocab"] if w.isalnum()]
add_to_gguf = gguf.SpecialVocab.add_to_gguf
def with_a_merge(self, writer, quiet=False):
    self.merges = self.merges or [f"{words[0]} {words[1]}"]
    return add_to_gguf(self, writer, quiet)
gguf.SpecialVocab.add_to_gguf = with_a_merge
V4 = conversion.deepseek.DeepseekV4Model
write_mxfp4 = V4._write_mxfp4_expert_tensor
def write_experts(self, bid, proj, tensor_key):
    names = [f"layers.{bid}.ffn.experts.{e}.{proj}.weight" for e in range(self.hparams["n_routed_experts"])]
    if names[0].replace(".weight", ".scale") in self.model_tensors:
        return write_mxfp4(self, bid, proj, tensor_key)
    eager = conversion.base.LazyTorchTensor.to_eager
    data = np.stack([eager(self.model_tensors[name]()).float().numpy() for name in names])
    self.gguf_writer.add_tensor(self.format_tensor_name(tensor_key, bid), data)
    return names
V4._write_mxfp4_expert_tensor = write_experts
runpy.run_path(str(root / "convert_hf_to_gguf.py"), run_name="__main__")
"""


def converted(checkpoint: Path, gguf: Path, outtype: str) -> Path:
    """`gguf`, made from `checkpoint` by the converter the sdist vendors (with this process's torch)."""
    if not gguf.is_file():
        root = next((gguf.parent / "sdist").glob("llama_cpp_python-*/vendor/llama.cpp"))
        subprocess.run([sys.executable, "-c", CONVERT, str(root), str(checkpoint), "--outtype", outtype,
                        "--outfile", str(gguf)], check=True)
    return gguf


def copy(checkpoint: Path, out: Path, names: str) -> Path:
    """out: the target dequantized to fp32 as the engine dequantizes it (testkit.oracle), made once."""
    if not (out / "config.json").is_file():
        oracle.transformers_copy(checkpoint, out, names=names)
    return out


def child(python: Path | str, script: str, *args: object) -> dict:
    done = subprocess.run([str(python), "-c", script, *map(str, args)], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"a benchmark child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, required=True, help="checkpoint, engine, llama.cpp build and GGUF go here")
    p.add_argument("--prompts", type=int, default=3, help="random prompts, each run by every system (default 3)")
    p.add_argument("--prompt-tokens", type=int, default=200, help="tokens of each prompt (default 200)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens decoded per prompt (default 64)")
    p.add_argument("--threads", type=int, default=2, help="threads of each system")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians are reported")
    p.add_argument("--repack", action="store_true",
                   help="llama.cpp with its CPU weight repacking (wrong on this checkpoint in 0.3.36; batch of one)")
    p.add_argument("--checkpoint", type=Path,
                   help="another checkpoint than the slice (which is made in --work), e.g. examples/tiny-v4")
    p.add_argument("--without-llama", action="store_true",
                   help="transformers and v4engine only: for checkpoints llama.cpp does not load (its deepseek4 "
                        "takes compress ratios 0, 4 and 128 only; tiny-v4 compresses by 16)")
    p.add_argument("--save", type=Path,
                   help="also write the prompts and every system's tokens and log-probs here as JSON (what "
                        "benchmarks/topk_ties.py reads)")
    args = p.parse_args()
    kernels = stored_weights.library()
    if isinstance(kernels, str):            # the "weights read as stored" rows would silently be the stock path
        raise SystemExit(f"bench_llamacpp: {kernels}")
    checkpoint = args.checkpoint or args.work / "slice"
    if not (checkpoint / "config.json").is_file():
        make_tiny(checkpoint, config="slice", quantize="mxfp4", dtype="bfloat16")
    engine = built_engine(checkpoint, args.work, mtp=0, name="engine-mtp0")
    ggufs = {}
    if not args.without_llama:
        python = llama_python(args.work)
        exact = copy(checkpoint, args.work / f"{checkpoint.name}-f32", "official")
        ggufs = {"exact": converted(exact, args.work / f"{checkpoint.name}-f32.gguf", "f32"),
                 "default": converted(checkpoint, args.work / f"{checkpoint.name}-bf16.gguf", "bf16")}
    hf = copy(checkpoint, args.work / f"{checkpoint.name}-hf", "hf")
    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    import numpy as np
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, vocab, args.prompt_tokens).tolist() for _ in range(args.prompts)]
    results: dict[str, list[dict]] = {name: [] for name in SYSTEMS if ggufs or "llama" not in name}
    for _ in range(args.rounds):
        for name, kernels in (("v4engine", "stored"), ("v4engine stock", "stock")):
            results[name].append(child(sys.executable, OURS, engine, args.threads, json.dumps(prompts),
                                       args.new_tokens, kernels))
        forced = json.dumps([run["tokens"] for run in results["v4engine"][0]["runs"]])
        results["transformers"].append(child(sys.executable, TRANSFORMERS, hf, args.threads, json.dumps(prompts),
                                             forced))
        for kind, gguf in ggufs.items():
            results[f"llama.cpp {kind}"].append(child(python, LLAMA, gguf, args.threads, json.dumps(prompts), forced,
                                                      "repack" if args.repack and kind == "default" else "plain"))
    if args.save:
        args.save.write_text(json.dumps({"prompts": prompts, "results": results, "transformers_checkpoint": str(hf)}))
    report(results, checkpoint.name, args)


SYSTEMS = {"transformers": "transformers eager (the oracle)",
           "v4engine": "**v4engine MTP 0** (ONNX Runtime, weights read as stored)",
           "v4engine stock": "v4engine MTP 0, ONNX Runtime's stock kernels (weights widened at load)",
           "llama.cpp exact": "llama.cpp, F32 weights",
           "llama.cpp default": "llama.cpp, its default GGUF (FP8 as Q8_0)"}


def report(results: dict[str, list[dict]], checkpoint: str, args: argparse.Namespace) -> None:
    def decode_rate(result: dict) -> float:
        return sum(len(r["tokens"]) - 1 for r in result["runs"]) / sum(r["decode"] for r in result["runs"])

    def ttft_ms(result: dict) -> float:
        return 1000 * statistics.mean(r["ttft"] for r in result["runs"])

    def median(name: str, value) -> float:
        return statistics.median(value(r) for r in results[name])

    oracle_runs = results["transformers"][0]["runs"]
    ours = [t for run in results["v4engine"][0]["runs"] for t in run["tokens"]]
    print(f"\n{checkpoint}, batch 1, greedy, {args.threads} threads, {args.prompts} prompts of "
          f"{args.prompt_tokens} random tokens, {args.new_tokens} new each; medians of {args.rounds} interleaved "
          f"rounds; agreement at the {len(ours)} positions of v4engine's greedy tokens, with transformers\n")
    print("| system | decode tokens/s | time to first token | RSS after load / after the prompts / peak | "
          "log p of v4engine's token vs transformers, median / max | argmax equal to transformers' |\n"
          "|---|---|---|---|---|---|")
    rates = {}
    for name in results:
        label = SYSTEMS[name]
        rates[name] = median(name, decode_rate)
        memory = " / ".join(f"{median(name, lambda r: r[at][key]):,.0f}" for at, key in
                            (("loaded", "VmRSS"), ("end", "VmRSS"), ("end", "VmHWM")))
        runs = results[name][0]["runs"]
        gaps = [abs(a - b) for run, want in zip(runs, oracle_runs) for a, b in zip(run["logprobs"], want["logprobs"])]
        argmax = sum(a == b for run, want in zip(runs, oracle_runs) for a, b in zip(run["tokens"], want["tokens"]))
        agreement = (f"{statistics.median(gaps):.2g} / {max(gaps):.2g} | {argmax} / {len(ours)}"
                     if name != "transformers" else "the oracle | the oracle")
        print(f"| {label} | {rates[name]:.1f} | {median(name, ttft_ms):.0f} ms | {memory} MiB | {agreement} |")
    for other in [name for name in results if name != "v4engine"]:
        print(f"v4engine / {other} decode: {rates['v4engine'] / rates[other]:.2f}x")


if __name__ == "__main__":
    main()
