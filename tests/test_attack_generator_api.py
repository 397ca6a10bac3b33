"""Attacks through the Generator API and the weights behind it: a request cancelled through another Generator,
weights whose logits are not finite, a weight file cut under a running Generator, a cache budget that must bound
all of the cache's memory. (Options of the wrong type or range: test_attack_tracebacks.py.)"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from hostile import assert_one_line, v4generate
from v4engine.builder.build import BuildOptions, build
from v4engine.contract.errors import V4EngineError
from v4engine.runtime.budget import Limits
from v4engine.runtime.generator import Generator
from v4engine.runtime.sampling import RequestError, SamplingParams

GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)
PROMPT = [5, 9, 11, 3]


def test_a_request_cancelled_through_another_generator_is_refused_and_its_owner_serves_it(tiny_engine):
    engine = tiny_engine("mixed")[1]
    owner, other = Generator.from_engine_dir(engine, mtp=0), Generator.from_engine_dir(engine, mtp=0)
    [alone] = owner.generate([PROMPT], GREEDY)
    request = owner.submit(PROMPT, GREEDY)
    with pytest.raises(RequestError, match=f"request {request.id} is not one of this Generator's"):
        other.cancel(request)
    while not owner.advance([request]):
        pass
    assert request.error is None and request.finish_reason == "length"
    assert owner.progress(request)[0] == alone.token_ids


@pytest.fixture(scope="module")
def nan_engine(tiny_checkpoint, tmp_path_factory) -> Path:
    """An engine whose final norm is NaN: every logit it computes is NaN."""
    folder = tmp_path_factory.mktemp("nan")
    checkpoint = Path(shutil.copytree(tiny_checkpoint("mixed", names="hf"), folder / "checkpoint"))
    for path in checkpoint.glob("*.safetensors"):
        with safe_open(str(path), "np") as f:
            tensors, metadata = {name: f.get_tensor(name) for name in f.keys()}, f.metadata()
        if "model.norm.weight" in tensors:
            tensors["model.norm.weight"] = np.full_like(tensors["model.norm.weight"], np.nan)
            save_file(tensors, str(path), metadata)
    build(BuildOptions(checkpoint=checkpoint, output=folder / "engine", mtp=0, progress=False))
    return folder / "engine"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logits_that_are_not_finite_fail_the_request_in_one_line(nan_engine, temperature):
    """Not token 0 forever (greedy) or the last id (sampled), with exit 0."""
    gen = Generator.from_engine_dir(nan_engine)
    with pytest.raises(V4EngineError, match="logits .* are not finite"):
        gen.generate([PROMPT], SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=temperature, seed=1))
    assert_one_line(v4generate(nan_engine, "--prompt-ids", "5,9,11,3", "--max-new-tokens", "4"), "not finite")


class NoEncoding:
    """A tokenizer that must not be asked to encode (its vocabulary is the engine's)."""

    def __init__(self, tokenizer):
        self.get_vocab = tokenizer.get_vocab

    def encode(self, *args, **kwargs):
        raise AssertionError("the text was tokenized")


def test_a_prompt_text_longer_than_any_servable_prompt_is_refused_before_it_is_tokenized(tiny_engine):
    """Megabytes of text held the Triton preprocessing instance for 14 s before any length check."""
    gen = Generator.from_engine_dir(tiny_engine("mixed")[1], mtp=0)
    gen.tokenizer = NoEncoding(gen.tokenizer)
    with pytest.raises(RequestError, match=r"the prompt text has 4000000 bytes, more than a prompt this engine "
                                           r"serves can hold \(\d+\)"):
        gen.generate(["x" * 4_000_000], GREEDY)


def test_a_tokenizer_that_gives_up_on_a_prompt_fails_that_request_in_one_line(engine_copy):
    """An Oniguruma regex past its retry limit panics in Rust: a BaseException, not a traceback through the API."""
    from tokenizers import Regex, Tokenizer, pre_tokenizers

    tokenizer = Tokenizer.from_file(str(engine_copy / "tokenizer.json"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("(a|a)+$"), "isolated")
    tokenizer.save(str(engine_copy / "tokenizer.json"))
    gen = Generator.from_engine_dir(engine_copy, mtp=0)
    with pytest.raises(RequestError, match="tokenizer.json failed on this prompt"):
        gen.generate(["a" * 40 + "b"], GREEDY)
    assert gen.generate(["ab"], GREEDY)[0].finish_reason == "length"


@pytest.mark.parametrize("options, says", [
    ({"limits": Limits(max_batch=0)}, "max_batch must be an integer from 1"),
    ({"limits": Limits(max_cache_bytes="1000000")}, "max_cache_bytes must be a positive integer"),
    ({"mtp": 2.5}, "mtp must be an integer from 0 to 3"),
    ({"backend_options": {"threads": -1}}, "option 'threads' must be an integer >= 0"),
])
def test_options_that_would_mean_something_else_are_refused_in_one_line(tiny_engine, options, says):
    """Not 0 taken for the default, -1 passed on, or a TypeError from deep inside."""
    with pytest.raises(RequestError, match=says):
        Generator.from_engine_dir(tiny_engine("mixed")[1], **options)



def test_max_cache_bytes_bounds_the_pools_and_the_prefix_snapshots_together(tiny_engine):
    """The budget is all of the cache's memory: the snapshots the prefix cache keeps beside the pools come out of
    it (they once took up to 3.0x the budget besides), and a budget that cannot hold max_batch slots is refused
    (they were allocated whatever it said: 9.6x)."""
    engine = tiny_engine("mixed")[1]
    probe = Generator.from_engine_dir(engine, limits=Limits(max_batch=2)).scheduler
    budget = 8 * probe.cache_bytes(160)                 # less than two sequences of max_seq_len would take
    assert budget < 2 * probe.cache_bytes(probe.max_seq_len)
    generator = Generator.from_engine_dir(engine, limits=Limits(max_batch=2, max_prefill_chunk=32,
                                                                max_cache_bytes=budget))
    rng = np.random.default_rng(3)
    for _ in range(10):                                  # distinct prompts: snapshots until the share is full
        generator.generate([rng.integers(1, 128, 100).tolist()], SamplingParams(max_new_tokens=2))
    scheduler = generator.scheduler
    pools = sum(a.nbytes for pool in scheduler.pools.values() for a in pool.arrays.values())
    assert 0 < scheduler.prefix.nbytes <= scheduler.prefix.max_bytes
    assert pools + scheduler.prefix.max_bytes <= budget
    with pytest.raises(RequestError, match="^max_cache_bytes [0-9]+ is less than the [0-9]+ bytes of the slots of "
                                           "max_batch 8 rows and one block; raise it or lower max_batch$"):
        Generator.from_engine_dir(engine, limits=Limits(max_batch=8, max_cache_bytes=8 * probe.cache_bytes(0)))


CUT_UNDER_IT = """
import os, sys
from v4engine.contract.errors import V4EngineError
from v4engine.runtime.generator import Generator
from v4engine.runtime.sampling import SamplingParams
generator = Generator.from_engine_dir(sys.argv[1])
params = SamplingParams(max_new_tokens=6, ignore_eos=True)
generator.generate([[5, 9, 11, 3]], params)
for shard in sys.argv[2:]:
    os.truncate(shard, os.path.getsize(shard) // 2)
try:
    generator.generate([[5, 9, 11, 3]], params)
except V4EngineError as e:
    sys.exit(str(e))
"""


def test_a_weight_file_cut_under_a_running_generator_fails_the_next_request_in_one_line(tiny_checkpoint, tmp_path):
    """The engine's weights are maps of the checkpoint's files: a page past a cut file's new end would be SIGBUS,
    which no Python code can catch. The maps are checked before every engine call instead (in a child process:
    the failure this guards against ends the process)."""
    checkpoint = Path(shutil.copytree(tiny_checkpoint("mixed", names="hf"), tmp_path / "checkpoint"))
    build(BuildOptions(checkpoint=checkpoint, output=tmp_path / "engine", mtp=3, progress=False))
    shards = [str(p) for p in checkpoint.glob("*.safetensors")]
    result = subprocess.run([sys.executable, "-c", CUT_UNDER_IT, str(tmp_path / "engine"), *shards],
                            capture_output=True, text=True, timeout=300)
    assert_one_line(result, "bytes, less than the", "mapped when the engine opened: truncated under the running "
                    "engine; open it again")
