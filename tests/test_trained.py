"""The shipped trained tiny V4 (examples/tiny-v4): lossless MTP and exact acceptance on real text.

Random weights hide cache bugs behind a draft that is always rejected. This checkpoint's MTP layer really
predicts the target, so verify steps accept 0..3 drafts and the rollback of rejected rows is exercised on
every step. The prompt is longer than the sliding window (64) and its compressed CSA rows outnumber
index_topk (16), so the ring, the compressors and the indexer all take part.
"""
from __future__ import annotations

from conftest import TRAINED as CHECKPOINT
from v4engine.builder.checkpoint import Checkpoint
from v4engine.builder.load import load_model
from v4engine.runtime.generator import Generator
from v4engine.runtime.sampling import SamplingParams
from v4engine.testkit.oracle import load_transformers, oracle_accepted_counts, oracle_greedy, transformers_copy

PROMPTS = ['''import os


def read_lines(path):
    """Return the lines of the file at path, without line endings."""
    with open(path) as f:
        return [line.rstrip("\\n") for line in f]


class Counter:
    """Count how often each item was added."""

    def __init__(self):
        self.counts = {}

    def add(self, item):
''', '''def parse_args(argv=None):
    import argparse

    parser = argparse.ArgumentParser(description="Copy files.")
    parser.add_argument("source", help="the file to copy")
    parser.add_argument("target", help="where to copy it")
    parser.add_argument("-v", "--verbose", action="store_true", help="print what is done")
    args = parser.parse_args(argv)
    if args.verbose:
''']
GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)


def test_the_shipped_checkpoint_is_the_official_layout_with_fp8_weights_mtp_and_a_tokenizer():
    ckpt = Checkpoint.open(CHECKPOINT)
    names = ckpt.names()
    assert any(n.startswith("mtp.0.") for n in names)
    assert {ckpt.info(n).format for n in names} >= {"plain", "fp8_block"}
    assert (CHECKPOINT / "tokenizer.json").is_file() and (CHECKPOINT / "model.safetensors.index.json").is_file()
    assert sum(f.stat().st_size for f in CHECKPOINT.iterdir()) <= 25 * 2**20


def test_greedy_with_mtp_k_is_identical_to_greedy_without_and_to_transformers(trained_engine, tmp_path):
    generators = {k: Generator.from_engine_dir(trained_engine, mtp=k) for k in range(4)}
    outputs = {k: [r.token_ids for r in g.generate(PROMPTS, GREEDY)] for k, g in generators.items()}
    assert outputs[0] == outputs[1] == outputs[2] == outputs[3]
    hf = load_transformers(transformers_copy(CHECKPOINT, tmp_path / "hf"))
    for text, got in zip(PROMPTS, outputs[0]):
        assert got == oracle_greedy(hf, generators[0].encode(text), GREEDY.max_new_tokens)


def test_accepted_counts_equal_the_full_recompute_oracle_and_the_draft_is_often_right(trained_engine):
    model = load_model(CHECKPOINT, mtp=True)
    generator = Generator.from_engine_dir(trained_engine, mtp=3)
    ids = generator.encode(PROMPTS[0])
    cfg = model.cfg
    assert len(ids) > cfg.sliding_window and len(ids) // cfg.compress_rates["compressed_sparse_attention"] \
        > cfg.index_topk
    [result] = generator.generate([ids], SamplingParams(max_new_tokens=40, ignore_eos=True))
    got = result.metrics["accepted_per_step"]
    assert got == oracle_accepted_counts(model, ids, 3, 40)[: len(got)]
    assert result.metrics["mean_acceptance_length"] > 2.0
    assert min(got) < 3, "some drafts are rejected, so rollback is exercised"
