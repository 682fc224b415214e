"""Torch twin of :func:`fathom.fidelity.evaluate`: every method on every layer, KV head and decode position of a
capture, on any torch device (design §6).

What is O(P·d) per head stays the reference's own, on the host: the depth policies
(:func:`fathom.decode.plane_depths`), the query rotation, the predicted queries of a method that predicts
(:func:`fathom.prediction.predicted_queries`), the landmarks, the protocol's fixed masks and the bit accounting
(:class:`fathom.fidelity.Tally`). Every O(n) step runs in torch on ``device``:

* the dequantized copies ``k̂_1..4`` of each store (:func:`dequantized_copies`: the codes of
  :func:`fathom.quantize.quantize`, bit for bit);
* each store's key covariance and read noise (:meth:`_Head.store_moments`), for the methods that predict;
* the scores of a chunk of methods at every position, one GEMM per store:
  ``[q ⊙ [b_c = t]]_{c,t} @ [k̂_t[:, c]]_{c,t}ᵀ`` (the depth one-hot folded into the inner dimension);
* the selection protocol (:func:`select_many`: sink, local, tail, top-k per head, ties to the earlier token);
* exact attention over each selected set, the relative error against dense, union rows and the overlap with
  the oracle's top-k, in float64 like the reference.

Equal to the NumPy path within float32 tolerance: scores are summed in another order, so a selection can differ
only where a score ties a head's k-th (tested on the CPU in CI, on a CUDA device with the ``gpu`` marker).

Example (the same numbers as the NumPy path)::

    >>> from fathom import methods as M
    >>> from fathom.cuda.fidelity import evaluate
    >>> from fathom import fidelity
    >>> from fathom.selection import Selection
    >>> from fathom.synthetic import SyntheticConfig, generate
    >>> cap = generate(SyntheticConfig(layers=1, kv_heads=1, group_size=2, head_dim=16, tokens=256, positions=4))
    >>> grid, sel = [M.fathom(24), M.sparq(4), M.oracle()], Selection(k=32)
    >>> twin = [r.rel_error for r in evaluate(cap, None, grid, sel, device="cpu")]
    >>> reference = [r.rel_error for r in fidelity.evaluate(cap, None, grid, sel)]
    >>> all(abs(a - b) < 1e-9 for a, b in zip(twin, reference))
    True
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import numpy as np
import torch

from fathom.calibration import Calibration
from fathom.capture import Capture
from fathom.decode import plane_depths, running_scale_variance, unit_stats
from fathom.fidelity import MethodResult, Tally, check_levels_source, head_methods, needs_rotated
from fathom.methods import HeadStats, Method, pooled_depths
from fathom.prediction import StoreMoments, predicted_queries
from fathom.quantize import BLOCK, MAX_DEPTH, check_levels
from fathom.scoring import LANDMARK_TOKENS, landmarks
from fathom.selection import Selection, protocol_masks

CPU_CHUNK_ELEMENTS = 1 << 25  # method × position × head × token entries per chunk on the CPU (~1 GiB of work)
BYTES_PER_CHUNK_ELEMENT = 48  # scores, masks and float64 softmax of one entry, with room for temporaries


def dequantized_copies(keys: torch.Tensor, levels: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The sealed keys as the scan sees them at every depth (design §2).

    Args:
        keys: float32 ``[n, d]`` (the tail past the last full 64-token block is not sealed and not returned).
        levels: the reconstruction table ``float32 [d, 4, 16]`` the planes are read through (None: the midpoints).
    Returns:
        ``k̂ float32 [4, n_sealed, d]`` (depth t at index t - 1) and ``scales float16 [d, n_sealed // 64]``,
        equal to :func:`fathom.quantize.dequantize` at uniform depths and :func:`fathom.quantize.quantize`.
    """
    if keys.dtype != torch.float32 or keys.ndim != 2:
        raise ValueError(f"keys must be float32 [n, d], got {keys.dtype} {tuple(keys.shape)}")
    n, d = keys.shape
    nb = n // BLOCK
    blocks = keys[:nb * BLOCK].reshape(nb, BLOCK, d)
    if not torch.isfinite(blocks).all():
        raise ValueError("keys must be finite (found NaN or inf)")
    s16 = blocks.abs().amax(dim=1).to(torch.float16)  # [nb, d]
    if not torch.isfinite(s16).all():
        raise ValueError("keys have a block maximum beyond the float16 range (65504); its scale cannot be stored")
    delta = (s16.float() / 8)[:, None, :]  # [nb, 1, d]
    zero = delta == 0
    codes = torch.where(zero, 8.0, torch.floor(blocks / torch.where(zero, 1.0, delta)) + 8).clamp(0, 15)
    codes = codes.to(torch.int32)
    table = None if levels is None else torch.from_numpy(check_levels(levels, d)).to(keys.device)
    copies = []
    for t in range(1, MAX_DEPTH + 1):
        cell = float(2 ** (MAX_DEPTH - t))
        prefix = codes >> (MAX_DEPTH - t)  # the t-bit code u >> (4 - t)
        if table is None:
            copies.append(((prefix.float() + 0.5) * cell - 8.0) * delta)
        else:  # each channel's level of its cell: table[c, t - 1, prefix]
            level = torch.gather(table[:, t - 1].expand(nb, BLOCK, d, -1), 3, prefix.long()[..., None])[..., 0]
            copies.append(level * delta)
    return torch.stack(copies).reshape(MAX_DEPTH, nb * BLOCK, d), s16.T.contiguous()


