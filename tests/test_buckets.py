"""Buckets of static shapes (contract/buckets.py, padding in runtime/static_calls.py): what a MIGraphX engine compiles one program each for, and how a
call is padded up to one and cut back.

- A profile's buckets: batch and block-table width at the powers of two up to their maximum and the maximum; the
  sequence and the pools at their maximum only.
- A call goes to the smallest bucket covering it, and never to one of other pool sizes.
- Padding: rows repeat the last row, positions count on with token 0 and zero streams, a block table repeats each
  row's last block (block 0 for a row without any); cutting the outputs returns the call's own shape.
"""
from __future__ import annotations

import pytest
import torch

from v4engine.contract.buckets import call_dims, choose_bucket, profile_buckets
from v4engine.contract.layout import TensorSpec
from v4engine.contract.profiles import Profile, ProfileError
from v4engine.runtime.static_calls import cut, padded

INPUTS = [TensorSpec("input_ids", "int64", ("batch", "seq")), TensorSpec("positions", "int64", ("batch", "seq")),
          TensorSpec("block_table", "int64", ("batch", "blocks")),
          TensorSpec("pool.x", "float32", ("pool_blocks", 4, 2)),
          TensorSpec("hidden_in", "float32", ("batch", "seq", 2))]
VERIFY = Profile("verify", {"input_ids": ((1, 1), (1, 4), (5, 4)), "positions": ((1, 1), (1, 4), (5, 4)),
                            "block_table": ((1, 0), (1, 3), (5, 6)), "pool.x": ((1, 4, 2), (30, 4, 2), (30, 4, 2)),
                            "hidden_in": ((1, 1, 2), (1, 4, 2), (5, 4, 2))})


def test_batch_and_table_width_at_powers_of_two_and_their_maximum():
    buckets = profile_buckets(VERIFY, INPUTS)
    assert {(b.dims["batch"], b.dims["blocks"]) for b in buckets} == {(b, t) for b in (1, 2, 4, 5)
                                                                         for t in (1, 2, 4, 6)}
    assert {(b.dims["seq"], b.dims["pool_blocks"]) for b in buckets} == {(4, 30)}
    assert buckets[0].name == "verify.b1.t1" and buckets[0].shape(INPUTS[3]) == (30, 4, 2)


def test_a_call_goes_to_the_smallest_bucket_covering_it():
    buckets = profile_buckets(VERIFY, INPUTS)
    assert choose_bucket(buckets, {"batch": 3, "seq": 4, "blocks": 0, "pool_blocks": 30}).name == "verify.b4.t1"
    assert choose_bucket(buckets, {"batch": 5, "seq": 2, "blocks": 5, "pool_blocks": 30}).name == "verify.b5.t6"
    with pytest.raises(ProfileError, match="pool_blocks"):
        choose_bucket(buckets, {"batch": 1, "seq": 1, "blocks": 1, "pool_blocks": 29})     # pools: exact sizes only
    with pytest.raises(ProfileError):
        choose_bucket(buckets, {"batch": 6, "seq": 1, "blocks": 1, "pool_blocks": 30})


def test_padding_repeats_rows_counts_positions_on_and_widens_tables():
    bucket = choose_bucket(profile_buckets(VERIFY, INPUTS), {"batch": 3, "seq": 4, "blocks": 2, "pool_blocks": 30})
    ids = torch.tensor([[5, 6], [7, 8], [9, 1]])
    feeds = {"input_ids": ids, "positions": torch.tensor([[10, 11], [3, 4], [0, 1]]),
             "block_table": torch.tensor([[4, 5], [6, 6], [7, 7]]), "hidden_in": torch.ones(3, 2, 2)}
    assert call_dims(feeds | {"pool.x": torch.zeros(30, 4, 2)}, INPUTS) == {"batch": 3, "seq": 2, "blocks": 2,
                                                                             "pool_blocks": 30}
    out = {spec.name: padded(torch, spec.name, feeds[spec.name], spec, bucket) for spec in INPUTS
           if spec.name in feeds}
    assert out["input_ids"].tolist() == [[5, 6, 0, 0], [7, 8, 0, 0], [9, 1, 0, 0], [9, 1, 0, 0]]
    assert out["positions"].tolist() == [[10, 11, 12, 13], [3, 4, 5, 6], [0, 1, 2, 3], [0, 1, 2, 3]]
    assert out["block_table"].tolist() == [[4, 5], [6, 6], [7, 7], [7, 7]]
    assert out["hidden_in"][:3, 2:].abs().sum() == 0 and out["hidden_in"][:3, :2].eq(1).all()
    empty = padded(torch, "block_table", torch.zeros(2, 0, dtype=torch.int64), INPUTS[2],
                   choose_bucket(profile_buckets(VERIFY, INPUTS), {"batch": 2, "seq": 1, "blocks": 0}))
    assert empty.tolist() == [[0], [0]]
    logits = TensorSpec("logits", "float32", ("batch", "seq", 3))
    assert cut(torch.zeros(4, 4, 3), logits, {"batch": 3, "seq": 2}).shape == (3, 2, 3)


def test_a_profile_giving_one_dimension_two_ranges_is_refused():
    broken = Profile("verify", VERIFY.shapes | {"positions": ((1, 1), (1, 4), (6, 4))})
    with pytest.raises(ValueError, match="batch"):
        profile_buckets(broken, INPUTS)
