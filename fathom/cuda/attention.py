"""Exact softmax attention of each query head over its own selected rows (SPEC §6, §8 step 6), in torch.

The rows of a KV head are the union of its heads' selections (``fathom.cuda.topk``);
``head_mask`` bit h says which of them head h selected.
"""

from __future__ import annotations

import torch


def selected_attention(q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, head_mask: torch.Tensor,
                       n_rows: torch.Tensor, scale: float) -> torch.Tensor:
    """``softmax(q kᵀ · scale) v`` per head over its selected rows.

    Args:
        q: ``[groups, G, d]``; k_rows, v_rows: bf16 ``[groups, max_rows, d]`` (rows past ``n_rows`` are stale);
        head_mask: int32/uint32-valued ``[groups, max_rows]``; n_rows: ``[groups]``.
    Returns:
        float32 ``[groups, G, dv]``.
    """
    heads = q.shape[1]
    max_rows = k_rows.shape[1]
    logits = torch.einsum("ghd,grd->ghr", q.float(), k_rows.float()) * scale
    valid = torch.arange(max_rows, device=q.device)[None, :] < n_rows.long()[:, None]  # [groups, rows]
    bits = (head_mask.long()[:, None, :] >> torch.arange(heads, device=q.device)[None, :, None]) & 1
    selected = (bits == 1) & valid[:, None, :]
    logits = logits.masked_fill(~selected, float("-inf"))
    weights = torch.softmax(logits, dim=-1)
    v = torch.where(valid[:, :, None], v_rows.float(), 0.0)  # stale rows may hold NaN bit patterns
    return torch.einsum("ghr,grd->ghd", weights, v)
