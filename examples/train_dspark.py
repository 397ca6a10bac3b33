"""Train a DSpark drafter for examples/tiny-v4 with the target frozen, offline, on the CPU.

The drafter is three stages as V4-Flash-0731 ships them (docs/model.md §4.6), scaled to tiny-v4: each a V4 block
of the target's width with its own MoE (8 experts, top 2, one shared), main_proj reading the mean hc streams after
target layers 3, 4 and 5, a Markov head of rank `--markov-rank` and a confidence head; block width N = 5. Corpus and
split are tiny-v4's (examples/train_tiny.py: the standard library's .py files, a file held out when sha1 of its
path ends in 0), encoded with tiny-v4's tokenizer.

One training example is a block: a committed position p of a training sequence, whose ring holds the captured
rows of the last W positions up to p; the anchor x_{p+1} and N - 1 noise tokens at positions p+1 .. p+N; drafts
for x_{p+2} .. x_{p+N+1}, the Markov head fed the true previous token (teacher forcing). The objective is the DSpark
paper's (Eqs. 9-12): 0.1 x cross-entropy on the true token + 0.9 x total variation between the draft's
distribution softmax(U_i) and the target's at the same position + 1.0 x binary cross-entropy of the confidence
toward 1 - TV (the chance that a draft drawn from p_d survives rejection sampling against p_t), position k
weighted by exp(-(k-1)/N). The stages start from tiny-v4's trained MTP block (the same shapes), the Markov head's
W2 at zero (no correction), so the first steps already draft something.

With --distill, part of each batch is the target's own text instead of the corpus's: continuations it generated
(half greedy, half drawn at T = 1, or the share --distill-sampled asks) from prompts cut out of the training files,
so the drafter also learns the text it drafts at generation time (the held-out files stay held out; their
continuations only measure). --init-from starts the stages from a shipped DSpark drafter instead of the MTP block,
for a second run after a first; a drafter of lower Markov rank is widened to --markov-rank first (new W2 columns at
zero, so it drafts exactly as before).

The script is seeded, logs progress, resumes from WORK/state.pt, stops after --minutes, then writes the 0731
layout to --output: tiny-v4's target shard byte for byte (so git stores it once), the drafter under mtp.0..2 in a
second shard (FP8 128x128 blocks; Markov tables and norms bf16), config.json with the dspark_* keys, the tokenizer.

examples/tiny-v4-dspark was made by five runs, each after the first --init-from the one before (its README has the
commands, the times and the figures); the first two:

    .venv/bin/python examples/train_dspark.py --work /tmp/dspark-1 --minutes 68 --steps 1000 --lr 1.5e-3 \
        --output /tmp/dspark-first
    .venv/bin/python examples/train_dspark.py --work /tmp/dspark-2 --init-from /tmp/dspark-first \
        --distill 0.5 --distill-pool 1024 --minutes 80 --steps 1800 --lr 7e-4 --output /tmp/dspark-second
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tqdm import tqdm
from train_tiny import cosine_lr, encode, training_arguments, training_log

from v4engine.builder.load import load_dspark, load_model
from v4engine.builder.model import ModelState, Transformer
from v4engine.builder.model.dspark import BlockContext, DSpark, capture
from v4engine.builder.tiny import dspark_config, stored_tensors, write_checkpoint_folder
from v4engine.contract.config import V4Config
from v4engine.contract.errors import V4EngineError
from v4engine.testkit.corpus import stdlib_split

TARGET = Path(__file__).resolve().parent / "tiny-v4"


def dspark_for(target: Transformer, raw: dict, seed: int) -> DSpark:
    """A DSpark drafter for `target` whose stages start as the target's MTP block (same shapes), sharing its
    embedding and head; main_proj small and random, the Markov correction and the confidence at zero."""
    cfg = V4Config.from_dict(raw, source="tiny-v4-dspark config")
    torch.manual_seed(seed)
    drafter = DSpark(cfg)
    mtp = target.mtp[0].state_dict()
    with torch.no_grad():
        drafter.embed.weight.copy_(target.embed.weight)
        drafter.head.weight.copy_(target.head.weight)
        for stage in drafter.mtp:
            missing = stage.load_state_dict({k: v for k, v in mtp.items() if k in stage.state_dict()}, strict=False)
            assert set(missing.missing_keys) <= {"main_proj.weight", "main_norm.weight"} | {
                k for k in stage.state_dict() if k.startswith(("markov_head", "confidence_head"))}, missing
        first, last = drafter.mtp[0], drafter.mtp[-1]
        first.main_proj.weight.normal_(0, first.main_proj.weight.shape[1] ** -0.5)
        first.main_norm.weight.fill_(1.0)
        last.markov_head.markov_w1.weight.normal_(0, 1.0)
        last.markov_head.markov_w2.weight.zero_()
        last.confidence_head.proj.weight.zero_()
    drafter.embed.requires_grad_(False)
    drafter.head.requires_grad_(False)
    return drafter


@torch.no_grad()
def widened_markov(weights: dict[str, torch.Tensor], drafter: DSpark) -> dict[str, torch.Tensor]:
    """A trained drafter's mtp.* weights with its Markov head widened to `drafter`'s rank, drafting exactly as
    before: the new columns of W1 (and of the confidence head's view of them) start as `drafter`'s fresh ones,
    the new columns of W2 and of the confidence projection at zero, so they add nothing until trained."""
    fresh = drafter.state_dict()
    out = dict(weights)
    for name, w in weights.items():
        grown = fresh.get(name)
        if grown is None or grown.shape == w.shape:
            continue
        start = torch.zeros_like(grown) if name.endswith(("markov_w2.weight", "confidence_head.proj.weight")) \
            else grown.clone()
        start[tuple(slice(0, n) for n in w.shape)] = w
        out[name] = start
    return out


@torch.no_grad()
def continuations(target: Transformer, prompts: np.ndarray, new: int, temperature: float, seed: int,
                  chunk: int = 64) -> np.ndarray:
    """The target's own continuations of `prompts` [n, P]: `new` tokens each, greedy at temperature 0, else drawn
    at `temperature`; returns [n, P + new]. The drafter drafts the target's text at generation time, not the
    corpus's, so it is also trained on that text (self-distillation)."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for start in tqdm(range(0, len(prompts), chunk), desc=f"target continuations T={temperature}", unit="batch"):
        tokens = torch.from_numpy(prompts[start:start + chunk].astype(np.int64))           # [b, P]
        state = ModelState(target.cfg, tokens.shape[0])
        pieces, x = [tokens], tokens
        for _ in range(new):
            step = target(x, state.positions(x.shape[1]), state.views())
            state.commit(step.deltas, [x.shape[1]] * x.shape[0])
            logits = step.logits[:, -1].float()                                           # [b, V]
            if temperature == 0:
                x = logits.argmax(-1, keepdim=True)                                       # [b, 1]
            else:
                x = torch.multinomial((logits / temperature).softmax(-1), 1, generator=generator)
            pieces.append(x)
        out.append(torch.cat(pieces, dim=1).numpy())
    return np.concatenate(out).astype(np.uint16)


def generated_pool(target: Transformer, data: np.ndarray, count: int, length: int, prompt: int, seed: int,
                   path: Path, sampled: float = 0.5) -> np.ndarray:
    """`count` sequences of `length` tokens: a `prompt`-token slice of `data` and the target's continuation, greedy,
    or drawn at T = 1 for the share `sampled` (cached at `path`, whose name must hold every argument)."""
    if path.exists():
        return np.load(path)
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(data) - prompt - 1, count)
    prompts = np.stack([data[s:s + prompt] for s in starts])
    greedy = int(count * (1 - sampled))
    pool = np.concatenate([continuations(target, part, length - prompt, temperature, seed)
                           for part, temperature in ((prompts[:greedy], 0.0), (prompts[greedy:], 1.0)) if len(part)])
    np.save(path, pool)
    return pool


