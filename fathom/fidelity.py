"""Attention fidelity of every method on a capture (design §6): error against dense, bits and bytes.

For each (layer, KV head) one :class:`~fathom.decode.HeadIndex` is built over
the window, and every decode position ``p`` is scored at its own context
``positions[p] + 1`` (sealed blocks scanned, the tail always selected), so the
numbers equal :func:`~fathom.decode.decode_step` position by position (tested).
Besides error, bits and bytes, each method's error per (layer, KV head) and the
overlap of its top-k with the oracle's (exact scores) say where it loses. A
layer's KV heads are indexed before any is evaluated: a pooled method plans
them together.
:mod:`fathom.cuda.fidelity` is the torch twin (any torch device).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Callable

import numpy as np

from fathom.attention import attend, logits, relative_error
from fathom.bits import row_bytes
from fathom.calibration import Calibration
from fathom.capture import Capture
from fathom.decode import HeadIndex, method_scores, pooled_layer_depths, step_bits
from fathom import methods as M
from fathom.methods import PLAN_BUDGETS, Method
from fathom.quantize import BLOCK
from fathom.selection import Selection, protocol_masks, select_many
from fathom.waterfill import per_layer_plan


@dataclass(frozen=True)
class MethodResult:
    """One method on one capture. Bytes are per decode step of one sequence, summed over layers and KV heads."""

    label: str
    method: str
    bits: float  # nominal scan bits per token (design §4; the budget for fathom)
    bits_read: float  # mean scan bits per token actually read
    scan_bytes: float
    row_bytes: float
    rows_per_head: float  # mean |union of the G heads' selections| per KV head
    rel_error: float  # mean over positions, layers and query heads
    rel_error_per_layer: list[float]
    channels_touched: float | None  # plane methods: mean #{c : b_c > 0}
    mean_depth: float | None  # plane methods: mean b_c over touched channels
    rel_error_per_head: list[list[float]] = field(default_factory=list)  # [L][H]: mean over positions, G heads
    oracle_overlap: float | None = None  # mean fraction of the oracle's top-k (exact scores) this method selects
    oracle_overlap_per_head: list[list[float]] = field(default_factory=list)  # [L][H]

    def record(self, **extra) -> dict:
        return {**extra, **asdict(self)}


class Tally:
    """Per (method, layer, KV head) measurements, and the :class:`MethodResult` they add up to; shared by the
    NumPy evaluation and its torch twin (:mod:`fathom.cuda.fidelity`), so both account bits and bytes alike."""

    def __init__(self, methods: list[Method], layers: int, kv_heads: int, d: int):
        self.methods, self.d = methods, d
        shape = (len(methods), layers, kv_heads)
        self.error, self.rows, self.overlap = np.zeros(shape), np.zeros(shape), np.zeros(shape)
        self.bits, self.scan, self.touched, self.depth = np.zeros(shape), np.zeros(shape), np.zeros(shape), \
            np.zeros(shape)

    def add_scan(self, i: int, layer: int, head: int, depths: np.ndarray | None, blocks: np.ndarray) -> None:
        """What method ``i`` read at each position: its depths ``[P, d]`` (None: no planes) over ``blocks [P]``."""
        step = np.broadcast_to(step_bits(self.methods[i], depths, self.d), blocks.shape)
        self.bits[i, layer, head] = step.mean()
        self.scan[i, layer, head] = (step * blocks * BLOCK / 8).mean()
        if depths is not None:
            active = depths > 0
            self.touched[i, layer, head] = active.sum(axis=-1).mean()
            self.depth[i, layer, head] = depths.sum() / max(active.sum(), 1)

    def add_selection(self, i: int, layer: int, head: int, error: float, rows: float, overlap: float) -> None:
        """Method ``i``'s mean relative error, union rows and oracle overlap over the positions of one head."""
        self.error[i, layer, head], self.rows[i, layer, head], self.overlap[i, layer, head] = error, rows, overlap

    def results(self) -> list[MethodResult]:
        d = self.d
        return [MethodResult(
            label=m.label(d), method=m.name, bits=m.nominal_bits(d), bits_read=float(self.bits[i].mean()),
            scan_bytes=float(self.scan[i].sum()), row_bytes=float(self.rows[i].sum() * row_bytes(d)),
            rows_per_head=float(self.rows[i].mean()), rel_error=float(self.error[i].mean()),
            rel_error_per_layer=[float(e) for e in self.error[i].mean(axis=1)],
            channels_touched=float(self.touched[i].mean()) if m.scans_planes else None,
            mean_depth=float(self.depth[i].mean()) if m.scans_planes else None,
            rel_error_per_head=self.error[i].tolist(), oracle_overlap=float(self.overlap[i].mean()),
            oracle_overlap_per_head=self.overlap[i].tolist(),
        ) for i, m in enumerate(self.methods)]


def needs_rotated(methods: list[Method], calibration: Calibration | None) -> bool:
    """Whether any method scans the rotated store (refused without a calibration: it holds the basis, and for a
    per-head method each head's choice)."""
    rotated = any(m.scans_rotated for m in methods)
    if rotated and calibration is None:
        raise ValueError("calibration is needed for rotated-basis methods (fathom-rotated, fathom-mixed, loki)")
    if any(m.basis == M.PER_HEAD for m in methods) and calibration.head_basis is None:
        raise ValueError("a per-head method (fathom-mixed) needs the calibration's head_basis "
                         "(Calibration.with_head_basis)")
    return rotated


