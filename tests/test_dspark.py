"""DSpark, the drafter of the current V4 releases, held to its definition (docs/model.md §4.2).

No outside oracle runs DSpark on a CPU, so each part of ours is held against an independent formulation written
here (the block attention as a dense softmax with the sink column, the Markov loop one token at a time from the
raw weight tables, the capture from hooks on the target's layers), the draft graph against our PyTorch DSpark by
full recompute, and the runtime's accepted counts against a full-recompute run of the drafter's definition.
"""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
from tokenizers import Tokenizer

from v4engine.builder.build import BuildOptions, build, control_flow
from v4engine.builder.load import load_dspark, load_model
from v4engine.builder.model import ModelState
from v4engine.builder.model.drafting import draft_token
from v4engine.builder.model.dspark import BlockContext, capture, greedy_sampler
from v4engine.builder.release import RELEASES, release_tensors
from v4engine.contract.config import V4Config
from v4engine.contract.engine import EngineManifest
from v4engine.contract.errors import ConfigError
from v4engine.plugins import DOMAIN
from v4engine.runtime.cache import CachePool, SequenceCache
from v4engine.runtime.generator import Generator
from v4engine.runtime.pool_arrays import HostArrays
from v4engine.runtime.sampling import RequestError, SamplingParams
from v4engine.runtime.sessions import open_session

TOL = 1e-4


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("mixed", drafter="dspark")


@pytest.fixture(scope="module")
def models(checkpoint):
    return load_model(checkpoint, mtp=False), load_dspark(checkpoint)


# --------------------------------------------------------------------------- the release's layout
def test_the_0731_and_0813_layouts_are_read_and_hold_the_published_tensor_counts():
    flash = V4Config.from_dict(RELEASES["v4-flash-0731"][0])
    assert flash.dspark.target_layer_ids == (40, 41, 42) and flash.dspark.markov_rank == 256
    assert flash.dspark.stages == 3 and len(flash.layer_types) == 43
    tensors = release_tensors(RELEASES["v4-flash-0731"][0])
    # vLLM #41834 quotes the 0731 index: mtp.0 1,568 tensors, mtp.1 1,565, mtp.2 1,572 (scales counted)
    assert [sum(1 for n in tensors if n.startswith(f"mtp.{s}.")) for s in range(3)] == [1568, 1565, 1572]
    assert tensors["mtp.0.main_proj.weight"] == ("F8_E4M3", (4096, 12288))
    assert tensors["mtp.0.main_proj.scale"] == ("F8_E8M0", (32, 96))
    assert tensors["mtp.2.markov_head.markov_w2.weight"] == ("BF16", (129280, 256))
    assert tensors["mtp.2.confidence_head.proj.weight"] == ("BF16", (1, 4096 + 256))
    assert not any(n.startswith("mtp.") and ("e_proj" in n or "enorm" in n) for n in tensors)
    pro = V4Config.from_dict(RELEASES["v4-pro-0813"][0])
    assert pro.dspark.target_layer_ids == (58, 59, 60) and pro.dspark.markov_rank == 512


@pytest.mark.parametrize("change, names", [
    ({"model_type": "deepseek_v41"}, "deepseek_v41"),
    ({"dspark_target_layer_ids": [40, 43]}, "dspark_target_layer_ids"),
    ({"dspark_block_size": 0}, "dspark_block_size"),
    ({"dspark_noise_token_id": 129280}, "dspark_noise_token_id"),
    ({"dspark_markov_rank": "256"}, "dspark_markov_rank"),
    ({"compress_ratios": RELEASES["v4-flash"][0]["compress_ratios"][:43] + [0, 0]}, "compress_ratios"),
])
def test_a_wrong_dspark_config_is_refused_in_one_line_naming_the_field(change, names):
    with pytest.raises(ConfigError) as e:
        V4Config.from_dict({**RELEASES["v4-flash-0731"][0], **change})
    assert names in str(e.value) and "\n" not in str(e.value)


