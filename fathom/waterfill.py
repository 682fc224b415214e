"""Per-query read depth by reverse water-filling (design §5).

The ``t``-th plane of channel ``c`` removes ``g_{c,t} = w_c · γ_{c,t}`` of
expected squared score error (importance ``w_c = σ_c² · Σ_h q[h, c]²``), so for
a water line θ the depth is ``b_c(θ) = #{t : g_{c,t} > θ}`` and the cost
``Σ b_c + 0.25 · #{b_c > 0}`` is non-increasing in θ. θ* is the smallest θ whose
cost fits the budget, found by 30 bisection steps in log θ (what the GPU
planner does too, with no host round trip).

The relative gains ``γ`` are design §5's model, ``(3/4) · 4^{-(t-1)}``
(:data:`DESIGN_GAINS`), unless a calibrated table ``γ [..., d, 4]`` is given
(:func:`calibrated_gains`: each plane's measured drop of the channel's error
variance on calibration keys, made non-increasing in t so that a depth is
always a prefix of planes).

Example::

    >>> import numpy as np
    >>> from fathom import reference as ref
    >>> w = np.array([16.0, 4.0, 1.0, 0.0])
    >>> depths = ref.waterfill(w, 8.0)  # the 4th plane of channel 0 ties the 2nd of channel 1: both or neither
    >>> depths.tolist(), ref.scan_bits(depths)
    ([3, 2, 1, 0], 6.75)
"""

from __future__ import annotations

import numpy as np

from fathom import _checks
from fathom.bits import SCALE_BITS
from fathom.quantize import MAX_DEPTH

BISECTION_STEPS = 30
DESIGN_GAINS = 0.75 * 4.0 ** -np.arange(MAX_DEPTH)  # design §5: γ_t = (3/4) 4^-(t-1) for t = 1..4


def importance(q: np.ndarray, sigma2: np.ndarray) -> np.ndarray:
    """``w_c = σ_c² · Σ_h q[h, c]²`` for query groups ``q [..., G, d]`` and ``sigma2 [..., d]``."""
    return sigma2 * np.square(q).sum(axis=-2)


def plane_gains(w: np.ndarray, gains: np.ndarray | None = None) -> np.ndarray:
    """``g_{c,t} = w_c · γ_{c,t}`` float64 ``[..., d, 4]``; ``gains``: γ broadcast to ``[..., d, 4]`` (None: the
    design's :data:`DESIGN_GAINS`)."""
    gamma = DESIGN_GAINS if gains is None else np.asarray(gains, np.float64)
    return np.asarray(w, np.float64)[..., None] * gamma


def depths_at(w: np.ndarray, theta: np.ndarray | float, gains: np.ndarray | None = None) -> np.ndarray:
    """``b_c(θ) = #{t ∈ 1..4 : g_{c,t} > θ}``, exactly; ``w [..., d]``, θ broadcast over ``[...]``, ``gains``
    as in :func:`plane_gains` (non-increasing in t)."""
    theta = np.asarray(theta, np.float64)[..., None, None]
    return (plane_gains(w, gains) > theta).sum(axis=-1).astype(np.int8)


def depths_closed_form(w: np.ndarray, theta: float) -> np.ndarray:
    """``clip(floor(log4(3 w / (4 θ))) + 1, 0, 4)``: equals :func:`depths_at` away from ``g_{c,t} == θ``."""
    with np.errstate(divide="ignore"):
        x = np.floor(np.log(3 * np.asarray(w, np.float64) / (4 * theta)) / np.log(4)) + 1
    return np.clip(x, 0, MAX_DEPTH).astype(np.int8)


def _cost(depths: np.ndarray) -> np.ndarray:
    return depths.sum(axis=-1) + SCALE_BITS * (depths > 0).sum(axis=-1)


