"""Attention fidelity of every method on a capture (SPEC §6): error against dense, bits and bytes.

For each (layer, KV head) one :class:`~fathom.decode.HeadIndex` is built over
the window, and every decode position ``p`` is scored at its own context
``positions[p] + 1`` (sealed blocks scanned, the tail always selected), so the
numbers equal :func:`~fathom.decode.decode_step` position by position (tested).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np

from fathom.attention import attend, logits, relative_error
from fathom.bits import row_bytes
from fathom.calibration import Calibration
from fathom.capture import Capture
from fathom.decode import HeadIndex, method_scores, step_bits
from fathom import methods as M
from fathom.methods import Method
from fathom.quantize import BLOCK
from fathom.selection import Selection, select_many
from fathom.waterfill import per_layer_plan

PLAN_BUDGETS = (16, 24, 32, 48, 64, 92, 136)  # candidate per-layer budgets of the plan


@dataclass(frozen=True)
class MethodResult:
    """One method on one capture. Bytes are per decode step of one sequence, summed over layers and KV heads."""

    label: str
    method: str
    bits: float  # nominal scan bits per token (SPEC §4; the budget for fathom)
    bits_read: float  # mean scan bits per token actually read
    scan_bytes: float
    row_bytes: float
    rows_per_head: float  # mean |union of the G heads' selections| per KV head
    rel_error: float  # mean over positions, layers and query heads
    rel_error_per_layer: list[float]
    channels_touched: float | None  # plane methods: mean #{c : b_c > 0}
    mean_depth: float | None  # plane methods: mean b_c over touched channels

    def record(self, **extra) -> dict:
        return {**extra, **asdict(self)}


def evaluate(capture: Capture, calibration: Calibration | None, methods: list[Method], sel: Selection,
             on_head: Callable[[], None] | None = None) -> list[MethodResult]:
    """Evaluate ``methods`` on every layer, KV head and decode position of ``capture``."""
    L, H, n, d = capture.keys.shape
    blocks = (capture.positions + 1) // BLOCK  # sealed blocks at each position's context
    context = capture.positions + 1
    causal = np.arange(n)[None, :] < context[:, None]  # [P, n]
    needs_rotated = any(m.basis == "rotated" and m.scorer == "planes" for m in methods)
    if needs_rotated and calibration is None:
        raise ValueError("calibration is needed for rotated-basis methods (fathom-rotated, loki)")
    err = np.zeros((len(methods), L))
    bits = np.zeros((len(methods), L, H))
    scan = np.zeros((len(methods), L, H))
    rows = np.zeros((len(methods), L, H))
    touched = np.zeros((len(methods), L, H))
    depth = np.zeros((len(methods), L, H))
    for layer in range(L):
        for head in range(H):
            keys, values = capture.keys[layer, head], capture.values[layer, head]
            q = capture.queries[layer, head]  # [P, G, d]
            stats = None if calibration is None else \
                {b: calibration.head_stats(layer, head, b) for b in ("raw", "rotated")}
            basis = calibration.basis[layer, head] if needs_rotated else None
            index = HeadIndex.build(keys, stats, basis)
            exact = logits(q, keys, capture.scale)  # [P, G, n], shared by every method's softmax
            dense = attend(exact, values, np.broadcast_to(causal[:, None], q.shape[:2] + (n,)))
            for i, method in enumerate(methods):
                scores, depths = method_scores(method, q, index, blocks)
                if scores is None:
                    mask = np.broadcast_to(causal[:, None], q.shape[:2] + (n,))
                else:
                    mask = select_many(scores, context, blocks * BLOCK, sel, n)
                out = attend(exact, values, mask)
                err[i, layer] += relative_error(out, dense).mean() / H
                step = np.broadcast_to(step_bits(method, depths, d), context.shape)
                bits[i, layer, head] = step.mean()
                scan[i, layer, head] = (step * blocks * BLOCK / 8).mean()
                rows[i, layer, head] = mask.any(axis=1).sum(axis=-1).mean()
                if depths is not None:
                    active = depths > 0
                    touched[i, layer, head] = active.sum(axis=-1).mean()
                    depth[i, layer, head] = depths.sum() / max(active.sum(), 1)
            if on_head is not None:
                on_head()
    return [MethodResult(
        label=m.label(d), method=m.name, bits=m.nominal_bits(d), bits_read=float(bits[i].mean()),
        scan_bytes=float(scan[i].sum()), row_bytes=float(rows[i].sum() * row_bytes(d)),
        rows_per_head=float(rows[i].mean()), rel_error=float(err[i].mean()),
        rel_error_per_layer=[float(e) for e in err[i]],
        channels_touched=float(touched[i].mean()) if m.scorer == "planes" else None,
        mean_depth=float(depth[i].mean()) if m.scorer == "planes" else None,
    ) for i, m in enumerate(methods)]


def plan_layers(calibration_capture: Capture, calibration: Calibration, mean_budgets: list[float], sel: Selection,
                basis: str = "raw", candidates: tuple[float, ...] = PLAN_BUDGETS,
                on_head: Callable[[], None] | None = None) -> list[Method]:
    """Per-layer plans at each mean budget, calibrated on ``calibration_capture`` (never the evaluation text).

    Per-layer error curves come from fathom at every candidate flat budget; the
    greedy of :func:`~fathom.waterfill.per_layer_plan` then spends each mean budget.
    """
    flat = [M.fathom(b) if basis == "raw" else M.fathom_rotated(b) for b in candidates]
    curves = np.array([r.rel_error_per_layer for r in evaluate(calibration_capture, calibration, flat, sel, on_head)]).T
    return [M.fathom_plan(tuple(per_layer_plan(curves, np.array(candidates, float), b)), b, basis)
            for b in mean_budgets]
