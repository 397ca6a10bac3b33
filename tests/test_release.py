"""Release-shaped checkpoints without data (builder/release.py): V4-Flash's layout as the release census has it,
in sparse files that every reader accepts and that use no disk."""
from __future__ import annotations

from collections import Counter

import pytest
from safetensors import safe_open

from v4engine.builder.load import open_checkpoint
from v4engine.builder.release import RELEASES, release_tensors, write_release_checkpoint


def test_flash_layout_matches_the_release_census():
    """docs/model.md §9: 69,187 tensors; 33,792 I8 MXFP4 experts (44 blocks x 256 x 3); 1,575 mtp.0.* tensors;
    3 I64 hash tables [129280, 6]; FP8 128x128 block scales; MXFP4 scales one per 32 inputs."""
    tensors = release_tensors(RELEASES["v4-flash"][0])
    dtypes = Counter(dtype for dtype, _ in tensors.values())
    assert len(tensors) == 69187
    assert dtypes["I8"] == 33792 and dtypes["I64"] == 3 and dtypes["F8_E4M3"] == 375
    assert sum(name.startswith("mtp.0.") for name in tensors) == 1575
    assert tensors["layers.0.ffn.gate.tid2eid"] == ("I64", (129280, 6))
    assert tensors["layers.5.ffn.experts.7.w1.weight"] == ("I8", (2048, 2048))
    assert tensors["layers.5.ffn.experts.7.w1.scale"] == ("F8_E8M0", (2048, 128))
    assert tensors["layers.5.attn.wq_b.scale"] == ("F8_E8M0", (256, 8))
    assert tensors["embed.weight"] == ("BF16", (129280, 4096))


def test_sparse_release_checkpoint_reads_as_zeros_and_uses_no_disk(tmp_path):
    out = write_release_checkpoint(tmp_path / "flash", "v4-flash", shards=4)
    files = sorted(out.glob("*.safetensors"))
    apparent = sum(f.stat().st_size for f in files)
    used = sum(f.stat().st_blocks * 512 for f in files)
    assert apparent > 150e9 and used < 64 * 2**20, (apparent, used)
    cfg, ckpt = open_checkpoint(out, mtp=True)           # every tensor checked against config.json
    assert cfg.num_hidden_layers == 43 and len(ckpt.names()) == 35020
    assert ckpt.info("layers.42.ffn.experts.255.w2.weight").format == "mxfp4"
    with safe_open(str(files[-1]), "pt") as f:           # the safetensors library's own reader agrees
        assert "mtp.0.e_proj.weight" in f.keys()
        assert not f.get_slice("mtp.0.hnorm.weight")[:].any()


def test_unknown_release_is_refused(tmp_path):
    with pytest.raises(Exception, match="unknown release 'v5'"):
        write_release_checkpoint(tmp_path / "x", "v5")