def block_losses(target: Transformer, drafter: DSpark, batch: torch.Tensor, anchors: int, rng: np.random.Generator
                 ) -> dict[str, torch.Tensor]:
    """The DSpark objective over `anchors` blocks per sequence of a [B, L] batch, with per-position statistics:
    {loss, ce, tv, bce: scalars; accept_t1 [N]: mean 1 - TV (acceptance of a drawn draft at T = 1); accept_greedy
    [N]: how often the draft's argmax equals the target's (teacher-forced prefix)}."""
    cfg, spec = drafter.cfg, drafter.dspark
    N, W = spec.block_size, cfg.sliding_window
    B, L = batch.shape
    with torch.no_grad():
        state = ModelState(target.cfg, B)
        out = target(batch, state.positions(L), state.views(), capture=spec.target_layer_ids)
        captured = capture(out.captured)                                          # [B, L, 3D]
        target_probs = out.logits.softmax(-1)                                     # [B, L, V]
    keys = drafter.context_keys(captured, torch.arange(L).expand(B, L))           # per stage [B, L, d]

    p = torch.from_numpy(rng.integers(0, L - N - 1, (B, anchors)))                # committed position [B, M]
    rows = torch.arange(B).unsqueeze(1).expand(B, anchors).reshape(-1)            # [BM]
    p = p.reshape(-1)
    ring = p.unsqueeze(1) - W + 1 + torch.arange(W)                               # [BM, W] ring positions
    visible = ring >= 0
    ring = ring.clamp(min=0)
    contexts = [BlockContext(k[rows.unsqueeze(1), ring], visible) for k in keys]  # [BM, W, d]
    anchor = batch[rows, p + 1]                                                   # [BM]
    y, logits = drafter.block(anchor, p + 1, contexts, N)                         # [BM, N, D], [BM, N, V]

    slots = p.unsqueeze(1) + 1 + torch.arange(N)                                  # [BM, N] positions p+1 .. p+N
    prev = batch[rows.unsqueeze(1), slots]                                        # anchor, then the true drafts
    truth = batch[rows.unsqueeze(1), slots + 1]                                   # x_{p+2} .. x_{p+N+1}
    last = drafter.mtp[-1]
    e = last.markov_head.markov_w1(prev)                                          # [BM, N, r]
    u = logits + last.markov_head.markov_w2(e).float()                            # [BM, N, V]
    confidence = last.confidence_head.proj(torch.cat([y, e], dim=-1)).float()[..., 0]   # [BM, N]
    p_t = target_probs[rows.unsqueeze(1), slots]                                  # [BM, N, V]
    p_d = u.softmax(-1)

    weight = torch.exp(-torch.arange(N, dtype=torch.float32) / N)                 # exp(-(k-1)/N), k = 1..N
    ce = F.cross_entropy(u.reshape(-1, u.shape[-1]), truth.reshape(-1), reduction="none").view(-1, N)
    tv = 0.5 * (p_d - p_t).abs().sum(-1)                                         # [BM, N]
    bce = F.binary_cross_entropy_with_logits(confidence, (1 - tv).detach(), reduction="none")
    per_slot = 0.1 * ce + 0.9 * tv + 1.0 * bce
    loss = (per_slot * weight).sum(-1).mean() / weight.sum()
    greedy = (u.argmax(-1) == p_t.argmax(-1)).float()
    return {"loss": loss, "ce": ce.mean(), "tv": tv.mean(), "bce": bce.mean(),
            "accept_t1": (1 - tv).mean(0).detach(), "accept_greedy": greedy.mean(0)}


