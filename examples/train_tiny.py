"""Train a small DeepSeek-V4 with its MTP layer on the Python standard library, offline, on the CPU.

Corpus: the .py files of the running interpreter's standard library, in sorted order. The held-out split is
by file: every file whose sha1(relative path) ends in 0 is held out. A byte-level BPE tokenizer (`tokenizers`)
is trained on the training split. Loss is the next token for the target plus, with weight `--mtp-weight`, the
token after it for the MTP layer (DeepSeek-V3/V4): MTP row i pairs H_i with emb(t_{i+1}) and predicts t_{i+2}.
The script is seeded, logs progress, and resumes from `WORK/state.pt`. It stops after `--minutes`, then writes
the official layout (config.json, sharded safetensors with FP8 block weights, mtp.0.*, tokenizer.json) to
`--output`.

    .venv/bin/python examples/train_tiny.py --work /tmp/train-tiny --minutes 100 --output examples/tiny-v4
"""
from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from v4engine.builder.model import ModelState, Transformer
from v4engine.builder.model.v4 import hyper_head
from v4engine.builder.tiny import random_model, save_checkpoint
from v4engine.contract.config import V4Config
from v4engine.testkit.corpus import stdlib_split

CONFIG = {
    "model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"], "bos_token_id": 0, "eos_token_id": 1,
    "vocab_size": 4096, "hidden_size": 256, "moe_intermediate_size": 256, "num_hidden_layers": 6,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64, "qk_rope_head_dim": 32,
    "q_lora_rank": 128, "o_groups": 8, "o_lora_rank": 64, "sliding_window": 64,
    "compress_ratios": [0, 0, 4, 16, 4, 16, 0], "num_hash_layers": 2, "n_routed_experts": 8,
    "num_experts_per_tok": 2, "n_shared_experts": 1, "index_n_heads": 4, "index_head_dim": 64, "index_topk": 16,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6, "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc", "norm_topk_prob": True, "routed_scaling_factor": 1.5, "swiglu_limit": 10.0,
    "num_nextn_predict_layers": 1, "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 4096, "beta_fast": 32,
                     "beta_slow": 1},
    "max_position_embeddings": 65536, "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "float32",
}
SPECIALS = ["<|bos|>", "<|eos|>"]