# --------------------------------------------------------------------------- each part, independently
def rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """RoPE on the trailing 2 * len(inv_freq) channels as complex multiplication (pairs (x0, x1) -> x0 + i x1)."""
    r = 2 * len(inv_freq)
    angle = positions.float().unsqueeze(-1) * inv_freq                               # [..., r/2]
    turn = torch.polar(torch.ones_like(angle), -angle if inverse else angle)
    while turn.dim() < x.dim():
        turn = turn.unsqueeze(-2)
    pairs = torch.view_as_complex(x[..., -r:].float().reshape(*x.shape[:-1], r // 2, 2).contiguous())
    return torch.cat([x[..., :-r], torch.view_as_real(pairs * turn).flatten(-2)], dim=-1)


def rms(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    x = x / x.pow(2).mean(-1, keepdim=True).add(eps).sqrt()
    return x if weight is None else x * weight


@torch.no_grad()
def test_block_attention_is_a_dense_softmax_over_the_context_and_the_whole_block_with_the_sink(models):
    _, dspark = models
    cfg, attn = dspark.cfg, dspark.mtp[1].attn
    gen = torch.Generator().manual_seed(0)
    B, N, T, H, d = 2, 5, cfg.sliding_window, cfg.num_attention_heads, cfg.head_dim
    x = torch.randn(B, N, cfg.hidden_size, generator=gen)
    positions = torch.tensor([[3], [40]]) + torch.arange(N)
    keys = torch.randn(B, T, d, generator=gen)
    visible = torch.rand(B, T, generator=gen) < 0.6
    got, _ = attn(x, positions, BlockContext(keys, visible))

    freqs, eps = attn.rotary.inv_freq, cfg.rms_norm_eps
    q = (rms(x @ attn.wq_a.weight.T, attn.q_norm.weight, eps) @ attn.wq_b.weight.T).view(B, N, H, d)
    q = rotate(rms(q, None, eps), positions, freqs)                                 # each head RMS-normed
    own = rotate(rms(x @ attn.wkv.weight.T, attn.kv_norm.weight, eps), positions, freqs)
    all_keys = torch.cat([keys, own], dim=1)                                        # the block sees all of it
    mask = torch.cat([visible, torch.ones(B, N, dtype=torch.bool)], dim=1)
    scores = torch.einsum("bnhd,btd->bnht", q, all_keys) * d ** -0.5
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    with_sink = torch.cat([scores, attn.attn_sink.view(1, 1, H, 1).expand(B, N, H, 1)], dim=-1)
    weights = torch.softmax(with_sink, dim=-1)[..., :-1]
    o = rotate(torch.einsum("bnht,btd->bnhd", weights, all_keys), positions, freqs, inverse=True)
    per_group = H * d // cfg.o_groups
    wo_a = attn.wo_a.weight.view(cfg.o_groups, cfg.o_lora_rank, per_group)
    groups = [o.reshape(B, N, cfg.o_groups, per_group)[:, :, g] @ wo_a[g].T for g in range(cfg.o_groups)]
    want = torch.cat(groups, dim=-1) @ attn.wo_b.weight.T
    assert (got - want).abs().max().item() <= TOL


@torch.no_grad()
def test_the_markov_loop_is_its_definition_one_token_at_a_time(models):
    _, dspark = models
    cfg, last = dspark.cfg, dspark.mtp[-1]
    gen = torch.Generator().manual_seed(1)
    B, N = 3, 6
    y, logits = torch.randn(B, N, cfg.hidden_size, generator=gen), 3 * torch.randn(B, N, cfg.vocab_size, generator=gen)
    anchor = torch.tensor([5, 9, 100])
    out = dspark.markov_drafts(y, logits, anchor, greedy_sampler)
    W1, W2 = last.markov_head.markov_w1.weight, last.markov_head.markov_w2.weight     # [V, r] each
    w = last.confidence_head.proj.weight[0]                                          # [D + r]
    for b in range(B):
        prev = int(anchor[b])
        for i in range(N):                              # U_i = logits_i + W2 . W1[prev_i]; position 0 included
            u = logits[b, i] + W2 @ W1[prev]
            assert (out.logits[b, i] - u).abs().max().item() <= 1e-5
            assert int(out.drafts[b, i]) == int(u.argmax())
            assert abs(float(out.confidence[b, i]) - float(w @ torch.cat([y[b, i], W1[prev]]))) <= 1e-5
            prev = int(u.argmax())


@torch.no_grad()
def test_the_capture_is_the_plain_mean_of_each_target_layers_output_streams(models):
    target, dspark = models
    ids = torch.randint(0, target.cfg.vocab_size, (2, 11), generator=torch.Generator().manual_seed(2))
    seen = {}
    hooks = [target.layers[i].register_forward_hook(lambda m, args, out, i=i: seen.__setitem__(i, out[0]))
             for i in dspark.dspark.target_layer_ids]
    state = ModelState(target.cfg, 2)
    out = target(ids, state.positions(11), state.views(), capture=dspark.dspark.target_layer_ids)
    for h in hooks:
        h.remove()
    want = torch.cat([(sum(seen[i][:, :, s] for s in range(4)) / 4) for i in dspark.dspark.target_layer_ids], -1)
    assert (capture(out.captured) - want).abs().max().item() <= 1e-6
    assert torch.equal(out.captured[-1], out.hidden), "the last captured layer is the pre-head residual"


# --------------------------------------------------------------------------- the draft graph against our PyTorch
@torch.no_grad()
def cycle_by_recompute(dspark, captured: np.ndarray, anchor: int, k: int, temperature: float, uniforms: np.ndarray):
    """DSpark's cycle from scratch for one row whose committed positions 0..p have `captured` rows [p+1, L*D]:
    the context keys of all of them, the last min(W, p + 1) in the block's view, the block at p + 1, the Markov
    loop (drafts drawn as the graph draws them). Returns (drafts, probs, confidence, every stage's keys)."""
    W, n = dspark.cfg.sliding_window, len(captured)
    keys = dspark.context_keys(torch.from_numpy(captured)[None], torch.arange(n)[None])
    contexts = [BlockContext(k_[:, -W:], torch.ones(1, min(W, n), dtype=torch.bool)) for k_ in keys]
    y, logits = dspark.block(torch.tensor([anchor]), torch.tensor([n]), contexts, k)
    settings = torch.tensor([temperature]), torch.tensor([0]), torch.tensor([1.0])
    out = dspark.markov_drafts(y, logits, torch.tensor([anchor]),
                               lambda u, i: draft_token(u, *settings, torch.from_numpy(uniforms[i:i + 1])))
    return out.drafts[0].numpy(), out.probs[0].numpy(), out.confidence[0].numpy(), [k_[0].numpy() for k_ in keys]


@pytest.fixture(scope="module")
def dspark_engine(tiny_engine):
    """A DSpark engine built --mtp 7 whose drafts are often accepted (make-tiny --agree: its Markov head is the
    target's bigram, the stages' share of the logits scaled by 0.1): one engine for every test here."""
    return tiny_engine("mixed", mtp=7, drafter="dspark", agree=0.1)


@pytest.mark.parametrize("lengths", [[5], [3, 20, 9]], ids=["batch 1", "batch 3"])
def test_the_draft_graph_equals_our_pytorch_dspark_before_and_after_its_rings_fill(dspark_engine, lengths):
    checkpoint, engine = dspark_engine
    manifest = EngineManifest.read(engine)
    dspark, k, width = load_dspark(checkpoint), manifest.mtp, manifest.graphs["draft"].inputs[0].shape[-1]
    session = open_session(engine, manifest, "draft")
    pool = CachePool(manifest.caches["draft"], len(lengths), 1, HostArrays("fp32"))
    caches = [SequenceCache(pool) for _ in lengths]
    rng = np.random.default_rng(3)
    rows = [rng.standard_normal((n + 4, width)).astype(np.float32) for n in lengths]     # every position's capture
    temperature = np.array([b % 2 for b in range(len(lengths))], np.float32)            # greedy and sampled rows
    for call, (lo, hi) in enumerate([(0, lengths), ([n for n in lengths], [n + 3 for n in lengths])]):
        lo = lo if isinstance(lo, list) else [0] * len(lengths)
        S = max(h - l for l, h in zip(lo, hi))
        fed = np.zeros((len(lengths), S, width), np.float32)
        for b, (l, h) in enumerate(zip(lo, hi)):
            fed[b, : h - l] = rows[b][l:h]
        anchors = rng.integers(0, manifest.model.vocab_size, len(lengths))
        uniforms = rng.random((len(lengths), k), dtype=np.float32)
        out = session.run({"captured": fed, "positions": np.array(lo)[:, None] + np.arange(S),
                           "lengths": np.array([h - l for l, h in zip(lo, hi)]), "anchor": anchors,
                           "temperature": temperature, "top_k": np.zeros(len(lengths), np.int64),
                           "top_p": np.ones(len(lengths), np.float32), "uniforms": uniforms, **pool.feeds(caches)})
        groups = manifest.caches["draft"].groups
        for b, (l, h) in enumerate(zip(lo, hi)):
            drafts, probs, confidence, keys = cycle_by_recompute(dspark, rows[b][:h], int(anchors[b]), k,
                                                                 float(temperature[b]), uniforms[b])
            assert out["drafts"][b].tolist() == drafts.tolist(), f"call {call}, row {b}"
            assert np.abs(out["draft_probs"][b] - probs).max() <= TOL
            assert np.abs(out["confidence"][b] - confidence).max() <= TOL
            for g, stage_keys in zip(groups, keys):
                assert np.abs(out[g.new][b, : h - l] - stage_keys[l:h]).max() <= TOL
            caches[b].commit({g.pool: out[g.new][b] for g in groups}, h - l)


# --------------------------------------------------------------------------- the runtime: lossless, by recompute
EVERY_DRAFT = {"confidence_scheduling": False}     # every draft verified: the counts compare step by step


def test_greedy_tokens_with_1_to_7_drafts_equal_no_drafting(dspark_engine):
    _, engine = dspark_engine
    prompts = [[5, 17, 99, 3, 42, 8, 61], list(range(20, 50)), [7]]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    plain = [r.token_ids for r in Generator.from_engine_dir(engine, mtp=0).generate(prompts, params)]
    for n in range(1, 8):
        generator = Generator.from_engine_dir(engine, mtp=n, **EVERY_DRAFT)
        assert [r.token_ids for r in generator.generate(prompts, params)] == plain, f"N = {n}"
        assert 0 < generator.totals.accepted < generator.totals.drafted, "drafts both accepted and rejected"


@pytest.mark.parametrize("drafter, prompt", [
    ("dspark_engine", [5, 17, 99, 3, 42, 8, 61, 2, 9, 14, 33]),
    ("trained_dspark_engine", "def read_lines(path):\n    with open(path) as f:\n        for line in f:\n")],
    ids=["the random drafter", "the shipped trained drafter"])
@torch.no_grad()
def test_accepted_counts_equal_a_full_recompute_of_the_drafters_definition(request, drafter, prompt):
    """Each step: the target over every committed token from scratch (capturing), the drafter's cycle from scratch
    on those rows, greedy verification by the target from scratch: the accepted count the runtime reported."""
    checkpoint, engine = request.getfixturevalue(drafter)
    if isinstance(prompt, str):
        prompt = Tokenizer.from_file(str(checkpoint / "tokenizer.json")).encode(prompt).ids
    target, dspark = load_model(checkpoint, mtp=False), load_dspark(checkpoint)
    k = 5
    got = Generator.from_engine_dir(engine, mtp=k, **EVERY_DRAFT).generate([prompt], SamplingParams(max_new_tokens=30,
                                                                                      ignore_eos=True))[0]

    def run(tokens: list[int]):
        state = ModelState(target.cfg, 1)
        return target(torch.tensor([tokens]), state.positions(len(tokens)), state.views(),
                      capture=dspark.dspark.target_layer_ids)

    tokens = prompt + [int(run(prompt).logits[0, -1].argmax())]
    counts = []
    while len(tokens) - len(prompt) < 30:
        committed = run(tokens[:-1])                                     # positions 0..p; the anchor is at p + 1
        drafts, *_ = cycle_by_recompute(dspark, capture(committed.captured)[0].numpy(), tokens[-1], k, 0.0,
                                        np.zeros(k, np.float32))
        verify = run(tokens + drafts.tolist()).logits[0, len(tokens) - 1:].argmax(-1).tolist()
        accepted = next((i for i, (d, t) in enumerate(zip(drafts, verify)) if d != t), k)
        counts.append(accepted)
        tokens += verify[: accepted + 1]
    assert got.metrics["accepted_per_step"][: len(counts) - 1] == counts[:-1]
    assert got.token_ids == tokens[len(prompt):][:30]
    assert 0 < sum(counts) < k * len(counts)


def test_pipeline_stages_hand_the_captured_rows_on_and_give_the_same_tokens_and_acceptance(dspark_engine, tmp_path):
    """The tiny model's captured layers 1-3 cut by two stages: the first returns what it captured of layer 1, the
    second takes it (`captured_in`) and returns all three rows beside the drafter."""
    checkpoint, engine = dspark_engine
    staged = build(BuildOptions(checkpoint=checkpoint, output=tmp_path / "staged", mtp=7, pipeline_stages=2,
                                progress=False))
    first, last = (staged.graphs[name] for name in staged.stage_graphs)
    assert "captured" in [o.name for o in first.outputs] and "captured_in" in [i.name for i in last.inputs]
    prompts, params = [[5, 17, 99, 3, 42, 8, 61], list(range(20, 50))], SamplingParams(max_new_tokens=30,
                                                                                      ignore_eos=True)
    want = Generator.from_engine_dir(engine, mtp=5, **EVERY_DRAFT).generate(prompts, params)
    got = Generator.from_engine_dir(tmp_path / "staged", mtp=5, **EVERY_DRAFT).generate(prompts, params)
    assert [(r.token_ids, r.metrics["accepted_per_step"]) for r in got] == \
        [(r.token_ids, r.metrics["accepted_per_step"]) for r in want]


def test_the_engine_names_its_drafter_and_reports_confidence(dspark_engine):
    _, engine = dspark_engine
    manifest = json.loads((engine / "engine.json").read_text())
    assert manifest["drafter"] == "dspark" and manifest["mtp"] == 7
    assert "captured" in [o["name"] for o in manifest["graphs"]["target"]["outputs"]]
    generator = Generator.from_engine_dir(engine, mtp=5, **EVERY_DRAFT)
    result = generator.generate([[5, 17, 99]], SamplingParams(max_new_tokens=20, ignore_eos=True))[0]
    confidence = result.metrics["mean_confidence"]
    assert len(confidence) == 5 and all(0 < c < 1 for c in confidence)


def test_greedy_drafting_is_chosen_per_request_or_per_generator(dspark_engine):
    _, engine = dspark_engine
    sampled = dict(max_new_tokens=24, ignore_eos=True, temperature=1.0, seed=7)
    per_request = Generator.from_engine_dir(engine, mtp=5, **EVERY_DRAFT).generate(
        [[5, 17, 99]], SamplingParams(**sampled, draft_sample_method="greedy"))[0]
    per_generator = Generator.from_engine_dir(engine, mtp=5, draft_sample_method="greedy",
                                             **EVERY_DRAFT).generate(
        [[5, 17, 99]], SamplingParams(**sampled))[0]
    assert (per_request.token_ids, per_request.metrics["accepted_per_step"]) == \
        (per_generator.token_ids, per_generator.metrics["accepted_per_step"])
    with pytest.raises(RequestError, match="draft_sample_method must be one of probabilistic, greedy"):
        Generator.from_engine_dir(engine, draft_sample_method="typical")
    with pytest.raises(RequestError, match="draft_sample_method must be one of"):
        SamplingParams(draft_sample_method="block").validate()


def test_the_dspark_engine_for_tensorrt_its_cuda_graphs_form_and_migraphx(dspark_engine, tmp_path):
    """The same draft graph prepared for each backend (the exports are shared with the ONNX Runtime engine's):
    TensorRT's routed experts as v4 plugin nodes with the draft's extend and cycle profiles, its --cuda-graphs form
    without control flow, and MIGraphX's variant within its allowlist (a build checks it)."""
    checkpoint, _ = dspark_engine
    common = dict(checkpoint=checkpoint, mtp=7, dtype="fp32", progress=False)
    trt = build(BuildOptions(output=tmp_path / "trt", backend="tensorrt", backend_options={"onnx_only": True},
                             **common))
    draft = onnx.load(str(tmp_path / "trt" / "draft.onnx"), load_external_data=False)
    assert any(n.op_type.endswith("RoutedExperts") and n.domain == DOMAIN for n in draft.graph.node)
    assert {p.name for p in trt.compiled.profiles["draft"]} == {"extend", "cycle"}
    build(BuildOptions(output=tmp_path / "graphs", backend="tensorrt", backend_options={"onnx_only": True,
                                                                                         "cuda_graphs": True}, **common))
    assert not control_flow(onnx.load(str(tmp_path / "graphs" / "draft.onnx"), load_external_data=False))
    mgx = build(BuildOptions(output=tmp_path / "mgx", backend="migraphx", **common))
    assert mgx.drafter == "dspark" and (tmp_path / "mgx" / "draft.onnx").is_file()
