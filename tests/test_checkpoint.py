"""Specification of the DeepSeek-V4 checkpoint reader (builder/checkpoint.py).

Dequantization is checked against an independent numpy decoder written here from the
format facts (docs/model.md §9.1, §9.2), bit by bit, never through the code under test.
"""

import json
import re
import struct

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from v4engine.builder.checkpoint import (
    Checkpoint,
    CheckpointError,
    quantize_fp8_block,
    quantize_mxfp4,
)

# ----------------------------------------------------------------------------- reference decoders

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)


def ref_e8m0(bits):
    """2^(e-127); e=0 is 2^-127 (float32 subnormal 0x00400000); e=255 is NaN."""
    bits = np.asarray(bits, dtype=np.uint8)
    f32_bits = np.where(bits == 0, 0x00400000, bits.astype(np.uint32) << 23)
    f32_bits = np.where(bits == 255, 0x7FC00000, f32_bits).astype(np.uint32)
    return f32_bits.view(np.float32)


def ref_e4m3(bits):
    """OCP FP8 E4M3 (fn): bias 7, no inf, S.1111.111 is NaN."""
    b = np.asarray(bits, dtype=np.uint8).astype(np.int64)
    sign = np.where(b >> 7, -1.0, 1.0)
    exp, man = (b >> 3) & 0xF, b & 0x7
    mag = np.where(exp == 0, man / 8 * 2.0**-6, (1 + man / 8) * 2.0 ** (exp - 7))
    mag = np.where((exp == 15) & (man == 7), np.nan, mag)
    return (sign * mag).astype(np.float32)


def ref_fp8_block(w_bits, scale_bits):
    out, inp = w_bits.shape
    s = ref_e8m0(scale_bits)
    s = np.repeat(np.repeat(s, 128, axis=0)[:out], 128, axis=1)[:, :inp]
    return ref_e4m3(w_bits) * s


def ref_mxfp4(packed, scale_bits):
    b = np.asarray(packed).view(np.uint8)
    codes = np.empty((b.shape[0], b.shape[1] * 2), dtype=np.uint8)
    codes[:, 0::2] = b & 0x0F  # low nibble = even (lower) input index
    codes[:, 1::2] = b >> 4
    return E2M1[codes] * np.repeat(ref_e8m0(scale_bits), 32, axis=1)


def header_of(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def write_raw(path, entries):
    """Hand-written safetensors: entries = [(name, dtype, shape, bytes)]."""
    header, data, pos = {}, b"", 0
    for name, dtype, shape, blob in entries:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + len(blob)]}
        data, pos = data + blob, pos + len(blob)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)


def bits(t):
    return t.view(torch.uint8).numpy()


# ----------------------------------------------------------------------------- FP8 block

def test_fp8_block_round_trip_with_ragged_blocks(tmp_path):
    torch.manual_seed(0)
    w = torch.randn(200, 72)
    w[:128] *= 100.0  # two row blocks with very different scales
    w[128:] *= 0.01
    q, s = quantize_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and tuple(s.shape) == (2, 1)
    save_file({"layers.0.attn.wq_a.weight": q, "layers.0.attn.wq_a.scale": s}, tmp_path / "model.safetensors")
    hdr = header_of(tmp_path / "model.safetensors")
    assert hdr["layers.0.attn.wq_a.weight"]["dtype"] == "F8_E4M3"
    assert hdr["layers.0.attn.wq_a.scale"]["dtype"] == "F8_E8M0"

    ck = Checkpoint.open(tmp_path)
    assert ck.names() == ["layers.0.attn.wq_a.weight"]  # the scale is attached, not listed
    info = ck.info("layers.0.attn.wq_a.weight")
    assert info.format == "fp8_block" and info.scale.dtype == "F8_E8M0" and info.scale.shape == (2, 1)
    got = ck.load("layers.0.attn.wq_a.weight")
    expect = ref_fp8_block(bits(q), bits(s))
    assert np.array_equal(got.numpy(), expect)

    # error: 3 mantissa bits -> relative half-step 2^-4, plus subnormal step near zero
    step = np.repeat(ref_e8m0(bits(s)), 128, axis=0)[:200]
    assert np.all(np.abs(expect - w.numpy()) <= np.abs(w.numpy()) / 16 + step * 2.0**-10)
    assert np.all(np.abs(expect).max(axis=1) <= 448 * step[:, 0])