def draw(data: np.ndarray, pool: np.ndarray | None, count: int, generated: int, length: int,
         rng: np.random.Generator) -> torch.Tensor:
    """A [count, length] batch: `generated` sequences from `pool` (the target's continuations), the rest slices of
    `data`."""
    starts = rng.integers(0, len(data) - length - 1, count - generated)
    rows = [data[s:s + length] for s in starts]
    if generated:
        rows += list(pool[rng.integers(0, len(pool), generated)])
    return torch.from_numpy(np.stack(rows).astype(np.int64))


@torch.no_grad()
def held_out(target: Transformer, drafter: DSpark, data: np.ndarray, length: int, batches: int,
             pool: np.ndarray | None = None) -> dict[str, object]:
    """The objective and per-position acceptance estimates on `batches` held-out batches of 8 x `length`: slices of
    `data`, or the target's continuations in `pool` when given."""
    rng = np.random.default_rng(1)
    sums: dict[str, object] = {}
    for _ in range(batches):
        batch = draw(data, pool, 8, 8 if pool is not None else 0, length, rng)
        for k, v in block_losses(target, drafter, batch, 16, rng).items():
            sums[k] = sums.get(k, 0) + v / batches
    return {k: (round(v.item(), 4) if v.dim() == 0 else [round(x, 3) for x in v.tolist()]) for k, v in sums.items()}