def _check_gains(gains: np.ndarray | None, w: np.ndarray) -> np.ndarray | None:
    if gains is None:
        return None
    gains = np.asarray(gains, np.float64)
    if gains.shape[-1:] != (MAX_DEPTH,) or gains.ndim < 2 or gains.shape[-2] != w.shape[-1]:
        raise ValueError(f"gains must be [..., d = {w.shape[-1]}, {MAX_DEPTH}], got shape {gains.shape}")
    check_gain_values(gains)
    return gains


def check_gain_values(gains: np.ndarray) -> None:
    """Refuse relative plane gains ``[..., 4]`` that are not finite, >= 0 and non-increasing in the plane (what
    every planner, the reference's and the GPU's, takes)."""
    _checks.nonnegative("gains", gains)
    if np.any(np.diff(gains, axis=-1) > 0):
        raise ValueError("gains must be non-increasing in the plane (a depth reads a prefix of planes)")


def waterfill_batched(w: np.ndarray, budget: float, gains: np.ndarray | None = None) -> np.ndarray:
    """Water-fill many query groups at once: ``w float [..., d] >= 0`` -> depths ``int8 [..., d]``.

    Each group gets the depths at the smallest θ (to 30 bisection steps in
    log θ) whose cost fits ``budget`` bits per token; groups whose every
    plane of positive gain fits get exactly that. ``gains``: the relative
    per-plane gains γ ``[..., d, 4]`` (non-negative, non-increasing in t;
    None: design §5's model).
    """
    w = np.asarray(w, np.float64)
    if w.ndim < 1:
        raise ValueError(f"w must have rank >= 1 (channels last), got shape {w.shape}")
    _checks.nonnegative("w", w)
    if _checks.real("budget (bits per token)", budget) < 0:
        raise ValueError(f"budget must be >= 0 bits per token, got {budget}")
    gains = _check_gains(gains, w)
    g = plane_gains(w, gains)  # [..., d, 4]
    g_max = g.max(axis=(-2, -1), initial=0.0)
    g_min = np.where(g > 0, g, np.inf).min(axis=(-2, -1), initial=np.inf)
    any_positive = g_max > 0
    g_max, g_min = np.where(any_positive, g_max, 1.0), np.where(any_positive, g_min, 1.0)
    # hi: twice the largest gain, cost 0. lo: half the smallest positive gain, every plane of positive gain read.
    # With the design's gains these are twice 0.75 w_max and half 0.75 w_min / 64, each a sum of logs (no
    # rounding of a product can land on a gain, and no underflow for tiny w).
    if gains is None:
        w_max = np.where(any_positive, w.max(axis=-1, initial=0.0), 1.0)
        w_min = np.where(any_positive, np.where(w > 0, w, np.inf).min(axis=-1, initial=np.inf), 1.0)
        log_hi = np.log(2 * DESIGN_GAINS[0]) + np.log(w_max)
        log_lo = np.log(0.5 * DESIGN_GAINS[-1]) + np.log(w_min)
    else:
        log_hi, log_lo = np.log(2.0) + np.log(g_max), np.log(0.5) + np.log(g_min)
    for _ in range(BISECTION_STEPS):
        mid = 0.5 * (log_lo + log_hi)
        fits = _cost(depths_at(w, np.exp(mid), gains)) <= budget
        log_hi = np.where(fits, mid, log_hi)
        log_lo = np.where(fits, log_lo, mid)
    at_hi = depths_at(w, np.exp(log_hi), gains)
    everything = (g > 0).sum(axis=-1).astype(np.int8)
    all_fit = (_cost(everything) <= budget)[..., None]
    return np.where(all_fit, everything, at_hi).astype(np.int8)


def waterfill(w: np.ndarray, budget: float, gains: np.ndarray | None = None) -> np.ndarray:
    """Depths ``int8 [d]`` for one query group's importances ``w [d] >= 0`` under ``budget`` bits/token
    (``gains``: γ ``[d, 4]``, see :func:`waterfill_batched`).

    ``cost(depths) <= budget`` always; all-zero ``w`` gives all-zero depths.
    """
    w = _checks.array("w", w, ndim=1, kind="fiu")
    return waterfill_batched(w, budget, gains)