def select_many(scores: torch.Tensor, keep: torch.Tensor, candidate: torch.Tensor, k: int) -> torch.Tensor:
    """Twin of :func:`fathom.selection.select_many`: each head's selected set -> bool ``[..., P, G, n]``.

    Args:
        scores: float32 ``[..., P, G, S]`` scores of the first ``S`` tokens (``S <= n``).
        keep: bool ``[P, n]`` always selected (sink, local, tail); candidate: bool ``[P, n]`` the tokens top-k
            chooses from (none past ``S``); both from :func:`fathom.selection.protocol_masks`.
        k: top-k per query head.
    """
    S, n = scores.shape[-1], keep.shape[-1]
    mask = keep[:, None, :].expand(scores.shape[:-1] + (n,)).clone()
    top = min(k, S)
    if top == 0:
        return mask
    eligible = candidate[:, None, :S]
    masked = scores.masked_fill(~eligible, float("-inf"))
    kth = masked.topk(top, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)  # the k-th largest candidate
    above = masked > kth
    ties = (masked == kth) & eligible
    room = k - above.sum(dim=-1, keepdim=True)
    if (ties.sum(dim=-1, keepdim=True) > room).any():  # more ties than room: the earliest tokens win
        ties &= ties.cumsum(dim=-1, dtype=torch.int32) <= room
    mask[..., :S] |= above | ties
    return mask