def test_fp8_scale_byte_zero_and_float_weight_scale_inv(tmp_path):
    one, minus_three = 0x38, 0xC4  # E4M3 1.0 and -3.0
    w = bytes([one, minus_three] * 2)
    write_raw(tmp_path / "model.safetensors", [
        ("layers.0.attn.wkv.weight", "F8_E4M3", (2, 2), w),
        ("layers.0.attn.wkv.scale", "F8_E8M0", (1, 1), bytes([0])),  # 2^-127
        ("layers.0.attn.wo_b.weight", "F8_E4M3", (2, 2), w),
        ("layers.0.attn.wo_b.weight_scale_inv", "F32", (1, 1), struct.pack("<f", 0.25)),  # V3-style
    ])
    ck = Checkpoint.open(tmp_path)
    assert ck.load("layers.0.attn.wkv.weight")[0].tolist() == [2.0**-127, -3 * 2.0**-127]
    assert ck.load("layers.0.attn.wo_b.weight")[0].tolist() == [0.25, -0.75]
    assert ck.info("layers.0.attn.wo_b.weight").format == "fp8_block"
    assert ck.raw("layers.0.attn.wkv.weight").dtype == np.uint8


# ----------------------------------------------------------------------------- MXFP4

def test_mxfp4_round_trip(tmp_path):
    torch.manual_seed(1)
    w = torch.randn(64, 96) * torch.logspace(-3, 3, 64).unsqueeze(1)
    packed, s = quantize_mxfp4(w)
    assert packed.dtype == torch.int8 and tuple(packed.shape) == (64, 48) and tuple(s.shape) == (64, 3)
    save_file({"layers.3.ffn.experts.0.w1.weight": packed, "layers.3.ffn.experts.0.w1.scale": s},
              tmp_path / "model.safetensors")
    assert header_of(tmp_path / "model.safetensors")["layers.3.ffn.experts.0.w1.weight"]["dtype"] == "I8"

    ck = Checkpoint.open(tmp_path)
    name = "layers.3.ffn.experts.0.w1.weight"
    assert ck.info(name).format == "mxfp4"
    assert ck.info(name).shape == (64, 48) and ck.logical_shape(name) == (64, 96)
    expect = ref_mxfp4(packed.numpy(), bits(s))
    assert np.array_equal(ck.load(name).numpy(), expect)

    # e2m1 relative half-gap is at most 1/4 (e.g. 2.5 between 2 and 3), absolute 1/4 step near zero
    step = np.repeat(ref_e8m0(bits(s)), 32, axis=1)
    assert np.all(np.abs(expect - w.numpy()) <= np.abs(w.numpy()) / 4 + step / 4)
    assert np.all(np.abs(expect) <= 6 * step)


def test_mxfp4_nibble_order_and_scale_byte_zero(tmp_path):
    row0 = bytes([0x21, 0xF9]) + bytes(14)  # 0x21: low nibble 1 (0.5) first, high nibble 2 (1.0)
    row1 = bytes([0x21]) + bytes(15)
    write_raw(tmp_path / "model.safetensors", [
        ("layers.3.ffn.experts.1.w2.weight", "U8", (2, 16), row0 + row1),  # U8 is accepted like I8
        ("layers.3.ffn.experts.1.w2.scale", "F8_E8M0", (2, 1), bytes([127, 0])),
    ])
    w = Checkpoint.open(tmp_path).load("layers.3.ffn.experts.1.w2.weight")
    assert w.shape == (2, 32)
    assert w[0, :4].tolist() == [0.5, 1.0, -0.5, -6.0]
    assert w[1, :2].tolist() == [0.5 * 2.0**-127, 2.0**-127]


