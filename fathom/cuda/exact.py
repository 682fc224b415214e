"""Scores from staged 16-bit rows (SPEC §7, §8 step 3), in torch: the oracle's exact ``q · k`` over the bf16
K rows, and landmark's ``q · mark`` over the fp16 mean keys, where every token of an 8-token block takes
its block's score (the twins of ``fathom.scoring.exact_scores`` / ``landmark_scores``, float32 tolerance).
"""

from __future__ import annotations

import torch


def row_scores(q: torch.Tensor, rows: torch.Tensor, n_rows: int, dtype: torch.dtype, repeat: int,
               scores: torch.Tensor) -> None:
    """Write ``scores[:, :, :n_rows · repeat]`` of ``q float32 [S, G, d]`` against 16-bit ``rows [S, ≥ n_rows, d]``.

    Args:
        dtype: what the 16-bit words hold (``torch.bfloat16`` K rows or ``torch.float16`` landmarks).
        repeat: tokens per row (1 for K rows, 8 for landmarks: each token scores as its block).
        scores: float32 ``[S, G, ≥ n_rows · repeat]``.
    """
    if rows.shape[1] < n_rows or scores.shape[2] < n_rows * repeat or rows.shape[0] != q.shape[0]:
        raise ValueError(f"rows {tuple(rows.shape)} / scores {tuple(scores.shape)} do not hold {n_rows} rows "
                         f"of {repeat} tokens")
    if n_rows == 0:
        return
    block = torch.bmm(q, rows[:, :n_rows].view(dtype).float().transpose(1, 2))  # [S, G, n_rows]
    scores[:, :, :n_rows * repeat].unflatten(2, (n_rows, repeat)).copy_(block.unsqueeze(-1).expand(-1, -1, -1,
                                                                                                     repeat))
