"""Lightning indexer top-k (docs/model.md §2.7): which compressed rows each CSA query attends to.

score[t, r] = sum_h weights[t,h] * ReLU(q[t,h] . key[r]) * scale over the rows visible to t
(0 <= row_id < (t+1) // ratio). The top min(topk, R) rows are kept, ties broken by LOWEST slot index
(rows are stored in window order, so the lowest window wins) in every realisation: ReLU makes whole
rows of scores exactly 0, and an unstable top-k would select different rows in prefill and decode
(docs/model.md §7). ONNX TopK keeps index order among equal values, so its lowering is already stable.
Picks that are not visible come back as -1.
"""
from __future__ import annotations

import torch
from onnxscript import FLOAT, INT64, script

from .attention import RowsVisible, rows_visible
from .common import NEG_INF, V4, exporting, op, symbolic
from .paging import PagedRows, PagedRowsDense


def visible_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, key_ids: torch.Tensor,
                   q_pos: torch.Tensor, ratio: int, scale: float) -> torch.Tensor:
    """[B,S,R] fp32 scores of every row for every query, -inf where the row is not visible to the query.

    Public because the checks of other realisations (whose sums run in another order) compare the scores of
    the rows they pick, not only the indices."""
    scores = torch.relu(torch.einsum("bshd,brd->bshr", q.float(), keys.float())) * scale
    scores = (scores * weights.float().unsqueeze(-1)).sum(dim=2)
    return scores.masked_fill(~rows_visible(q_pos, key_ids, ratio), NEG_INF)


def _reference(q, weights, keys, key_ids, q_pos, topk, ratio, scale):
    scores = visible_scores(q, weights, keys, key_ids, q_pos, ratio, scale)
    visible = rows_visible(q_pos, key_ids, ratio)
    k = min(topk, keys.shape[1])
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    return torch.where(torch.gather(visible, -1, order), order, torch.full_like(order, -1))


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor | PagedRows, key_ids: torch.Tensor,
                 q_pos: torch.Tensor, *, topk: int, ratio: int, scale: float) -> torch.Tensor:
    """v4::IndexerTopK. q [B,S,h,dI]; weights [B,S,h]; keys [B,R,dI]; key_ids [B,R]; q_pos [B,S] -> [B,S,k] int64.
    Keys as PagedRows (plugins/paging.py): v4::IndexerTopKPaged, the same picks."""
    if isinstance(keys, PagedRows):
        return indexer_topk_paged(q, weights, keys.pool, keys.block_table, keys.new, key_ids, q_pos, topk=topk,
                                  ratio=ratio, scale=scale)
    if exporting():
        k = torch.sym_min(topk, keys.shape[1])
        return symbolic("IndexerTopK", [q, weights, keys, key_ids, q_pos], dict(topk=topk, ratio=ratio, scale=scale),
                        [torch.int64], [(q.shape[0], q.shape[1], k)])[0]
    return _reference(q, weights, keys, key_ids, q_pos, topk, ratio, scale)


def indexer_topk_paged(q: torch.Tensor, weights: torch.Tensor, pool: torch.Tensor, block_table: torch.Tensor,
                       new_keys: torch.Tensor, key_ids: torch.Tensor, q_pos: torch.Tensor, *, topk: int, ratio: int,
                       scale: float) -> torch.Tensor:
    """v4::IndexerTopKPaged: IndexerTopK on PagedRows(pool, block_table, new_keys)."""
    if exporting():
        k = torch.sym_min(topk, key_ids.shape[1])
        return symbolic("IndexerTopKPaged", [q, weights, pool, block_table, new_keys, key_ids, q_pos],
                        dict(topk=topk, ratio=ratio, scale=scale), [torch.int64], [(q.shape[0], q.shape[1], k)])[0]
    keys = PagedRows(pool, block_table, new_keys).dense()
    return _reference(q, weights, keys, key_ids, q_pos, topk, ratio, scale)


@script(V4, default_opset=op)
def IndexerTopK(q: FLOAT, weights: FLOAT, keys: FLOAT, key_ids: INT64, q_pos: INT64, topk: int, ratio: int,
                scale: float) -> INT64:
    qf = op.Cast(q, to=FLOAT.dtype)                                                        # scored in fp32
    kf = op.Cast(keys, to=FLOAT.dtype)
    per_head = op.MatMul(qf, op.Unsqueeze(op.Transpose(kf, perm=[0, 2, 1]), [1]))          # [B,S,h,R]
    per_head = op.Relu(per_head) * op.CastLike(scale, qf)
    scores = op.ReduceSum(per_head * op.Unsqueeze(op.Cast(weights, to=FLOAT.dtype), [-1]), [2], keepdims=0)
    visible = RowsVisible(q_pos, key_ids, ratio=ratio)
    scores = op.Where(visible, scores, op.CastLike(NEG_INF, scores))
    k = op.Min(op.Reshape(op.CastLike(topk, key_ids), [1]), op.Shape(keys, start=1, end=2))
    values, order = op.TopK(scores, k, axis=-1, largest=1, sorted=1)
    return op.Where(op.GatherElements(visible, order, axis=-1), order, op.CastLike(-1, order))


@script(V4, default_opset=op)
def IndexerTopKPaged(q: FLOAT, weights: FLOAT, pool: FLOAT, block_table: INT64, new_keys: FLOAT, key_ids: INT64,
                     q_pos: INT64, topk: int, ratio: int, scale: float) -> INT64:
    keys = PagedRowsDense(pool, block_table, new_keys)
    return IndexerTopK(q, weights, keys, key_ids, q_pos, topk=topk, ratio=ratio, scale=scale)


PLUGIN_FUNCTIONS = (IndexerTopK, IndexerTopKPaged)
HELPER_FUNCTIONS = ()