# ----------------------------------------------------------------------------- plain dtypes

def test_plain_dtypes_and_integers(tmp_path):
    bf16 = torch.tensor([1.5, -2.0, 3.25]).to(torch.bfloat16)
    save_file({
        "norm.weight": bf16,
        "hc_head_base": torch.tensor([0.1, 0.2], dtype=torch.float16),
        "layers.0.ffn.gate.tid2eid": torch.tensor([[1, 3], [0, 2]], dtype=torch.int64),
        "layers.1.ffn.gate.tid2eid": torch.tensor([[1, 3]], dtype=torch.int32),
    }, tmp_path / "model.safetensors")
    ck = Checkpoint.open(tmp_path)
    assert ck.raw("norm.weight").dtype == np.uint16
    assert ck.load("norm.weight").tolist() == [1.5, -2.0, 3.25]
    assert ck.load("norm.weight", torch.bfloat16).dtype == torch.bfloat16
    assert ck.load("hc_head_base").tolist() == torch.tensor([0.1, 0.2], dtype=torch.float16).float().tolist()
    for name in ("layers.0.ffn.gate.tid2eid", "layers.1.ffn.gate.tid2eid"):
        t = ck.load(name, torch.bfloat16)
        assert t.dtype == torch.int64 and t[0].tolist() == [1, 3]


# ----------------------------------------------------------------------------- name schemes