def _chunk_elements(device: torch.device) -> int:
    """Entries evaluated at once by default: half the free memory of a CUDA device, a fixed amount on the CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return max(free // 2 // BYTES_PER_CHUNK_ELEMENT, 1)
    return CPU_CHUNK_ELEMENTS


class _Head:
    """One (layer, KV head) on the device: the dequantized copies of each store, the keys, values, exact logits,
    dense output and the oracle's top-k; on the host, each store's σ² at the contexts of ``blocks [P]`` sealed
    blocks (every method on the store plans with the same)."""

    def __init__(self, capture: Capture, layer: int, head: int, calibration: Calibration | None, rotated: bool,
                 sel: Selection, keep: torch.Tensor, candidate: torch.Tensor, causal: torch.Tensor, blocks: np.ndarray,
                 device: torch.device, levels: bool = False):
        keys = capture.keys[layer, head]
        n, d = keys.shape
        self.n_sealed = n // BLOCK * BLOCK
        q = capture.queries[layer, head]  # [P, G, d]
        self.stats = unit_stats(d, ("raw", "rotated")) if calibration is None else \
            {b: calibration.head_stats(layer, head, b, levels) for b in ("raw", "rotated")}
        store_keys, self.q_store = {"raw": keys}, {"raw": q}
        if rotated:  # the reference's own float32 products (PlaneStore, method_scores): bit-identical codes
            basis = calibration.basis[layer, head].astype(np.float32)
            store_keys["rotated"], self.q_store["rotated"] = keys @ basis, q @ basis
        self.copies, self.sigma2_store = {}, {}
        for b, k in store_keys.items():
            khat, scales = dequantized_copies(torch.from_numpy(np.ascontiguousarray(k)).to(device),
                                              self.stats[b].levels)
            self.copies[b] = khat.permute(1, 2, 0).reshape(self.n_sealed, d * MAX_DEPTH)  # [n, (channel, depth)]
            self.sigma2_store[b] = running_scale_variance(scales.cpu().numpy(), blocks)
        self.device, self.blocks, self._moments = device, blocks, {}
        self.keys = torch.from_numpy(keys).to(device)
        self.q = torch.from_numpy(q).to(device)
        self.q_rotated = torch.from_numpy(self.q_store["rotated"]).to(device) if rotated else None
        self.landmarks = torch.from_numpy(landmarks(keys[:self.n_sealed]).astype(np.float32)).to(device)
        self.values = torch.from_numpy(capture.values[layer, head]).to(device, torch.float64)
        self.logits = (self.q.double() @ self.keys.double().T) * capture.scale  # [P, G, n]
        self.dense = self.attend(causal[:, None, :])
        self.exact = self.q @ self.keys[:self.n_sealed].T  # the oracle's scores
        self.keep, self.candidate = keep, candidate
        self.oracle_take = select_many(self.exact, keep, candidate, sel.k) & candidate[:, None, :]

    def store_stats(self, basis: str) -> HeadStats:
        """The head's stats on ``basis`` with the store's σ² at each context."""
        return replace(self.stats[basis], sigma2_store=self.sigma2_store[basis])

    def attend(self, mask: torch.Tensor) -> torch.Tensor:
        """Exact attention of every head over its selected set ``mask bool [..., P, G, n]`` -> float64."""
        return torch.softmax(self.logits.masked_fill(~mask, float("-inf")), dim=-1) @ self.values

    def store_moments(self, basis: str) -> StoreMoments:
        """Twin of :meth:`fathom.decode.HeadIndex.store_moments` at this head's contexts: the ``basis`` store's key
        covariance and read noise, summed on the device in float64 as :func:`fathom.prediction.store_moments` sums
        them (running sums over the blocks up to each context: one pass over the keys)."""
        if basis not in self._moments:
            n, d = self.n_sealed, self.copies[basis].shape[1] // MAX_DEPTH
            khat = self.copies[basis].reshape(n, d, MAX_DEPTH).double()
            counts, which = np.unique(self.blocks, return_inverse=True)
            zeros = lambda *shape: torch.zeros(shape, dtype=torch.float64, device=self.device)  # noqa: E731
            total, outer, gap, gap2 = zeros(d), zeros(d, d), zeros(d, MAX_DEPTH), zeros(d, MAX_DEPTH)
            cov, noise = zeros(len(counts), d, d), zeros(len(counts), d, MAX_DEPTH)
            start = 0
            for u, count in enumerate(counts.tolist()):
                stop = count * BLOCK
                rows = khat[start:stop]  # [m, d, depth]
                full = rows[:, :, -1]
                diff = full[:, :, None] - rows  # k̂_4 − k̂_t
                total += full.sum(dim=0)
                outer += full.T @ full
                gap += diff.sum(dim=0)
                gap2 += (diff * diff).sum(dim=0)
                if stop:  # no block sealed yet: zero moments, as the reference's
                    mean = total / stop
                    cov[u] = outer / stop - torch.outer(mean, mean)
                    noise[u] = gap2 / stop - (gap / stop) ** 2
                start = stop
            self._moments[basis] = StoreMoments(cov.cpu().numpy(), noise.transpose(1, 2).cpu().numpy(),
                                                which.astype(np.int64))
        return self._moments[basis]

    def plane_queries(self, method: Method, depths: np.ndarray) -> torch.Tensor:
        """The queries ``[P, G, d]`` a plane method scores its store with: the query in the store's basis, or its
        prediction (:func:`fathom.prediction.predicted_queries`) for a method that predicts."""
        if method.predicts:
            x = predicted_queries(self.q_store[method.basis], depths, self.store_moments(method.basis))
            return torch.from_numpy(x).to(self.device)
        return self.q if method.basis == "raw" else self.q_rotated

    def plane_scores(self, basis: str, depths: np.ndarray, queries: torch.Tensor) -> torch.Tensor:
        """Scores of methods reading ``depths int [m, P, d]`` of the ``basis`` store with ``queries [m, P, G, d]``
        (:meth:`plane_queries`) -> ``[m, P, G, n_sealed]``."""
        depths = torch.from_numpy(depths).to(self.device)
        at = (depths[..., None] == torch.arange(1, MAX_DEPTH + 1, device=self.device)).float()  # [m, P, d, 4]
        folded = queries[..., None] * at[:, :, None]  # [m, P, G, d, 4]
        return (folded.reshape(-1, folded.shape[-2] * MAX_DEPTH) @ self.copies[basis].T).reshape(
            folded.shape[:3] + (self.n_sealed,))

    def landmark_scores(self) -> torch.Tensor:
        return (self.q @ self.landmarks.T).repeat_interleave(LANDMARK_TOKENS, dim=-1)


def evaluate(capture: Capture, calibration: Calibration | None, methods: list[Method], sel: Selection,
             on_head: Callable[[], None] | None = None, levels: bool = False, device: str | torch.device = "cpu",
             chunk_elements: int | None = None) -> list[MethodResult]:
    """:func:`fathom.fidelity.evaluate` in torch on ``device`` (same arguments and results).

    ``chunk_elements`` bounds the methods × positions × query heads × tokens evaluated at once (default: half
    the free memory of a CUDA device at ~48 bytes an entry; 32 M entries on the CPU).
    """
    check_levels_source(calibration, levels)
    device = torch.device(device)
    L, H, n, d = capture.keys.shape
    P, G = capture.queries.shape[2:4]
    blocks = (capture.positions + 1) // BLOCK
    context = capture.positions + 1
    rotated = needs_rotated(methods, calibration)
    keep, candidate = (torch.from_numpy(m).to(device) for m in protocol_masks(context, blocks * BLOCK, sel, n))
    causal = torch.arange(n, device=device)[None, :] < torch.from_numpy(context).to(device)[:, None]
    per_method = max(P * G * n, 1)
    chunk = max(1, (chunk_elements or _chunk_elements(device)) // per_method)
    tally = Tally(methods, L, H, d)
    with torch.no_grad():
        for layer in range(L):
            on_heads = [head_methods(methods, calibration, layer, head) for head in range(H)]
            heads = [_Head(capture, layer, head, calibration, rotated, sel, keep, candidate, causal, blocks, device,
                           levels) for head in range(H)]
            depths = [{} for _ in range(H)]  # per head: method index -> depths [P, d]
            for i, m in enumerate(methods):
                resolved = [on_heads[head][i] for head in range(H)]  # what each head runs (its basis)
                if m.pooled:  # every head of the layer on one water line, as fathom.fidelity plans it
                    per_head = pooled_depths([r.policy for r in resolved],
                                             [h.q_store[r.basis] for h, r in zip(heads, resolved)],
                                             [h.store_stats(r.basis) for h, r in zip(heads, resolved)])
                    for head in range(H):
                        depths[head][i] = per_head[head]
                elif m.scans_planes:
                    for head, (h, r) in enumerate(zip(heads, resolved)):
                        depths[head][i] = plane_depths(r, h.q_store[r.basis], h.stats[r.basis],
                                                       h.sigma2_store[r.basis], layer)
            for head, h in enumerate(heads):
                for i in range(len(methods)):
                    tally.add_scan(i, layer, head, depths[head].get(i), blocks)
                for start in range(0, len(methods), chunk):
                    _measure(h, on_heads[head], range(start, min(start + chunk, len(methods))), depths[head], sel,
                             causal, tally, layer, head)
                if on_head is not None:
                    on_head()
            del heads, h  # the next layer's are made while these would still be held
    return tally.results()


def _measure(h: _Head, methods: list[Method], chunk: range, depths: dict[int, np.ndarray], sel: Selection,
             causal: torch.Tensor, tally: Tally, layer: int, head: int) -> None:
    """Select, attend and measure a chunk of methods at every position of one head."""
    P, G, _ = h.q.shape
    scores = torch.zeros((len(chunk), P, G, h.n_sealed), device=h.device)
    for basis in ("raw", "rotated"):
        at = [j for j, i in enumerate(chunk) if methods[i].scans_planes and methods[i].basis == basis]
        if at:
            read = [depths[chunk[j]] for j in at]
            queries = torch.stack([h.plane_queries(methods[chunk[j]], r) for j, r in zip(at, read)])
            scores[at] = h.plane_scores(basis, np.stack(read), queries)
    for j, i in enumerate(chunk):
        if methods[i].scorer == "exact":
            scores[j] = h.exact
        elif methods[i].scorer == "landmark":
            scores[j] = h.landmark_scores()
    mask = select_many(scores, h.keep, h.candidate, sel.k)
    del scores
    for j, i in enumerate(chunk):
        if methods[i].scorer == "dense":
            mask[j] = causal[:, None, :]
    out = h.attend(mask)  # [m, P, G, dv]
    error = (torch.linalg.vector_norm(out - h.dense, dim=-1) / torch.linalg.vector_norm(h.dense, dim=-1))
    rows = mask.any(dim=2).sum(dim=-1).double()  # [m, P]
    chosen = h.oracle_take.sum(dim=-1)  # [P, G]
    hit = (mask & h.oracle_take).sum(dim=-1)  # the oracle's top-k is all candidates: no sink / local / tail
    overlap = torch.where(chosen > 0, hit.double() / chosen.clamp(min=1), 1.0)
    measured = torch.stack([error.mean(dim=(1, 2)), rows.mean(dim=1), overlap.mean(dim=(1, 2))], dim=1)
    for i, (err, row, hit_rate) in zip(chunk, measured.tolist()):
        tally.add_selection(i, layer, head, err, row, hit_rate)
