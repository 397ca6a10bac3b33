"""Cache pools on the engine's device: torch tensors read in place by the sessions (ONNX Runtime by DLPack through
an IOBinding, TensorRT by address) and written with index_put_ on the device. Without a GPU the same path runs
with CPU tensors: the tokens, acceptance and prefix forks are those of host pools, and the rows written are
bit-for-bit the host pool's, bf16 included."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from v4engine.runtime.budget import Limits
from v4engine.runtime.cache import CachePool, SequenceCache
from v4engine.runtime.generator import Generator
from v4engine.runtime.pool_arrays import DeviceArrays, HostArrays, to_numpy, to_torch
from v4engine.runtime.sampling import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_engine):
    return tiny_engine("mixed", agree=0.05)[1]          # drafts partly accepted: rollback on every step


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 96, (length + 3 * i,), generator=g).tolist() for i in range(n)]


@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=24, ignore_eos=True),
                                    SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=1.0, seed=3)],
                         ids=["greedy", "sampled"])
def test_device_pools_give_the_tokens_and_acceptance_of_host_pools(engine, params):
    host = Generator.from_engine_dir(engine, mtp=3, prefix_cache=False)
    device = Generator.from_engine_dir(engine, mtp=3, prefix_cache=False, backend_options={"device_pools": True})
    assert host.scheduler.target_session.pool_device is None
    assert device.scheduler.target_session.pool_device == "cpu"
    assert all(isinstance(a, torch.Tensor) for p in device.scheduler.pools.values() for a in p.arrays.values())
    batch = prompts(3, 40, seed=1)                      # a mixed batch: prefill and verify rows in one call
    for want, got in zip(host.generate(batch, params), device.generate(batch, params)):
        assert got.token_ids == want.token_ids
        assert got.metrics["accepted_per_step"] == want.metrics["accepted_per_step"]
    assert device.scheduler.pools["target"].bytes_written == host.scheduler.pools["target"].bytes_written


def test_prefix_forks_on_device_pools_run_the_tokens_of_a_cold_run(engine):
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    cold = Generator.from_engine_dir(engine, mtp=3, prefix_cache=False)
    warm = Generator.from_engine_dir(engine, mtp=3, limits=Limits(max_prefill_chunk=37),
                                     backend_options={"device_pools": True})
    prefix = prompts(1, 37, seed=2)[0]              # past the 16-token block: a shared block and a copied one
    for i, prompt in enumerate([prefix + [5, 6, 7], prefix + [9, 1], prefix[:30]]):
        want, got = cold.generate([prompt], params)[0], warm.generate([prompt], params)[0]
        assert got.token_ids == want.token_ids, f"prompt {i}"
        assert got.metrics["accepted_per_step"] == want.metrics["accepted_per_step"], f"prompt {i}"
    assert warm.totals.prefix_hit_tokens > 0


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_a_device_commit_writes_the_rows_a_host_commit_writes(engine, dtype):
    """Same sequences, same deltas (host numpy and device tensors alike), same committed rows, bit for bit."""
    layout = Generator.from_engine_dir(engine, mtp=0).manifest.caches["target"]
    host, device = (CachePool(layout, 2, 8, HostArrays(dtype)), CachePool(layout, 2, 8, DeviceArrays(dtype, "cpu")))
    rng = np.random.default_rng(0)
    sequences = {id(p): [SequenceCache(p), SequenceCache(p)] for p in (host, device)}
    for step, n in enumerate([21, 1, 4, 2, 19]):
        for b in range(2):
            deltas = {}
            for g in layout.groups:
                rows = n if not g.ratio else n // g.ratio + 2
                deltas[g.pool] = rng.standard_normal((rows, g.width)).astype(np.float32).astype(HostArrays(dtype).dtype)
            for pool in (host, device):
                s = sequences[id(pool)][b]
                s.reserve(s.length + n)
                as_given = deltas if pool is host or step % 2 else {k: to_torch(v) for k, v in deltas.items()}
                s.commit(as_given, n)
    device.flush()
    for name, array in host.arrays.items():
        assert np.array_equal(to_numpy(device.arrays[name]).view(np.uint8), array.view(np.uint8)), name
    assert device.bytes_written == host.bytes_written


def layout_of(engine):
    return Generator.from_engine_dir(engine, mtp=0).manifest.caches["target"]


def step_deltas(layout, n: int, value: float) -> dict[str, torch.Tensor]:
    return {g.pool: torch.full((n if not g.ratio else n // g.ratio + 1, g.width), value) for g in layout.groups}


def test_a_step_of_many_sequences_writes_each_pool_once(engine, monkeypatch):
    """Device writes wait for the next read and then go one index_put_ per pool, whatever the batch."""
    layout = layout_of(engine)
    pool = CachePool(layout, 8, 64, DeviceArrays("fp32", "cpu"))
    sequences = [SequenceCache(pool) for _ in range(8)]
    calls = []
    original = torch.Tensor.index_put_
    monkeypatch.setattr(torch.Tensor, "index_put_", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    for s in sequences:
        s.reserve(40)
        s.commit(step_deltas(layout, 40, 1.0), 40)
    assert calls == []                                  # pending until something reads the pools
    pool.feeds(sequences)
    assert len(calls) == len(layout.groups)


def test_a_slot_given_back_with_writes_pending_keeps_its_new_owners_rings(engine):
    layout = layout_of(engine)
    pool = CachePool(layout, 1, 8, DeviceArrays("fp32", "cpu"))
    old = SequenceCache(pool)
    old.reserve(5)
    old.commit(step_deltas(layout, 5, 1.0), 5)          # pending
    old.release()
    new = SequenceCache(pool)                           # the same slot, restored from a prefix snapshot
    assert new.slot == old.slot
    new.restore_rings({g.pool: torch.full((g.rows_fixed, g.width), 2.0) for g in layout.groups if not g.ratio})
    pool.feeds([new])
    assert all((pool.arrays[g.pool][new.slot] == 2.0).all() for g in layout.groups if not g.ratio)


def test_bf16_crosses_between_numpy_and_torch_exactly():
    bits = np.arange(-(1 << 15), 1 << 15, dtype=np.int64).astype(np.int16)      # every bf16 value, NaNs too
    values = bits.view(ml_dtypes.bfloat16)
    tensor = to_torch(values)
    assert tensor.dtype == torch.bfloat16
    assert np.array_equal(to_numpy(tensor).view(np.int16), bits)


def test_each_part_keeps_its_pools_where_its_session_reads_them(engine):
    """Target pools on the device, the draft's on the host: each pool is allocated where the session that reads it
    keeps pools (as a pipeline's stages each keep theirs), and the tokens are those of host pools."""
    from v4engine.runtime.drafters import MtpDrafter
    from v4engine.runtime.pool_arrays import DeviceArrays, HostArrays
    from v4engine.runtime.scheduler import Scheduler

    device = Generator.from_engine_dir(engine, mtp=3, backend_options={"device_pools": True})
    host = Generator.from_engine_dir(engine, mtp=3)
    drafter = MtpDrafter(device.manifest, host.scheduler.draft_session, 3, max_prefill_chunk=512)
    scheduler = Scheduler(device.manifest, device.scheduler.target_session, drafter, max_batch=2, max_seq_len=128)
    for part, storage in (("target", DeviceArrays), ("draft", HostArrays)):
        assert all(isinstance(s, storage) for s in scheduler.pools[part].storage_of.values()), part
    mixed = Generator(engine, device.manifest, scheduler)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    assert [r.token_ids for r in mixed.generate([[1, 2, 3], [7, 8]], params)] == \
        [r.token_ids for r in host.generate([[1, 2, 3], [7, 8]], params)]


def test_a_gpu_provider_this_onnxruntime_lacks_leaves_the_pools_on_the_host(engine):
    """Asked for CUDA on an ONNX Runtime without it, the session runs on the CPU: its pools stay numpy."""
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this ONNX Runtime has the CUDA provider")
    gen = Generator.from_engine_dir(engine, mtp=3,
                                    backend_options={"providers": ["CUDAExecutionProvider", "CPUExecutionProvider"]})
    assert gen.scheduler.target_session.pool_device is None
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    assert gen.generate([[1, 2, 3]], params)[0].token_ids == \
        Generator.from_engine_dir(engine, mtp=3).generate([[1, 2, 3]], params)[0].token_ids
