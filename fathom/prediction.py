"""Scores as the best linear prediction of ``q·k`` from the planes read (a score estimator for any plane method).

A plane method reads some channels ``R`` of each key to depths ``b_c`` and scores ``Σ_{c∈R} q_c · k̂_{b_c}[c]``:
the unread channels count as zero and a shallow read counts as if it were the key. Keys' channels are correlated
(on the raw basis strongly, and on the rotated one the calibration's decorrelation drifts with the context), so the
planes read also say something about the channels left unread. The linear minimum-mean-square-error estimate of
``q·k`` from the read values ``k̂_R`` is ``q·μ + xᵀ(k̂_R − μ_R)`` with

    x = (C_RR + D_R)⁻¹ C_R: q

where ``C`` is the keys' covariance ``[d, d]`` and ``D_R`` the read noise of each read channel at its depth
(the variance of ``k − k̂_b``: the plane reads taken as the key plus independent noise). The constant ``q·μ`` is the same for
every token of a query and leaves its top-k as it is, so the method scores ``x·k̂_R``: its own scan over the same
planes with the query ``x`` in place of ``q`` on the channels read. Nothing more is read per token (design §4's
bits are unchanged); at full depth on every channel with no noise ``x = q``.

``C`` and ``D`` are the store's own statistics (:func:`store_moments`): the covariance of the 4-bit keys over the
sealed blocks, and the variance of the difference between the 4-bit key and its depth-``t`` read, both over the
blocks a position's store holds — no calibration text, no exact key, and they follow the context as the store's σ²
does. A research estimator measured by ``python -m bench fidelity`` (its ``[lmmse]`` curves, every plane method);
the offloaded step does not run it.

Example (every channel read to depth 4, no noise: the prediction is the query itself)::

    >>> import numpy as np
    >>> from fathom.prediction import predicted_queries, store_moments
    >>> rng = np.random.default_rng(0)
    >>> keys = rng.standard_normal((256, 8)) @ rng.standard_normal((8, 8))
    >>> moments = store_moments([keys] * 4, np.array([4]))
    >>> q = rng.standard_normal((1, 2, 8)).astype(np.float32)
    >>> x = predicted_queries(q, np.full((1, 8), 4), moments)
    >>> bool(np.allclose(x, q, atol=1e-4))
    True
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fathom import _checks
from fathom.quantize import BLOCK, MAX_DEPTH

RIDGE = 1e-6  # added to the solve's diagonal, relative to its mean: a channel constant over the store is singular


@dataclass(frozen=True)
class StoreMoments:
    """The store's key statistics at the contexts of a set of positions.

    ``cov float64 [U, d, d]``: the 4-bit keys' covariance over the first ``blocks`` sealed blocks, one per distinct
    block count; ``noise float64 [U, 4, d]``: the variance of ``k̂_4 − k̂_t`` per depth ``t`` and channel over the
    same blocks (its mean, a read's bias, is a constant of the score); ``which int [P]``: the entry position ``p`` reads.
    """

    cov: np.ndarray
    noise: np.ndarray
    which: np.ndarray


def store_moments(khats: list[np.ndarray], blocks: np.ndarray) -> StoreMoments:
    """:class:`StoreMoments` of the sealed keys read at every depth, ``khats[t - 1] float [n_sealed, d]`` (t = 1..4),
    at the contexts of ``blocks int [P]`` sealed blocks (at most the blocks held; none: zero moments).

    The sums run once over the blocks up to the largest count, so the cost is one pass over the keys however many
    positions ask.
    """
    if len(khats) != MAX_DEPTH:
        raise ValueError(f"khats must hold the keys at depths 1..{MAX_DEPTH}, got {len(khats)} arrays")
    blocks = _checks.array("blocks", blocks, ndim=1, kind="iu")
    n, d = khats[0].shape
    if blocks.size and (blocks.min() < 0 or blocks.max() * BLOCK > n):
        raise ValueError(f"blocks must lie in 0..{n // BLOCK} (the sealed blocks held), got {blocks.min()}.."
                         f"{blocks.max()}")
    counts, which = np.unique(blocks, return_inverse=True)
    total, outer = np.zeros(d), np.zeros((d, d))
    gap, gap2 = np.zeros((MAX_DEPTH, d)), np.zeros((MAX_DEPTH, d))  # sums of k̂_4 − k̂_t and of its square
    cov, mean_noise = np.zeros((len(counts), d, d)), np.zeros((len(counts), MAX_DEPTH, d))
    start = 0
    for u, count in enumerate(counts):
        stop = int(count) * BLOCK
        full = khats[-1][start:stop].astype(np.float64)
        total += full.sum(axis=0)
        outer += full.T @ full
        for t in range(MAX_DEPTH):
            diff = full - khats[t][start:stop]
            gap[t] += diff.sum(axis=0)
            gap2[t] += (diff * diff).sum(axis=0)
        if stop:  # no block sealed yet: no statistic, and every read scores 0
            mean = total / stop
            cov[u] = outer / stop - np.outer(mean, mean)
            mean_noise[u] = gap2 / stop - (gap / stop) ** 2
        start = stop
    return StoreMoments(cov, mean_noise, which.astype(np.int64))


def predicted_queries(q: np.ndarray, depths: np.ndarray, moments: StoreMoments) -> np.ndarray:
    """The queries a plane method scores with under the prediction: ``x`` of the module's formula on the channels
    each position reads, 0 elsewhere.

    Args:
        q: float ``[P, G, d]`` query groups in the store's basis.
        depths: int ``[P, d]`` the depths each group reads (shared by its G heads).
        moments: the store's :class:`StoreMoments` at the P positions' contexts.
    Returns:
        float32 ``[P, G, d]``.
    """
    q = _checks.array("q", q, ndim=3, kind="f")
    depths = _checks.depths("depths", depths, q.shape[2])
    if depths.shape != (q.shape[0], q.shape[2]):
        raise ValueError(f"depths must have shape {(q.shape[0], q.shape[2])}, got {depths.shape}")
    if moments.which.shape != (q.shape[0],):
        raise ValueError(f"moments must be taken at the {q.shape[0]} positions of q, got {moments.which.shape[0]}")
    read = depths > 0  # [P, d]
    cov, noise = moments.cov[moments.which], moments.noise[moments.which]  # [P, d, d], [P, 4, d]
    depth_noise = np.take_along_axis(noise, np.maximum(depths.astype(np.int64) - 1, 0)[:, None, :], axis=1)[:, 0]
    # one batched solve over every channel: an unread channel's row and column are the identity's and its right-hand
    # side 0, so its x is 0 and the read channels' system is (C_RR + D_R) x_R = C_R: q alone
    both = read[:, :, None] & read[:, None, :]
    system = np.where(both, cov, 0.0) + np.eye(q.shape[2]) * np.where(read, depth_noise, 1.0)[:, None, :]
    size = np.maximum(read.sum(axis=1), 1)
    trace = np.where(read, np.diagonal(system, axis1=1, axis2=2), 0.0).sum(axis=1)
    ridge = RIDGE * np.maximum(trace / size, np.finfo(np.float64).tiny)
    system += np.eye(q.shape[2]) * np.where(read, ridge[:, None], 0.0)[:, None, :]
    rhs = np.where(read[:, :, None], cov @ np.swapaxes(q, 1, 2).astype(np.float64), 0.0)  # [P, d, G]
    return np.swapaxes(np.linalg.solve(system, rhs), 1, 2).astype(np.float32)