def write_release_layout(drafter: DSpark, raw: dict, output: Path) -> None:
    """The 0731 layout: tiny-v4's target shard copied byte for byte, the drafter's mtp.* tensors in FP8 blocks (bf16
    Markov tables, norms) in the last shard, config.json with the dspark_* keys, tokenizer.json."""
    index = json.loads((TARGET / "model.safetensors.index.json").read_text())["weight_map"]
    target_shard = {n: f for n, f in index.items() if not n.startswith("mtp.")}
    (shard,) = set(target_shard.values())
    drafted = {k: v for k, v in stored_tensors(drafter, torch.bfloat16, "fp8").items() if k.startswith("mtp.")}

    def write_shard(path: Path, names: list[str]) -> int:
        if set(names) == set(target_shard):
            shutil.copyfile(TARGET / shard, path)
            header = int.from_bytes(path.read_bytes()[:8], "little")        # safetensors: u64 header length
            return path.stat().st_size - 8 - header
        save_file({n: drafted[n] for n in names}, str(path), metadata={"format": "pt"})
        return sum(drafted[n].numel() * drafted[n].element_size() for n in names)

    write_checkpoint_folder(output, raw, list(target_shard) + list(drafted), 2, write_shard,
                            extra_files={"tokenizer.json": TARGET / "tokenizer.json"})


