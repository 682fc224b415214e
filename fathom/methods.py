"""Every scan method as a *basis* plus a *depth policy* over one bit-plane store (design §7).

A depth policy maps the query group (in the store's basis) to per-channel
read depths; the one scorer (:mod:`fathom.scoring`) turns depths into scores.

==================  ========  ==========================================================
method              basis     depth policy
==================  ========  ==========================================================
fathom              raw       water-filled depths under a budget (bits / token); σ² from the store
fathom-rotated      rotated   the same on the KLT basis (nothing truncated); σ² from calibration
fathom-plan         either    water-filling with a per-layer budget calibrated offline
fathom-mixed        per head  the same on each (layer, KV head)'s basis, chosen on calibration text
fathom-mixed-plan   per head  the per-head store with fathom-plan's per-layer budgets (``bench fidelity``)
fathom[pooled]      any       one water line for a layer's KV heads (their mean budget)
sparq               raw       depth 4 on the r channels with the largest Σ_h |q[h, c]|
double-sparsity     raw       depth 4 on r channels fixed offline per KV head
loki                rotated   depth 4 on the first r coordinates (score-variance order)
thumbnail-2bit      raw       depth 2 on every channel
landmark            —         fp16 mean key per 8-token block (its own scorer)
oracle              —         exact scores (exact top-k)
dense               —         no selection: the fidelity reference
==================  ========  ==========================================================

The catalog (:data:`CATALOG`) is the one place a method is named: per method its spec name (FathomCache's
``method=``, a bench's ``name@bits``), its budget rule (scan bits, or ``4.25·r`` bits for r channels, or none),
what it reads (the rotated basis, Double Sparsity's ranking, σ²) and its factory; :func:`parse` and
:func:`build` make its :class:`Method` at a head dim::

    >>> from fathom import methods
    >>> methods.parse("sparq@68", 128).policy
    QueryTopChannels(r=16)
    >>> methods.entry("double-sparsity").needs_calibration()
    True

Example (at r = d, SparQ reads everything at 4 bits)::

    >>> import numpy as np
    >>> from fathom import methods
    >>> q = np.random.default_rng(0).standard_normal((4, 8))
    >>> stats = methods.HeadStats(sigma2=np.ones(8), ds_rank=np.arange(8))
    >>> methods.sparq(8).policy.depths(q, stats).tolist()
    [4, 4, 4, 4, 4, 4, 4, 4]
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Callable, NamedTuple

import numpy as np

from fathom import _checks
from fathom.bits import fixed_channel_bits, full_key_bits, landmark_bits, scan_bits
from fathom.quantize import MAX_DEPTH
from fathom.waterfill import importance, waterfill_batched

VARIANCE_SOURCES = ("store", "calibration")
PER_BASIS = "per-basis"  # σ² by the basis' default: the per-head store's water-filling, on each head's basis
GAIN_SOURCES = ("design", "calibrated")  # the plane gains: design §5's model, or calibration's measured table
# Where σ² comes from, per basis (measured: docs/decisions.md "Where σ² comes from"). On the rotated store the
# calibration variance is the KLT eigenvalue of the coordinate; on raw channels the store's own mean squared block
# scale.
DEFAULT_VARIANCE = {"raw": "store", "rotated": "calibration"}
PLAN_BUDGETS = (16, 24, 32, 48, 64, 92, 136)  # candidate per-layer budgets of the plan (fathom-plan)


@dataclass(frozen=True)
class HeadStats:
    """What policies may know about one (layer, KV head), in the store's basis.

    ``sigma2``: calibration variance ``[d]``; ``sigma2_store``: the store's own
    mean squared block scale ``[..., d]`` (None if not kept); ``ds_rank``:
    channels ordered by Double Sparsity's offline statistic ``[d]``; ``layer``:
    the layer index (per-layer budgets need it; None: not known);
    ``plane_drops``: each plane's measured drop of each channel's error
    variance on calibration keys ``[d, 4]`` and ``scale2`` the mean squared
    block scale on the same keys ``[d]`` (the calibrated gain table; None: not
    calibrated); ``levels``: the reconstruction table the store's planes are
    read through ``float32 [d, 4, 16]`` (None: the midpoints; with a table,
    ``plane_drops`` are measured through it).
    """

    sigma2: np.ndarray
    ds_rank: np.ndarray
    sigma2_store: np.ndarray | None = None
    layer: int | None = None
    plane_drops: np.ndarray | None = None
    scale2: np.ndarray | None = None
    levels: np.ndarray | None = None


def _top_channels(score: np.ndarray, r: int) -> np.ndarray:
    """Depth 4 on the r channels with the largest ``score [..., d]`` (ties to the lower channel)."""
    order = np.argsort(-score, axis=-1, kind="stable")[..., :r]
    depths = np.zeros(score.shape, np.int8)
    np.put_along_axis(depths, order, MAX_DEPTH, axis=-1)
    return depths


def _check_budget(name: str, budget: float) -> None:
    if not _checks.is_real(budget) or budget < 0:
        raise ValueError(f"{name} must be a finite number of bits per token >= 0, got {budget!r}")


def _check_channels(r: int) -> None:
    if not _checks.is_integer(r) or r < 1:
        raise ValueError(f"r must be an integer >= 1 channels, got {r!r}")


def _check_sources(variance: str, gains: str) -> None:
    if variance not in VARIANCE_SOURCES + (PER_BASIS,):
        raise ValueError(f"variance must be one of {VARIANCE_SOURCES + (PER_BASIS,)}, got {variance!r}")
    if gains not in GAIN_SOURCES:
        raise ValueError(f"gains must be one of {GAIN_SOURCES}, got {gains!r}")


def _importance_and_table(q: np.ndarray, stats: HeadStats, variance: str, gains: str
                          ) -> tuple[np.ndarray, np.ndarray | None]:
    """One head's water-filling inputs: the importances ``w [..., d]`` of query groups ``q [..., G, d]`` with σ²
    from ``variance``, and its gain table (None: design §5's model; else the head's calibrated table scaled so that
    ``w_c · γ_{c,t}`` is the measured drop times the drift of σ² since calibration, σ² now over σ² then by the same
    statistic)."""
    if variance == PER_BASIS:
        raise ValueError("a per-head method's policy runs on one basis: resolve it with Method.on_basis first")
    sigma2 = stats.sigma2 if variance == "calibration" else stats.sigma2_store
    if sigma2 is None:
        raise ValueError("stats.sigma2_store is needed for variance='store'")
    return importance(q, sigma2), (gain_table(stats, variance) if gains == "calibrated" else None)


def _waterfill_depths(q: np.ndarray, stats: HeadStats, budget: float, variance: str, gains: str) -> np.ndarray:
    """Water-filled depths of query groups ``q [..., G, d]`` with σ² from ``variance`` and the plane gains
    from ``gains`` (see :func:`_importance_and_table`)."""
    w, table = _importance_and_table(q, stats, variance, gains)
    return waterfill_batched(w, budget, table)


def gain_table(stats: HeadStats, variance: str) -> np.ndarray:
    """The calibrated relative plane gains γ ``float64 [d, 4]`` of one KV head for σ² from ``variance``
    ("calibration" or "store"): the measured drops over the σ² statistic of calibration time (σ² itself, or the
    mean squared block scale for the store's σ²), so that ``w_c · γ_{c,t}`` with today's σ² is the drop times σ²'s
    drift. What the GPU planner takes (``fathom.host.decoder.Decoder``'s ``gains``) as the reference planner uses
    it."""
    if variance not in VARIANCE_SOURCES:
        raise ValueError(f"variance must be one of {VARIANCE_SOURCES}, got {variance!r}")
    if stats.plane_drops is None or (variance == "store" and stats.scale2 is None):
        raise ValueError("gains='calibrated' needs a calibration with plane drops (fathom.calibration)")
    then = stats.sigma2 if variance == "calibration" else stats.scale2
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(then[:, None] > 0, stats.plane_drops / then[:, None], 0.0)


@dataclass(frozen=True)
class Waterfill:
    """Reverse water-filling under ``budget`` bits/token; σ² from the store or from calibration (``per-basis``:
    the basis' default, for the per-head store), plane gains from design §5 or calibration.

    ``pooled``: one water line for every KV head of a layer (:func:`pooled_depths`), so their mean read is at most
    ``budget`` and a plane is read where it removes the most score error in the layer. The score errors of a layer's
    heads are logits of one softmax scale, so their gains are on one scale; design §5's plan per query group
    (``pooled=False``) gives each head the same bits however little its queries weigh."""

    budget: float
    variance: str
    gains: str = "design"
    pooled: bool = False

    def __post_init__(self):
        _check_sources(self.variance, self.gains)
        _check_budget("budget", self.budget)

    def nominal_bits(self, d: int) -> float:
        return float(self.budget)

    def layer_budgets(self, layers: int) -> tuple[float, ...]:
        """The budget of each of ``layers`` layers: the one budget everywhere."""
        return (self.budget,) * layers

    def on_basis(self, basis: str) -> Waterfill:
        """The policy on one basis: a ``per-basis`` σ² becomes that basis' default."""
        return self if self.variance != PER_BASIS else replace(self, variance=DEFAULT_VARIANCE[basis])

    def depths(self, q: np.ndarray, stats: HeadStats) -> np.ndarray:
        if self.pooled:
            raise ValueError("a pooled policy plans every KV head of a layer at once: use pooled_depths")
        return _waterfill_depths(q, stats, self.budget, self.variance, self.gains)


def pooled_depths(policies: list[Waterfill], q: list[np.ndarray], stats: list[HeadStats]) -> np.ndarray:
    """One water line for the KV heads of a layer: each head ``h``'s query groups ``q[h] [..., G, d]`` in its
    store's basis, its ``stats[h]`` (with the store's σ² where the policy reads it) and its ``policies[h]`` (one
    policy resolved per head's basis: the same budget and gains) -> depths ``int8 [H, ..., d]`` whose mean cost over
    the heads is at most the budget, at each of ``[...]``.

    Example (a head whose queries are zero reads nothing; the other spends both heads' 8 bits)::

        >>> import numpy as np
        >>> from fathom import methods
        >>> stats = methods.HeadStats(sigma2=np.ones(8), ds_rank=np.arange(8))
        >>> q = np.arange(1.0, 9.0)[None]  # one query head, 8 channels
        >>> methods.Waterfill(8, "calibration").depths(q, stats).tolist()
        [0, 0, 0, 1, 1, 1, 1, 2]
        >>> policy = methods.Waterfill(8, "calibration", pooled=True)
        >>> methods.pooled_depths([policy, policy], [q, 0 * q], [stats, stats]).tolist()
        [[0, 1, 1, 2, 2, 2, 3, 3], [0, 0, 0, 0, 0, 0, 0, 0]]
    """
    if not policies or len(policies) != len(q) or len(q) != len(stats):
        raise ValueError(f"policies, q and stats must hold one entry per KV head (>= 1), got {len(policies)}, "
                         f"{len(q)} and {len(stats)}")
    first = policies[0]
    if any(p.budget != first.budget or p.gains != first.gains or not p.pooled for p in policies):
        raise ValueError("every head of a pooled plan must share one pooled policy's budget and gains")
    inputs = [_importance_and_table(qh, sh, p.variance, p.gains) for p, qh, sh in zip(policies, q, stats)]
    w = np.concatenate([w for w, _ in inputs], axis=-1)  # [..., H·d]: every head's channels on one water line
    table = None if first.gains == "design" else np.concatenate([t for _, t in inputs], axis=-2)
    heads = len(policies)
    depths = waterfill_batched(w, heads * first.budget, table)
    return np.moveaxis(depths.reshape(depths.shape[:-1] + (heads, -1)), -2, 0)


@dataclass(frozen=True)
class LayerWaterfill:
    """The per-layer plan: water-filling with each layer's own budget; their mean is at most ``target``."""

    budgets: tuple[float, ...]
    target: float
    variance: str
    gains: str = "design"

    def __post_init__(self):
        _check_sources(self.variance, self.gains)
        _check_budget("target", self.target)
        if not self.budgets:
            raise ValueError("budgets must hold one budget per layer, got none")
        for budget in self.budgets:
            _check_budget("budgets", budget)
        if np.mean(self.budgets) > self.target + 1e-9:
            raise ValueError(f"budgets must average at most target = {self.target}, got {np.mean(self.budgets)}")

    def nominal_bits(self, d: int) -> float:
        return float(self.target)

    def layer_budgets(self, layers: int) -> tuple[float, ...]:
        """The budget of each layer: the plan's (the caller checks that it covers ``layers``)."""
        return self.budgets

    def depths(self, q: np.ndarray, stats: HeadStats) -> np.ndarray:
        if stats.layer is None or not 0 <= stats.layer < len(self.budgets):
            raise ValueError(f"layer must lie in 0..{len(self.budgets) - 1} for a per-layer plan, got {stats.layer}")
        return _waterfill_depths(q, stats, self.budgets[stats.layer], self.variance, self.gains)

    def on_basis(self, basis: str) -> LayerWaterfill:
        return self if self.variance != PER_BASIS else replace(self, variance=DEFAULT_VARIANCE[basis])


@dataclass(frozen=True)
class QueryTopChannels:
    """SparQ: the r channels with the largest ``Σ_h |q[h, c]|`` over the group, at depth 4."""

    r: int

    def __post_init__(self):
        _check_channels(self.r)

    def nominal_bits(self, d: int) -> float:
        return fixed_channel_bits(self.r)

    def depths(self, q: np.ndarray, stats: HeadStats) -> np.ndarray:
        return _top_channels(np.abs(q).sum(axis=-2), self.r)


@dataclass(frozen=True)
class FixedChannels:
    """Depth 4 on r channels fixed offline: Double Sparsity's first r ranked channels
    (``ranking="double-sparsity"``), or Loki's first r coordinates of the basis (``ranking="basis"``)."""

    r: int
    ranking: str = "double-sparsity"

    def __post_init__(self):
        _check_channels(self.r)
        if self.ranking not in ("double-sparsity", "basis"):
            raise ValueError(f"ranking must be 'double-sparsity' or 'basis', got {self.ranking!r}")

    @property
    def reads_ds_rank(self) -> bool:
        return self.ranking == "double-sparsity"

    def nominal_bits(self, d: int) -> float:
        return fixed_channel_bits(self.r)

    def depths(self, q: np.ndarray, stats: HeadStats) -> np.ndarray:
        channels = stats.ds_rank[:self.r] if self.ranking == "double-sparsity" else np.arange(self.r)
        depths = np.zeros(q.shape[:-2] + q.shape[-1:], np.int8)
        depths[..., channels] = MAX_DEPTH
        return depths


@dataclass(frozen=True)
class UniformDepth:
    """Every channel at the same depth: the 2-bit thumbnail at depth 2."""

    depth: int

    def __post_init__(self):
        if not _checks.is_integer(self.depth) or not 1 <= self.depth <= MAX_DEPTH:
            raise ValueError(f"depth must be an integer in 1..{MAX_DEPTH} planes, got {self.depth!r}")

    @property
    def reads_ds_rank(self) -> bool:
        return False

    def nominal_bits(self, d: int) -> float:
        return float(scan_bits(np.full(d, self.depth)))

    def depths(self, q: np.ndarray, stats: HeadStats) -> np.ndarray:
        return np.full(q.shape[:-2] + q.shape[-1:], self.depth, np.int8)


DepthPolicy = Waterfill | LayerWaterfill | QueryTopChannels | FixedChannels | UniformDepth
SCORERS = ("planes", "landmark", "exact", "dense")
BASES = ("raw", "rotated")
PER_HEAD = "per-head"  # each (layer, KV head) scans the basis it chose on calibration text (Calibration.head_basis)


@dataclass(frozen=True)
class Method:
    """A named method: which store (basis, or ``per-head``) it scans and how (depth policy or its own scorer)."""

    name: str
    scorer: str = "planes"
    basis: str = "raw"
    policy: DepthPolicy | None = None
    predicts: bool = False  # scores as the prediction of q·k from the planes read (fathom.prediction)

    def __post_init__(self):
        if self.scorer not in SCORERS:
            raise ValueError(f"scorer must be one of {SCORERS}, got {self.scorer!r}")
        if self.predicts and self.scorer != "planes":
            raise ValueError("predicts is a plane method's estimator: scorer must be 'planes'")
        if self.basis not in BASES + (PER_HEAD,):
            raise ValueError(f"basis must be one of {BASES + (PER_HEAD,)}, got {self.basis!r}")
        if (self.scorer == "planes") != (self.policy is not None):
            raise ValueError("policy must be given exactly when scorer == 'planes'")
        if (self.basis == PER_HEAD) != (getattr(self.policy, "variance", None) == PER_BASIS):
            raise ValueError(f"a {PER_HEAD} method water-fills with σ² {PER_BASIS!r}, and only it does")

    def on_basis(self, basis: str) -> Method:
        """The method a head runs: a per-head method on the ``basis`` that head chose; any other as it is."""
        if self.basis != PER_HEAD:
            return self
        return replace(self, basis=basis, policy=self.policy.on_basis(basis))

    @property
    def scans_planes(self) -> bool:
        """Whether it scores through a depth policy over a plane store (else its own scorer, or none: dense)."""
        return self.scorer == "planes"

    @property
    def pooled(self) -> bool:
        """Whether its depths are planned for every KV head of a layer at once (:func:`pooled_depths`)."""
        return bool(getattr(self.policy, "pooled", False))

    @property
    def calibrated_gains(self) -> bool:
        """Whether it water-fills with the calibrated plane gains (:func:`gain_table`), not design §5's model."""
        return getattr(self.policy, "gains", "design") == "calibrated"

    @property
    def scans_rotated(self) -> bool:
        """Whether it scans the rotated store (fathom-rotated, loki, on some heads fathom-mixed): the store then
        needs a basis."""
        return self.scans_planes and self.basis in ("rotated", PER_HEAD)

    def nominal_bits(self, d: int) -> float:
        """Scan bits per token by design §4 (the budget for fathom; 0 for dense)."""
        if self.policy is not None:
            return self.policy.nominal_bits(d)
        return {"landmark": landmark_bits(d), "exact": full_key_bits(d), "dense": 0.0}[self.scorer]

    def label(self, d: int) -> str:
        """``name@bits``, e.g. ``double-sparsity@136`` (plain ``dense``: it reads no scan)."""
        if self.scorer == "dense":
            return self.name
        return f"{self.name}@{self.nominal_bits(d):g}"


def _tagged(name: str, tags: list[str]) -> str:
    return f"{name}[{','.join(tags)}]" if tags else name


def predicting(method: Method) -> Method:
    """``method`` scoring its planes through the prediction of :mod:`fathom.prediction` (the same depths and bits;
    its name tagged ``lmmse``: ``fathom-mixed[gains,lmmse]``, ``double-sparsity[lmmse]``).

    >>> predicting(double_sparsity(32)).label(128)
    'double-sparsity[lmmse]@136'
    """
    if not method.scans_planes or method.predicts:
        raise ValueError(f"only a plane method that does not predict yet can predict, got {method.name!r}")
    return replace(method, name=predicting_name(method.name), predicts=True)


def predicting_name(name: str) -> str:
    """The name a method called ``name`` has when it predicts (:func:`predicting`): ``lmmse`` among its tags."""
    return f"{name[:-1]},lmmse]" if name.endswith("]") else f"{name}[lmmse]"


def _variant_tags(gains: str, pooled: bool) -> list[str]:
    return (["gains"] if gains == "calibrated" else []) + (["pooled"] if pooled else [])


def _named(name: str, basis: str, variance: str | None, gains: str = "design", pooled: bool = False
           ) -> tuple[str, str]:
    """(label name, σ² source): the basis' default source, design §5's gains and a plan per query group keep the
    plain name; the other source, calibrated gains and the pooled plan are named in brackets
    (``fathom[calibration,gains,pooled]``)."""
    if basis not in BASES:
        raise ValueError(f"basis must be one of {BASES}, got {basis!r}")
    variance = DEFAULT_VARIANCE[basis] if variance is None else variance
    tags = ([variance] if variance != DEFAULT_VARIANCE[basis] else []) + _variant_tags(gains, pooled)
    return _tagged(name, tags), variance


def fathom(budget: float, variance: str | None = None, gains: str = "design", pooled: bool = False) -> Method:
    """Fathom on the raw store; σ² from ``variance`` (default: the raw basis' default, ``store``); plane gains
    from ``gains`` (design §5's model, or ``"calibrated"``: the calibration's measured table); ``pooled``: one
    water line for every KV head of a layer (:class:`Waterfill`)."""
    name, variance = _named("fathom", "raw", variance, gains, pooled)
    return Method(name, policy=Waterfill(budget, variance, gains, pooled))


def fathom_rotated(budget: float, variance: str | None = None, gains: str = "design", pooled: bool = False
                   ) -> Method:
    """Fathom on the rotated store; σ² from ``variance`` (default: the rotated basis' default, ``calibration``);
    ``gains`` and ``pooled`` as in :func:`fathom`."""
    name, variance = _named("fathom-rotated", "rotated", variance, gains, pooled)
    return Method(name, basis="rotated", policy=Waterfill(budget, variance, gains, pooled))


def fathom_mixed(budget: float, gains: str = "design", pooled: bool = False) -> Method:
    """Fathom on the per-head store: each (layer, KV head) scans the basis it chose on calibration text
    (``Calibration.head_basis``) with that basis' default σ²; ``gains`` and ``pooled`` as in :func:`fathom`."""
    return Method(_tagged("fathom-mixed", _variant_tags(gains, pooled)), basis=PER_HEAD,
                  policy=Waterfill(budget, PER_BASIS, gains, pooled))


def fathom_plan(budgets: tuple[float, ...], target: float, basis: str = "raw",
                variance: str | None = None, gains: str = "design") -> Method:
    """Fathom with a per-layer plan (``budgets[layer]``, mean <= ``target``; see
    :func:`fathom.waterfill.per_layer_plan`) on the raw, rotated or per-head store (``basis`` ``"per-head"``:
    ``fathom-mixed-plan``, each head on its basis' default σ², so no ``variance``); σ² by default the basis'
    default; ``gains`` as in :func:`fathom`."""
    if basis == PER_HEAD:
        if variance is not None:
            raise ValueError(f"the per-head store reads each basis' default σ²: variance must be None, got "
                             f"{variance!r}")
        name, variance = _tagged("fathom-mixed-plan", _variant_tags(gains, False)), PER_BASIS
    else:
        name, variance = _named("fathom-plan" if basis == "raw" else "fathom-rotated-plan", basis, variance, gains)
    return Method(name, basis=basis,
                  policy=LayerWaterfill(tuple(float(b) for b in budgets), float(target), variance, gains))


def sparq(r: int) -> Method:
    return Method("sparq", policy=QueryTopChannels(r))


def double_sparsity(r: int) -> Method:
    return Method("double-sparsity", policy=FixedChannels(r))


def loki(r: int) -> Method:
    return Method("loki", basis="rotated", policy=FixedChannels(r, ranking="basis"))


def thumbnail(depth: int = 2) -> Method:
    return Method(f"thumbnail-{depth}bit", policy=UniformDepth(depth))


def landmark() -> Method:
    return Method("landmark", scorer="landmark")


def oracle() -> Method:
    return Method("oracle", scorer="exact")


def dense() -> Method:
    return Method("dense", scorer="dense")


def baselines(d: int) -> list[Method]:
    """Every baseline of design §7 at the paper's channel fractions: r = d/4 and d/8 (136 and 68 bits at d = 128)."""
    quarter, eighth = d // 4, d // 8
    return [dense(), oracle(), landmark(), thumbnail(2), sparq(eighth), sparq(quarter),
            double_sparsity(eighth), double_sparsity(quarter), loki(eighth), loki(quarter)]


# --- The catalog: every method a user names (FathomCache's ``method=``, a bench's ``name@bits``) -----------------

BUDGET_RULES = ("bits", "channels", "none")
VARIANTS = ("gains", "pooled")  # the water-filling variants a method may take (Entry.variants)


@dataclass(frozen=True)
class Entry:
    """One method of the catalog: its spec name, what its budget means, what it reads, and its factory.

    ``budget``: "bits" (the scan bits per token, ``make(budget, variance, plan, gains, pooled)``), "channels"
    (``4.25·r`` bits name r channels at 4 bits, ``make(r)``) or "none" (``make()``). ``basis``: the store it scans
    (None: it scans no planes). ``reads_sigma2``: water-filled on σ² (from the store, or from calibration when
    ``variance="calibration"`` or the rotated basis asks for it). ``reads_ds_rank``: Double Sparsity's offline
    channel ranking. ``per_layer``: its budget is the mean of per-layer budgets planned on data (over
    :data:`PLAN_BUDGETS`). ``variants``: which of the water-filling variants it takes, ``"gains"`` (the
    calibrated plane gains, ``gains="calibrated"``) and ``"pooled"`` (one water line for a layer's KV heads).
    ``aliases``: older spellings the parser still accepts.
    """

    name: str
    budget: str
    make: Callable[..., Method]
    basis: str | None = "raw"
    reads_sigma2: bool = False
    reads_ds_rank: bool = False
    per_layer: bool = False
    variants: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()

    def needs_calibration(self, variance: str | None = None, gains: str = "design") -> bool:
        """Whether it reads calibration statistics (a basis, DS channels, calibration σ² or, with
        ``gains="calibrated"``, the plane gains)."""
        if self.basis == PER_HEAD or gains == "calibrated":
            return True
        sigma2 = self.reads_sigma2 and (variance or DEFAULT_VARIANCE[self.basis]) == "calibration"
        return self.basis == "rotated" or self.reads_ds_rank or sigma2

    def calibration_needs(self, gains: str = "design") -> set[str]:
        """What a calibration computed for it holds (``fathom.cuda.calibration.NEEDS``): σ² always, the basis
        when it scans the rotated store, the DS ranking when it reads one, the plane drops with
        ``gains="calibrated"``. (The per-head store's choice of basis is made on calibration text by ``python -m
        bench fidelity``: it is given, never computed from a prompt.)"""
        return {"sigma2"} | ({"basis"} if self.basis in ("rotated", PER_HEAD) else set()) | \
            ({"ds_rank"} if self.reads_ds_rank else set()) | ({"plane_drops"} if gains == "calibrated" else set())

    def check_variants(self, gains: str, pooled: bool) -> None:
        """Refuse a water-filling variant it does not take (``gains`` one of :data:`GAIN_SOURCES`)."""
        if gains not in GAIN_SOURCES:
            raise ValueError(f"gains must be one of {GAIN_SOURCES}, got {gains!r}")
        if not isinstance(pooled, bool):
            raise ValueError(f"pooled must be True or False, got {pooled!r}")
        for variant, asked in (("gains", gains == "calibrated"), ("pooled", pooled)):
            if asked and variant not in self.variants:
                takers = ", ".join(n for n, e in CATALOG.items() if variant in e.variants)
                raise ValueError(f"{'gains=' + repr(gains) if variant == 'gains' else 'pooled=True'} is taken by "
                                 f"{takers} only; method is {self.name!r}")

    def budget_form(self) -> str:
        """How its spec is written, with an example that parses."""
        if self.budget == "channels":
            return f"{self.name}@BITS with BITS = 4.25·r for r channels, e.g. {self.name}@68 (r = 16)"
        if self.budget == "bits":
            return f"{self.name}@BITS with BITS the scan bits per token, e.g. {self.name}@48"
        return self.name


CATALOG: dict[str, Entry] = {e.name: e for e in (
    Entry("dense", "none", dense, basis=None),
    Entry("oracle", "none", oracle, basis=None),
    Entry("fathom", "bits", lambda budget, variance, plan, gains, pooled: fathom(budget, variance, gains, pooled),
          reads_sigma2=True, variants=VARIANTS),
    Entry("fathom-rotated", "bits", lambda budget, variance, plan, gains, pooled:
          fathom_rotated(budget, variance, gains, pooled), basis="rotated", reads_sigma2=True, variants=VARIANTS),
    Entry("fathom-plan", "bits", lambda budget, variance, plan, gains, pooled:
          fathom_plan(plan, budget, "raw", variance), reads_sigma2=True, per_layer=True),
    Entry("fathom-mixed", "bits", lambda budget, variance, plan, gains, pooled: fathom_mixed(budget, gains, pooled),
          basis=PER_HEAD, reads_sigma2=True, variants=VARIANTS),
    Entry("sparq", "channels", sparq),
    Entry("double-sparsity", "channels", double_sparsity, reads_ds_rank=True),
    Entry("loki", "channels", loki, basis="rotated"),
    # FathomCache and the decoding benches have always spelled it "thumbnail"; Method.name says the depth.
    Entry("thumbnail", "none", thumbnail, aliases=("thumbnail-2bit",)),
    Entry("landmark", "none", landmark, basis=None),
)}
NAMES = tuple(CATALOG)
_SPELLINGS = {alias: e.name for e in CATALOG.values() for alias in (e.name, *e.aliases)}


def entry(name: str) -> Entry:
    """The catalog entry of ``name`` (an alias is accepted); ValueError names the known methods."""
    if name not in _SPELLINGS:
        raise ValueError(f"method must be one of {', '.join(NAMES)}; got {name!r}")
    return CATALOG[_SPELLINGS[name]]


def is_known(name: str) -> bool:
    """Whether ``name`` spells a method of the catalog (its name or an alias)."""
    return name in _SPELLINGS


def names(budget: str) -> tuple[str, ...]:
    """The catalog's names whose budget rule is ``budget`` ("bits", "channels" or "none"), in catalog order."""
    return tuple(n for n, e in CATALOG.items() if e.budget == budget)


def check_budget(name: str, budget: float, planned: bool = False) -> None:
    """Refuse a budget ``name`` cannot run at (``planned``: fathom-plan's per-layer budgets are given)."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not np.isfinite(budget) or budget <= 0:
        raise ValueError(f"budget must be a finite number of bits per token > 0, got {budget!r}")
    if entry(name).per_layer and not planned and not PLAN_BUDGETS[0] <= budget <= PLAN_BUDGETS[-1]:
        raise ValueError(f"budget must lie in {PLAN_BUDGETS[0]}..{PLAN_BUDGETS[-1]} bits to plan fathom-plan "
                         f"over the candidates {PLAN_BUDGETS} (or pass plan=), got {budget}")


def channels(budget: float, d: int, r: int | None = None) -> int:
    """r of a fixed-channel method at head dim ``d``: ``r`` when given, else ``budget / 4.25``."""
    r_ = r if r is not None else budget / fixed_channel_bits(1)
    if r_ != int(r_) or not 1 <= r_ <= d:
        raise ValueError(f"budget must be r·4.25 bits for an integer r in 1..{d} (e.g. 68 for r = 16), or pass "
                         f"r=; got budget = {budget}, r = {r}")
    return int(r_)


def build(name: str, d: int, budget: float | None = None, r: int | None = None, variance: str | None = None,
          plan: tuple[float, ...] | None = None, gains: str = "design", pooled: bool = False) -> Method:
    """The :class:`Method` ``name`` at head dim ``d`` (``budget``: its bits, see :class:`Entry`; ``r``: the
    channels of a fixed-channel method instead; ``plan``: fathom-plan's per-layer budgets; ``gains`` and
    ``pooled``: the water-filling variants, refused by a method that does not take them)."""
    e = entry(name)
    e.check_variants(gains, pooled)
    if e.budget == "channels":
        return e.make(channels(budget, d, r))
    if e.budget == "bits":
        return e.make(budget, variance, plan, gains, pooled)
    return e.make()


class Spec(NamedTuple):
    """A method spec as written (:func:`read_spec`): the catalog name, its bits (None: it reads none), and the
    water-filling choices its tags name (None / ``"design"`` / False where untagged)."""

    name: str
    budget: float | None
    variance: str | None = None
    gains: str = "design"
    pooled: bool = False

    @property
    def label(self) -> str:
        """The spec written back: ``name[tags]@bits`` (tags as written, a σ² source first)."""
        tags = ([self.variance] if self.variance else []) + _variant_tags(self.gains, self.pooled)
        return _tagged(self.name, tags) + ("" if self.budget is None else f"@{self.budget:g}")

    def settings(self) -> dict:
        """FathomCache's keyword settings for it beside the method name: its budget and the tagged choices."""
        return ({} if self.budget is None else {"budget": self.budget}) | \
            ({"variance": self.variance} if self.variance else {}) | \
            ({"gains": self.gains} if self.gains != "design" else {}) | ({"pooled": True} if self.pooled else {})


def read_spec(text: str) -> Spec:
    """``name``, ``name@bits`` or ``name[tags]@bits`` -> :class:`Spec`; the budget is not yet checked against a head
    dim (:func:`parse` does). Tags are the labels' (:meth:`Method.label`): a σ² source (``store``,
    ``calibration``), ``gains`` (the calibrated plane gains) and ``pooled``, e.g. ``fathom-mixed[gains,pooled]@48``.
    ValueError says how the spec is written."""
    head, _, bits = text.partition("@")
    name, tags = head, []
    if head.endswith("]") and "[" in head:
        name, _, inner = head[:-1].partition("[")
        tags = inner.split(",")
    if not is_known(name):
        raise ValueError(f"the name must be one of {', '.join(names('none') + names('bits') + names('channels'))}")
    e = entry(name)
    known = VARIANCE_SOURCES + VARIANTS
    if any(t not in known for t in tags) or len(set(tags)) != len(tags):
        raise ValueError(f"tags must be distinct names from {', '.join(known)} (e.g. {name}[gains,pooled]@48), got "
                         f"[{','.join(tags)}]")
    sources = [t for t in tags if t in VARIANCE_SOURCES]
    if len(sources) > 1 or sources and not e.reads_sigma2 or sources and e.basis == PER_HEAD:
        raise ValueError(f"a σ² tag ({' or '.join(VARIANCE_SOURCES)}) is taken once, by a method that reads σ² on one "
                         f"basis; got [{','.join(tags)}] for {name}")
    spec = Spec(e.name, None, sources[0] if sources else None, "calibrated" if "gains" in tags else "design",
                "pooled" in tags)
    e.check_variants(spec.gains, spec.pooled)
    if e.budget == "none":
        if bits:
            raise ValueError(f"{name} reads no budget; write it bare ({name!r})")
        return spec
    try:
        budget = float(bits)
    except ValueError:
        raise ValueError(f"{name} takes a budget: write {e.budget_form()}") from None
    return spec._replace(budget=budget)


def split_specs(text: str) -> list[str]:
    """Comma-separated specs -> the specs, a tag list's commas kept: ``"fathom@48,fathom[gains,pooled]@48"`` is
    ``["fathom@48", "fathom[gains,pooled]@48"]``."""
    return re.split(r",(?![^\[\]]*\])", text)


def parse(text: str, d: int, variance: str | None = None) -> Method:
    """The method a spec names at head dim ``d``: ``parse("sparq@68", 128)`` is ``sparq(16)``; ``"fathom@48"``
    water-fills 48 bits; bare names (``"dense"``, ``"thumbnail"``) read no budget. fathom-plan is planned on
    data (:func:`fathom.fidelity.plan_layers`): a spec gives only its mean budget, so it is refused here."""
    spec = read_spec(text)
    if entry(spec.name).per_layer:
        raise ValueError(f"{spec.name}'s per-layer budgets are planned on data: build it with fathom_plan()")
    if spec.budget is not None:
        check_budget(spec.name, spec.budget)
    if variance is not None and spec.variance is not None and variance != spec.variance:
        raise ValueError(f"variance={variance!r} disagrees with the spec's tag {spec.variance!r}")
    return build(spec.name, d, spec.budget, variance=spec.variance or variance, gains=spec.gains, pooled=spec.pooled)