def calibrated_gains(drops: np.ndarray) -> np.ndarray:
    """A gain table from measured per-plane error drops ``[..., 4]`` (plane t's drop of a channel's error
    variance): the slopes of the least concave majorant of the cumulative drops ``(t, Σ_{s<=t} drop_s)``,
    clipped at 0. Non-negative and non-increasing in t, so water-filling reads a prefix of planes; a plane
    that removes less than a deeper one is credited with their mean (both or neither), one that adds error
    with nothing.
    """
    drops = np.asarray(drops, np.float64)
    if drops.shape[-1:] != (MAX_DEPTH,):
        raise ValueError(f"drops must be [..., {MAX_DEPTH}], got shape {drops.shape}")
    _checks.finite("drops", drops)
    cum = np.concatenate([np.zeros(drops.shape[:-1] + (1,)), np.cumsum(drops, axis=-1)], axis=-1)  # [..., 5]
    hull = cum.copy()
    for i in range(MAX_DEPTH + 1):  # the majorant at t: the highest chord (i, j) over it, with i <= t <= j
        for j in range(i + 1, MAX_DEPTH + 1):
            slope = (cum[..., j] - cum[..., i]) / (j - i)
            for t in range(i, j + 1):
                hull[..., t] = np.maximum(hull[..., t], cum[..., i] + slope * (t - i))
    # the hull's slopes fall in exact arithmetic; the running minimum removes rounding's last-ulp rises
    return np.minimum.accumulate(np.clip(np.diff(hull, axis=-1), 0.0, None), axis=-1)


def per_layer_plan(errors: np.ndarray, budgets: np.ndarray, mean_budget: float) -> np.ndarray:
    """Greedy per-layer budgets at a fixed mean (design §5, optional tuning step).

    Args:
        errors: ``[L, nB]`` calibration error of each layer at each candidate budget.
        budgets: ``[nB]`` increasing candidate budgets (bits per token).
        mean_budget: the mean budget over layers to spend, ``budgets[0] <= mean_budget <= budgets[-1]``.
    Returns:
        float ``[L]``: each layer's budget, one of ``budgets``, with mean <= ``mean_budget``.

    Every layer starts at ``budgets[0]``; the step with the largest error drop
    per bit (over the next candidates of each layer) is taken first until the
    next one would exceed the mean budget.
    """
    errors = _checks.array("errors", errors, ndim=2, kind="f")
    _checks.finite("errors", errors)  # a NaN compares false everywhere: its layer would silently stay lowest
    budgets = np.asarray(budgets, np.float64)
    if budgets.ndim != 1 or budgets.size != errors.shape[1] or np.any(np.diff(budgets) <= 0):
        raise ValueError(f"budgets must be increasing with {errors.shape[1]} entries, got {budgets}")
    if not budgets[0] <= mean_budget <= budgets[-1]:
        raise ValueError(f"mean_budget must lie in [{budgets[0]}, {budgets[-1]}], got {mean_budget}")
    n_layers = errors.shape[0]
    level = np.zeros(n_layers, np.int64)
    spare = (mean_budget - budgets[0]) * n_layers
    while True:
        best, best_rate = None, -np.inf
        for layer in range(n_layers):
            i = level[layer]
            for j in range(i + 1, budgets.size):  # allow jumps past a flat stretch of the error curve
                extra = budgets[j] - budgets[i]
                if extra > spare:
                    break
                rate = (errors[layer, i] - errors[layer, j]) / extra
                if rate > best_rate:
                    best, best_rate = (layer, j), rate
        if best is None or best_rate <= 0:
            break
        layer, j = best
        spare -= budgets[j] - budgets[level[layer]]
        level[layer] = j
    return budgets[level]