def main() -> None:
    p = training_arguments(__doc__.splitlines()[0], minutes=60, steps=1200, lr=1e-3)
    p.add_argument("--anchors", type=int, default=24, help="blocks drawn per sequence per step")
    p.add_argument("--markov-rank", type=int, default=None,
                   help="rank r of the Markov head (Flash: 256; default: the --init-from drafter's, else 64)")
    p.add_argument("--init-from", type=Path, default=None,
                   help="start the drafter from this DSpark checkpoint's mtp.* weights (e.g. examples/tiny-v4-dspark) "
                        "instead of tiny-v4's MTP block; a fresh optimizer and schedule")
    p.add_argument("--distill", type=float, default=0.0,
                   help="fraction of each batch drawn from the target's own continuations of training prompts "
                        "(half greedy, half at T = 1) rather than from the corpus")
    p.add_argument("--distill-pool", type=int, default=2048, help="how many continuations to generate (cached in WORK)")
    p.add_argument("--distill-prompt", type=int, default=64, help="corpus tokens before each continuation")
    p.add_argument("--distill-sampled", type=float, default=0.5,
                   help="share of the training continuations drawn at T = 1, the rest greedy (default 0.5; the "
                        "held-out continuations stay half and half, so runs compare)")
    args = p.parse_args()
    if not 0 <= args.distill <= 1:
        p.error(f"--distill {args.distill}: a fraction of the batch, from 0 to 1")
    if args.markov_rank is not None and args.markov_rank < 1:
        p.error(f"--markov-rank {args.markov_rank}: a rank of at least 1")
    if not 0 <= args.distill_sampled <= 1:
        p.error(f"--distill-sampled {args.distill_sampled}: a share of the continuations, from 0 to 1")
    if args.distill and not (args.distill_pool >= 2 and 0 < args.distill_prompt < args.length):
        p.error(f"--distill-pool {args.distill_pool} / --distill-prompt {args.distill_prompt}: at least 2 "
                f"continuations, and a prompt shorter than --length {args.length}")
    torch.set_num_threads(args.threads)
    say = training_log(args.work)

    from tokenizers import Tokenizer
    train_files, held_files = stdlib_split()
    tokenizer = Tokenizer.from_file(str(TARGET / "tokenizer.json"))
    train = encode(train_files, tokenizer, args.work / "train.npy")
    held = encode(held_files, tokenizer, args.work / "held.npy")
    say(f"corpus: {len(train_files)} training files ({len(train)} tokens), {len(held_files)} held out "
        f"({len(held)} tokens)")

    target = load_model(TARGET, mtp=True).requires_grad_(False)
    start = None
    if args.init_from:
        try:
            start = load_dspark(args.init_from)
        except V4EngineError as e:              # not a checkpoint, not a DSpark one: one line
            raise SystemExit(f"--init-from: {e}") from None
    rank = args.markov_rank or (start.dspark.markov_rank if start is not None else 64)
    raw = dspark_config(json.loads((TARGET / "config.json").read_text()), rank)
    drafter = dspark_for(target, raw, args.seed)
    if start is not None:
        mtp_only = {k: v for k, v in start.state_dict().items() if k.startswith("mtp.")}
        stored = start.dspark.markov_rank
        if stored < rank:
            mtp_only = widened_markov(mtp_only, drafter)
        if {k: v.shape for k, v in mtp_only.items()} != {k: v.shape for k, v in drafter.state_dict().items()
                                                          if k.startswith("mtp.")}:
            raise SystemExit(f"--init-from {args.init_from}: its drafter's tensors are not those of a tiny-v4 "
                             f"drafter with --markov-rank {rank} or less")
        drafter.load_state_dict(mtp_only, strict=False)
        say(f"drafter started from {args.init_from}" + (f" (Markov rank {stored} widened to {rank})"
                                                        if stored < rank else ""))
    generated = round(args.batch * args.distill)
    pool = held_pool = None
    if generated:
        shape = f"{args.length}-prompt{args.distill_prompt}-seed{args.seed}"
        sampled = "" if args.distill_sampled == 0.5 else f"-sampled{args.distill_sampled:g}"
        pool = generated_pool(target, train, args.distill_pool, args.length, args.distill_prompt, args.seed,
                              args.work / f"generated-train-{args.distill_pool}x{shape}{sampled}.npy",
                              args.distill_sampled)
        held_pool = generated_pool(target, held, 64, args.length, args.distill_prompt, args.seed + 1,
                                   args.work / f"generated-held-64x{shape}.npy")
        say(f"target continuations: {len(pool)} for training ({generated} of {args.batch} sequences a step), "
            f"{len(held_pool)} of held-out prompts")
    trained = [q for q in drafter.parameters() if q.requires_grad]
    say(f"drafter: {sum(q.numel() for q in trained) / 1e6:.2f} M trained parameters in mtp.0..2")
    optimizer = torch.optim.AdamW(trained, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    step, state_path = 0, args.work / "state.pt"
    if state_path.exists():
        saved = torch.load(state_path, weights_only=False)
        drafter.load_state_dict(saved["drafter"])
        optimizer.load_state_dict(saved["optimizer"])
        step = saved["step"]
        say(f"resumed at step {step}")
    else:
        say(f"held-out at step 0: {held_out(target, drafter, held, args.length, 4)}")
        if held_pool is not None:
            say(f"held-out continuations at step 0: {held_out(target, drafter, held, args.length, 4, held_pool)}")
    rng = np.random.default_rng(args.seed + step)
    started, last_save = time.time(), time.time()
    drafter.train()
    bar = tqdm(total=args.steps, initial=step, desc="train dspark", unit="step")
    while step < args.steps and time.time() - started < args.minutes * 60:
        lr = cosine_lr(step, args.steps, args.lr, warmup=50)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = draw(train, pool, args.batch, generated, args.length, rng)
        out = block_losses(target, drafter, batch, args.anchors, rng)
        optimizer.zero_grad(set_to_none=True)
        out["loss"].backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        optimizer.step()
        step += 1
        bar.update()
        if step % 20 == 0:
            say(f"step {step} loss {out['loss'].item():.4f} ce {out['ce'].item():.3f} tv {out['tv'].item():.3f} "
                f"bce {out['bce'].item():.3f} accept(T=1) {[round(x, 2) for x in out['accept_t1'].tolist()]} "
                f"lr {lr:.2e} elapsed {time.time() - started:.0f}s")
        if time.time() - last_save > 300:
            torch.save({"drafter": drafter.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
                       state_path)
            last_save = time.time()
    bar.close()
    torch.save({"drafter": drafter.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, state_path)
    drafter.eval()
    say(f"done at step {step}: held-out {held_out(target, drafter, held, args.length, 8)}")
    if held_pool is not None:
        say(f"held-out continuations: {held_out(target, drafter, held, args.length, 8, held_pool)}")
    if args.output:
        write_release_layout(drafter, raw, args.output)
        say(f"wrote {args.output}")


if __name__ == "__main__":
    main()