def head_methods(methods: list[Method], calibration: Calibration | None, layer: int, head: int) -> list[Method]:
    """What each method runs on one (layer, KV head): a per-head method on the basis that head chose."""
    if calibration is None or calibration.head_basis is None:
        return methods
    return [m.on_basis(str(calibration.head_basis[layer, head])) for m in methods]


def oracle_overlap(take: np.ndarray, oracle_take: np.ndarray) -> np.ndarray:
    """Fraction of the oracle's top-k each head selects: ``take``, ``oracle_take`` bool ``[..., n]`` (top-k
    parts only, no sink / local / tail) -> ``[...]`` (1 where the oracle chose nothing)."""
    chosen = oracle_take.sum(axis=-1)
    return np.where(chosen > 0, (take & oracle_take).sum(axis=-1) / np.maximum(chosen, 1), 1.0)


def check_levels_source(calibration: Calibration | None, levels: bool) -> None:
    """Refuse ``levels=True`` without a calibration that holds the reconstruction tables."""
    if levels and (calibration is None or calibration.levels_raw is None):
        raise ValueError("levels=True reads the planes through calibrated reconstruction tables: pass a calibration "
                         "made by fathom.calibration.calibrate (which computes them)")


def evaluate(capture: Capture, calibration: Calibration | None, methods: list[Method], sel: Selection,
             on_head: Callable[[], None] | None = None, levels: bool = False) -> list[MethodResult]:
    """Evaluate ``methods`` on every layer, KV head and decode position of ``capture``; ``levels``: every plane
    method's planes read through the calibration's reconstruction tables (:func:`fathom.calibration.cell_means`)
    instead of the cells' midpoints, and water-filled with the plane table measured through them."""
    check_levels_source(calibration, levels)
    L, H, n, d = capture.keys.shape
    blocks = (capture.positions + 1) // BLOCK  # sealed blocks at each position's context
    context = capture.positions + 1
    causal = np.arange(n)[None, :] < context[:, None]  # [P, n]
    _, candidate = protocol_masks(context, blocks * BLOCK, sel, n)  # [P, n]
    rotated = needs_rotated(methods, calibration)
    tally = Tally(methods, L, H, d)
    for layer in range(L):
        on_heads = [head_methods(methods, calibration, layer, head) for head in range(H)]
        indexes = [HeadIndex.build(capture.keys[layer, head],
                                   None if calibration is None else
                                   {b: calibration.head_stats(layer, head, b, levels) for b in ("raw", "rotated")},
                                   calibration.basis[layer, head] if rotated else None) for head in range(H)]
        pooled = {i: pooled_layer_depths([on_head[i] for on_head in on_heads], capture.queries[layer], indexes,
                                         blocks) for i, m in enumerate(methods) if m.pooled}
        for head in range(H):
            keys, values = capture.keys[layer, head], capture.values[layer, head]
            q = capture.queries[layer, head]  # [P, G, d]
            index = indexes[head]
            exact = logits(q, keys, capture.scale)  # [P, G, n], shared by every method's softmax
            dense = attend(exact, values, np.broadcast_to(causal[:, None], q.shape[:2] + (n,)))
            oracle_scores, _ = method_scores(M.oracle(), q, index, blocks)
            oracle_take = select_many(oracle_scores, context, blocks * BLOCK, sel, n) & candidate[:, None]
            for i, method in enumerate(on_heads[head]):
                scores, depths = method_scores(method, q, index, blocks, layer,
                                               pooled[i][head] if i in pooled else None)
                if scores is None:
                    mask = np.broadcast_to(causal[:, None], q.shape[:2] + (n,))
                else:
                    mask = select_many(scores, context, blocks * BLOCK, sel, n)
                out = attend(exact, values, mask)
                tally.add_scan(i, layer, head, depths, blocks)
                tally.add_selection(i, layer, head, relative_error(out, dense).mean(),
                                    mask.any(axis=1).sum(axis=-1).mean(),
                                    oracle_overlap(mask & candidate[:, None], oracle_take).mean())
            if on_head is not None:
                on_head()
        del indexes, index  # the next layer's are built while these would still be held
    return tally.results()


Evaluator = Callable[..., list[MethodResult]]  # evaluate or its torch twin (same arguments)


def plan_layers(calibration_capture: Capture, calibration: Calibration, mean_budgets: list[float], sel: Selection,
                basis: str = "raw", candidates: tuple[float, ...] = PLAN_BUDGETS,
                on_head: Callable[[], None] | None = None, evaluator: Evaluator = evaluate,
                gains: str = "design") -> list[Method]:
    """Per-layer plans at each mean budget, calibrated on ``calibration_capture`` (never the evaluation text).

    Per-layer error curves come from fathom on ``basis``' store (raw, rotated or ``"per-head"``) with ``gains``
    at every candidate flat budget (by ``evaluator``: this module's :func:`evaluate` or its torch twin); the
    greedy of :func:`~fathom.waterfill.per_layer_plan` then spends each mean budget.
    """
    stores = {"raw": partial(M.fathom, gains=gains), "rotated": partial(M.fathom_rotated, gains=gains),
              M.PER_HEAD: partial(M.fathom_mixed, gains=gains)}
    if basis not in stores:
        raise ValueError(f"basis must be one of {', '.join(stores)}, got {basis!r}")
    flat = [stores[basis](b) for b in candidates]
    curves = np.array([r.rel_error_per_layer for r in evaluator(calibration_capture, calibration, flat, sel,
                                                                on_head)]).T
    return [M.fathom_plan(tuple(per_layer_plan(curves, np.array(candidates, float), b)), b, basis, gains=gains)
            for b in mean_budgets]