def train_tokenizer(files: list[Path], path: Path, vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if path.exists():
        return Tokenizer.from_file(str(path))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator((f.read_text(errors="replace") for f in files), trainer)   # a few are not UTF-8
    tokenizer.save(str(path))
    return tokenizer


def encode(files: list[Path], tokenizer, path: Path) -> np.ndarray:
    """All files as one id stream, eos between files (cached)."""
    if path.exists():
        return np.load(path)
    ids: list[int] = []
    for f in files:
        ids += tokenizer.encode(f.read_text(errors="replace")).ids + [1]
    arr = np.array(ids, dtype=np.uint16)
    np.save(path, arr)
    return arr


def losses(model: Transformer, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(next-token loss of the target, token-after-next loss of the MTP layer) over a [B, L] batch."""
    B, L = batch.shape
    state = ModelState(model.cfg, B)
    out = model(batch, state.positions(L), state.views())
    target = F.cross_entropy(out.logits[:, :-1].reshape(-1, out.logits.shape[-1]), batch[:, 1:].reshape(-1))
    mtp = model.mtp[0]
    x = mtp.h_proj(mtp.hnorm(out.hidden[:, :-2])) + mtp.e_proj(mtp.enorm(model.embed(batch[:, 1:-1]))).unsqueeze(2)
    draft = ModelState(model.cfg, B, draft=True)
    x, _ = mtp(x, batch[:, 1:-1], draft.positions(L - 2), draft.views()[0])
    logits = model.head(mtp.norm(hyper_head(x, mtp.hc_head_fn, mtp.hc_head_base, mtp.hc_head_scale, model.cfg)))
    return target, F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 2:].reshape(-1))


@torch.no_grad()
def held_out_loss(model: Transformer, data: np.ndarray, length: int, batches: int) -> float:
    rng = np.random.default_rng(1)
    total = 0.0
    for _ in range(batches):
        starts = rng.integers(0, len(data) - length - 1, 8)
        batch = torch.from_numpy(np.stack([data[s:s + length] for s in starts]).astype(np.int64))
        total += losses(model, batch)[0].item()
    return total / batches


def training_arguments(description: str, minutes: float, steps: int, lr: float) -> argparse.ArgumentParser:
    """The options every training script here takes (work folder, output, budget, schedule, batch shape, seed)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--work", type=Path, required=True, help="folder for the token cache, state and log")
    p.add_argument("--output", type=Path, default=None, help="where to write the checkpoint at the end (a new folder)")
    p.add_argument("--minutes", type=float, default=minutes, help="training time budget (this run)")
    p.add_argument("--steps", type=int, default=steps, help="schedule length in steps (cosine decay)")
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--length", type=int, default=256, help="tokens per sequence (several sliding windows)")
    p.add_argument("--lr", type=float, default=lr, help="peak learning rate")
    p.add_argument("--seed", type=int, default=0, help="seeds the initialisation and the batches drawn")
    p.add_argument("--threads", type=int, default=2, help="torch's intra-op threads")
    return p


def training_log(work: Path) -> Callable[[str], None]:
    """say(msg): print a line (beside a tqdm bar, if any) and append it to WORK/train.log."""
    work.mkdir(parents=True, exist_ok=True)
    log = open(work / "train.log", "a")

    def say(msg: str) -> None:
        tqdm.write(msg)
        log.write(msg + "\n")
        log.flush()

    return say


def cosine_lr(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to zero at `steps`."""
    return peak * 0.5 * (1 + math.cos(math.pi * step / steps)) * min(1.0, (step + 1) / warmup)


def main() -> None:
    p = training_arguments(__doc__.splitlines()[0], minutes=100, steps=20000, lr=2e-3)
    p.add_argument("--mtp-weight", type=float, default=0.5, help="weight of the MTP loss")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    say = training_log(args.work)

    train_files, held_files = stdlib_split()
    tokenizer = train_tokenizer(train_files, args.work / "tokenizer.json", CONFIG["vocab_size"])
    train = encode(train_files, tokenizer, args.work / "train.npy")
    held = encode(held_files, tokenizer, args.work / "held.npy")
    say(f"corpus: {len(train_files)} training files ({len(train)} tokens), {len(held_files)} held out "
        f"({len(held)} tokens)")

    cfg = V4Config.from_dict(CONFIG)
    torch.manual_seed(args.seed)
    model = random_model(cfg, args.seed)
    with torch.no_grad():                       # small initial residual updates train more steadily
        for name, param in model.named_parameters():
            if name.endswith(("wo_b.weight", "w2.weight")):
                param.mul_(0.1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    step, state_path = 0, args.work / "state.pt"
    if state_path.exists():
        saved = torch.load(state_path, weights_only=False)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        step = saved["step"]
        say(f"resumed at step {step}")
    rng = np.random.default_rng(args.seed + step)
    started, last_save = time.time(), time.time()
    model.train()
    while step < args.steps and time.time() - started < args.minutes * 60:
        lr = cosine_lr(step, args.steps, args.lr, warmup=200)
        for group in optimizer.param_groups:
            group["lr"] = lr
        starts = rng.integers(0, len(train) - args.length - 1, args.batch)
        batch = torch.from_numpy(np.stack([train[s:s + args.length] for s in starts]).astype(np.int64))
        target_loss, mtp_loss = losses(model, batch)
        loss = target_loss + args.mtp_weight * mtp_loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        if step % 20 == 0:
            say(f"step {step} loss {target_loss.item():.3f} mtp {mtp_loss.item():.3f} lr {lr:.2e} "
                f"elapsed {time.time() - started:.0f}s")
        if time.time() - last_save > 300:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, state_path)
            last_save = time.time()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, state_path)
    model.eval()
    held_loss = held_out_loss(model, held, args.length, 8)
    say(f"done at step {step}: held-out loss {held_loss:.3f}, perplexity {math.exp(held_loss):.1f}")
    if args.output:
        save_checkpoint(model, CONFIG, args.output, quantize="fp8", dtype="bfloat16",
                        extra_files={"tokenizer.json": args.work / "tokenizer.json"})
        say(f"wrote {args.output}")


if __name__ == "__main__":
    main()