@pytest.fixture(scope="module")
def three_schemes(tmp_path_factory):
    """One random tiny transformers model written as official, HF-module and save_pretrained names."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    cfg = DeepseekV4Config(
        vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        head_dim=16, qk_rope_head_dim=8, q_lora_rank=24, o_groups=2, o_lora_rank=12,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        index_n_heads=2, index_head_dim=8, index_topk=3, mlp_layer_types=["hash_moe", "moe", "moe"])
    torch.manual_seed(2)
    model = DeepseekV4ForCausalLM(cfg)
    state = model.state_dict()
    with torch.no_grad():
        for t in state.values():
            t.copy_(torch.randn_like(t) if t.is_floating_point() else torch.randint_like(t, 0, 4))

    dirs = {s: tmp_path_factory.mktemp(s) for s in ("official", "hf", "save_pretrained")}
    model.save_pretrained(dirs["save_pretrained"])
    save_file({k: v.contiguous() for k, v in state.items()}, dirs["hf"] / "model.safetensors")

    # official names: what DeepSeek ships, derived here by hand from save_pretrained's names
    def official(key):
        key = key.removeprefix("model.").replace("embed_tokens.", "embed.").replace("hc_head.hc_", "hc_head_")
        return key.replace(".attn.norm.", ".attn.kv_norm.")

    saved = load_file(dirs["save_pretrained"] / "model.safetensors")
    save_file({official(k): v for k, v in saved.items()}, dirs["official"] / "model.safetensors")
    return cfg, state, {s: Checkpoint.open(d) for s, d in dirs.items()}


def test_three_name_schemes_give_identical_canonical_tensors(three_schemes):
    _, _, cks = three_schemes
    assert {s: ck.scheme for s, ck in cks.items()} == {s: s for s in cks}
    names = cks["official"].names()
    assert cks["hf"].names() == names and cks["save_pretrained"].names() == names
    for name in names:
        ref = cks["official"].load(name)
        for scheme in ("hf", "save_pretrained"):
            assert torch.equal(cks[scheme].load(name), ref), (scheme, name)


def test_canonical_names_cover_the_official_layout(three_schemes):
    cfg, _, cks = three_schemes
    names = set(cks["hf"].names())
    for n in ("embed.weight", "head.weight", "norm.weight", "hc_head_fn", "hc_head_scale",
              "layers.0.attn.kv_norm.weight", "layers.0.attn.attn_sink", "layers.0.hc_ffn_base",
              "layers.0.ffn.gate.tid2eid", "layers.1.ffn.gate.bias", "layers.0.ffn.shared_experts.w3.weight",
              "layers.1.attn.compressor.ape", "layers.1.attn.compressor.norm.weight",
              "layers.1.attn.indexer.wq_b.weight", "layers.1.attn.indexer.weights_proj.weight",
              "layers.1.attn.indexer.compressor.norm.weight", "layers.2.attn.compressor.wgate.weight",
              "layers.2.ffn.experts.3.w2.weight"):
        assert n in names, n
    experts = [n for n in names if ".ffn.experts." in n]
    assert len(experts) == 3 * cfg.n_routed_experts * 3


def test_fused_hf_experts_are_lazy_contiguous_slices(three_schemes):
    cfg, state, cks = three_schemes
    ck, inter = cks["hf"], cfg.moe_intermediate_size
    gate_up = state["model.layers.1.mlp.experts.gate_up_proj"]
    down = state["model.layers.1.mlp.experts.down_proj"]
    assert torch.equal(ck.load("layers.1.ffn.experts.2.w1.weight"), gate_up[2, :inter])
    assert torch.equal(ck.load("layers.1.ffn.experts.2.w3.weight"), gate_up[2, inter:])
    assert torch.equal(ck.load("layers.1.ffn.experts.2.w2.weight"), down[2])
    info = ck.info("layers.1.ffn.experts.2.w3.weight")
    assert info.stored_name == "model.layers.1.mlp.experts.gate_up_proj"
    assert info.shape == (inter, cfg.hidden_size) and info.nbytes == inter * cfg.hidden_size * 4
    assert isinstance(ck.raw("layers.1.ffn.experts.2.w3.weight"), np.memmap)


def test_mtp_keys_stay_official_in_hf_files(tmp_path):
    save_file({"model.layers.0.input_layernorm.weight": torch.ones(4), "mtp.0.enorm.weight": torch.ones(4),
               "mtp.0.attn.wq_a.weight": torch.ones(2, 4), "mtp.0.ffn.gate.bias": torch.ones(2)},
              tmp_path / "model.safetensors")
    ck = Checkpoint.open(tmp_path)
    assert ck.scheme == "hf"
    assert ck.names() == ["layers.0.attn_norm.weight", "mtp.0.attn.wq_a.weight", "mtp.0.enorm.weight",
                          "mtp.0.ffn.gate.bias"]


def test_unknown_tensor_is_an_error(tmp_path):
    save_file({"embed.weight": torch.ones(2, 2), "layers.0.attn.wq_c.weight": torch.ones(2)},
              tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"layers\.0\.attn\.wq_c\.weight"):
        Checkpoint.open(tmp_path)


# ----------------------------------------------------------------------------- files and validation

def _write_shards(folder):
    save_file({"embed.weight": torch.arange(6.0).view(3, 2)}, folder / "model-00001-of-00002.safetensors")
    save_file({"head.weight": torch.ones(3, 2), "norm.weight": torch.ones(2)},
              folder / "model-00002-of-00002.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 44}, "weight_map": {
        "embed.weight": "model-00001-of-00002.safetensors",
        "head.weight": "model-00002-of-00002.safetensors",
        "norm.weight": "model-00002-of-00002.safetensors"}}))


def test_sharded_checkpoint(tmp_path):
    _write_shards(tmp_path)
    ck = Checkpoint.open(tmp_path)
    assert ck.names() == ["embed.weight", "head.weight", "norm.weight"]
    assert [p.name for p in ck.files()] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert ck.info("head.weight").file.name == "model-00002-of-00002.safetensors"
    assert ck.load("embed.weight")[2].tolist() == [4.0, 5.0]
    assert len(ck.fingerprint()) == 64 and ck.fingerprint() == Checkpoint.open(tmp_path).fingerprint()


def test_absolute_offsets_point_into_the_file(tmp_path):
    _write_shards(tmp_path)
    info = Checkpoint.open(tmp_path).info("embed.weight")
    with open(info.file, "rb") as f:
        f.seek(info.offset)
        assert np.frombuffer(f.read(info.nbytes), "<f4").tolist() == [0, 1, 2, 3, 4, 5]


def test_missing_shard_is_named(tmp_path):
    _write_shards(tmp_path)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        Checkpoint.open(tmp_path)


def test_folder_without_safetensors(tmp_path):
    with pytest.raises(CheckpointError, match=re.escape(str(tmp_path))):
        Checkpoint.open(tmp_path)


def test_truncated_file_names_file_and_tensor(tmp_path):
    path = tmp_path / "model.safetensors"
    write_raw(path, [("embed.weight", "F32", (2, 2), bytes(16)), ("head.weight", "F32", (2, 2), bytes(16))])
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*truncated.*'head\.weight'"):
        Checkpoint.open(tmp_path)


def test_unknown_dtype_names_tensor_and_dtype(tmp_path):
    write_raw(tmp_path / "model.safetensors", [("norm.weight", "F9", (4,), bytes(4))])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*'norm\.weight'.*'F9'"):
        Checkpoint.open(tmp_path)


def test_byte_length_must_match_shape(tmp_path):
    write_raw(tmp_path / "model.safetensors", [("norm.weight", "BF16", (4,), bytes(6))])
    with pytest.raises(CheckpointError, match=r"'norm\.weight'.*needs 8 bytes"):
        Checkpoint.open(tmp_path)


def test_check_expected_logical_shapes(tmp_path):
    packed, s = quantize_mxfp4(torch.randn(8, 64))
    save_file({"norm.weight": torch.ones(32), "layers.0.ffn.experts.0.w2.weight": packed,
               "layers.0.ffn.experts.0.w2.scale": s}, tmp_path / "model.safetensors")
    ck = Checkpoint.open(tmp_path)
    ck.check({"norm.weight": (32,), "layers.0.ffn.experts.0.w2.weight": (8, 64)})  # extras are fine
    wrong = r"'layers\.0\.ffn\.experts\.0\.w2\.weight'.*\[8, 64\].*\[8, 32\].*config\.json"
    with pytest.raises(CheckpointError, match=wrong):
        ck.check({"layers.0.ffn.experts.0.w2.weight": (8, 32)})
    with pytest.raises(CheckpointError, match=r"tensor 'head\.weight' is missing"):
        ck.check({"norm.weight": (32,), "head.weight": (4, 32)})


def resident_kib() -> int:
    """This process's resident memory now (VmRSS, file-backed pages included), in KiB: a delta of it shows what an
    action touched, where a delta of the peak (ru_maxrss) is 0 whenever an earlier peak was higher."""
    return int(next(line for line in open("/proc/self/status") if line.startswith("VmRSS")).split()[1])


def test_reading_is_lazy(tmp_path):
    """A 1 GiB tensor in a sparse file is never read when another tensor is loaded."""
    big = 1 << 30
    path = tmp_path / "model.safetensors"
    write_raw(path, [("norm.weight", "F32", (2,), struct.pack("<2f", 1.0, 2.0))])
    hdr = header_of(path)
    hdr["embed.weight"] = {"dtype": "U8", "shape": [big], "data_offsets": [8, 8 + big]}
    h = json.dumps(hdr).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + struct.pack("<2f", 1.0, 2.0))
        f.truncate(8 + len(h) + 8 + big)

    rss_before = resident_kib()
    ck = Checkpoint.open(tmp_path)
    raw = ck.raw("norm.weight")
    assert isinstance(raw, np.memmap) and not raw.flags.writeable
    assert ck.load("norm.weight").tolist() == [1.0, 2.0]
    assert ck.raw("embed.weight").shape == (big,)
    assert resident_kib() - rss_before < 256 * 1024, "the 1 GiB tensor's pages were not touched"
