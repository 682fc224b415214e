"""What a :class:`~fathom.integrations.transformers.FathomCache` is made from: its settings (validated), the
attention shapes read off the model's config (under transformers' tensor parallelism, this rank's share of the
heads), and the calibration it is given (loaded and checked)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fathom import _checks, methods
from fathom.bits import fixed_channel_bits
from fathom.calibration import Calibration
from fathom.methods import Method

BACKENDS = ("auto", "reference", "offloaded")
SETTINGS = ("r", "sink", "local", "variance", "gains", "pooled", "levels", "plan", "calibration", "backend",
            "max_tokens", "hbm_gb", "row_cache_rows", "pool")
LEVELS = ("midpoint", "calibrated")  # how the scan reads a cell of the bit planes (FathomSettings.levels)
DEFAULT_BUDGET = 48.0  # bits per token of the bit-budget methods when none is given
RESERVE_TOKENS = 4096  # room reserved past the longest prompt when max_tokens is not given (grown beyond it)


@dataclass(frozen=True)
class FathomSettings:
    """What a :class:`FathomCache` decodes with (validated here; the model-dependent checks are the cache's).

    ``budget``: bits per token for fathom, fathom-rotated, fathom-mixed and fathom-plan (the plan's mean; None:
    :data:`DEFAULT_BUDGET`); for sparq, double-sparsity and loki it names ``r = budget / 4.25`` channels at 4 bits
    (68 -> 16, 136 -> 32), and one of ``budget`` and ``r`` must be given; the others read none and refuse one (it
    stays None). ``k``: top-k per query head (None: design §6's k by the longest prompt). ``gains``: the plane
    gains fathom, fathom-rotated and fathom-mixed water-fill with: ``"design"`` (design §5's model) or
    ``"calibrated"`` (each (layer, KV head)'s table measured on calibration keys: the given calibration's plane drops,
    or the prompt's). ``pooled``: one water line for a layer's KV heads (their mean read is the budget), where
    design §5 plans each query group on its own. ``python -m bench fidelity`` chooses between the four on calibration
    text (its plan rule, docs/results.md). ``levels``: how a plane method's scan reads a cell of the bit planes:
    ``"midpoint"`` (design §2) or ``"calibrated"`` (each cell read as the mean of the calibration keys in it: the
    given calibration's reconstruction tables, ``Calibration.levels_raw`` / ``levels_rotated``; with
    ``gains="calibrated"`` the plane tables measured through them); the same bits read. ``plan``: fathom-plan's
    per-layer budgets, one per full-attention layer (None: planned on the prompt). ``max_tokens``: per session,
    offloaded backend (None: the longest prompt plus :data:`RESERVE_TOKENS`, in a bucket of
    :func:`~fathom.integrations.sessions.capacity`; grown when needed). ``hbm_gb``: HBM the offloaded store's scales
    and top bit planes may take (GB; 0: every plane pinned in host memory): the most planes per channel that fit at
    the cache's capacity when it is made (``fathom.layout``'s tiers; a grown cache keeps its tier).
    ``row_cache_rows``: HBM row cache slots per (session, layer, KV head), offloaded backend (0: none;
    ``fathom.row_cache``: the rows a step selected recently stay in HBM and only the misses cross the link; 4× a
    step's ``G · k + sink + local`` rows hits about 90% on real text; on the H200 at 128k, 16× — 32,768 slots at
    k = 512, 512 bytes each — was faster than 4× and 8×, docs/results.md).
    ``pool``: offloaded sessions are handed to ``fathom.integrations.sessions.POOL`` when the cache closes.
    """

    method: str = "fathom"
    budget: float | None = None
    k: int | None = None
    r: int | None = None
    sink: int = 4
    local: int = 32
    variance: str | None = None  # None: the store basis' default σ² source (fathom.methods.DEFAULT_VARIANCE)
    gains: str = "design"
    pooled: bool = False
    levels: str = "midpoint"
    plan: tuple[float, ...] | None = None
    backend: str = "auto"
    max_tokens: int | None = None
    hbm_gb: float = 0.0
    row_cache_rows: int = 0
    pool: bool = True

    def __post_init__(self):
        if not isinstance(self.method, str):
            raise ValueError(f"method must be a method name (a str), got {self.method!r}")
        entry = methods.entry(self.method)
        for name in ("k", "r", "max_tokens"):
            value = getattr(self, name)
            if value is not None and (not _checks.is_integer(value) or value < (0 if name == "k" else 1)):
                raise ValueError(f"{name} must be None or an integer >= {0 if name == 'k' else 1}, got {value!r}")
        for name in ("sink", "local"):
            value = getattr(self, name)
            if not _checks.is_integer(value) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if entry.budget == "channels" and self.budget is not None and self.r is not None \
                and self.budget != fixed_channel_bits(self.r):
            raise ValueError(f"budget and r disagree for {self.method}: budget = {self.budget:g} bits is r = "
                             f"{self.budget / fixed_channel_bits(1):g} channels, r = {self.r}; pass one of them")
        if entry.budget == "none":  # the spec parser's rule: a budget it would ignore is refused, not dropped
            if self.budget is not None:
                raise ValueError(f"{self.method} reads no budget: leave budget None, got {self.budget!r}")
        else:
            if self.budget is None:  # the method's default: no fixed-channel count is a default worth guessing
                if entry.budget == "channels" and self.r is None:
                    raise ValueError(f"budget must be given for {self.method}: r·4.25 bits (e.g. budget=68 for "
                                     f"r = 16), or pass r=")
                object.__setattr__(self, "budget", DEFAULT_BUDGET if self.r is None else fixed_channel_bits(self.r))
            methods.check_budget(self.method, self.budget, planned=self.plan is not None)
        if self.r is not None and entry.budget != "channels":
            raise ValueError(f"r is read by {', '.join(methods.names('channels'))} only; method is {self.method!r}")
        entry.check_variants(self.gains, self.pooled)
        if self.levels not in LEVELS:
            raise ValueError(f"levels must be one of {LEVELS}, got {self.levels!r}")
        if self.reads_levels and entry.basis is None:
            raise ValueError(f"levels='calibrated' is how a scan reads the bit planes: {self.method} scans none")
        if self.variance is not None and self.variance not in methods.VARIANCE_SOURCES:
            raise ValueError(f"variance must be None or one of {methods.VARIANCE_SOURCES}, got {self.variance!r}")
        if self.variance is not None and entry.basis == methods.PER_HEAD:
            raise ValueError(f"variance must be None for {self.method}: each head reads its basis' default σ²")
        if self.variance is not None and not entry.reads_sigma2:
            readers = ", ".join(name for name, e in methods.CATALOG.items() if e.reads_sigma2)
            raise ValueError(f"variance is read by the water-filled methods only ({readers}); method is "
                             f"{self.method!r}")
        if not _checks.is_real(self.hbm_gb) or self.hbm_gb < 0:
            raise ValueError(f"hbm_gb must be a finite number of GB >= 0, got {self.hbm_gb!r}")
        if self.hbm_gb > 0 and self.backend == "reference":
            raise ValueError("hbm_gb places the offloaded store's top planes in HBM: the reference backend has none")
        if not _checks.is_integer(self.row_cache_rows) or not 0 <= self.row_cache_rows < 1 << 30:
            raise ValueError(f"row_cache_rows must be an integer in 0..{(1 << 30) - 1}, got {self.row_cache_rows!r}")
        if self.row_cache_rows and self.backend == "reference":
            raise ValueError("row_cache_rows keeps offloaded rows in HBM: the reference backend holds every row "
                             "in memory already")
        if not isinstance(self.pool, bool):
            raise ValueError(f"pool must be True or False, got {self.pool!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.plan is not None:
            if not entry.per_layer:
                raise ValueError(f"plan is fathom-plan's per-layer budgets; method is {self.method!r}")
            if not all(isinstance(b, (int, float)) and not isinstance(b, bool) and np.isfinite(b) and b >= 0
                       for b in self.plan):
                raise ValueError(f"plan must hold finite budgets >= 0, got {self.plan!r}")
            if np.mean(self.plan) > self.budget + 1e-9:
                raise ValueError(f"plan must average at most budget = {self.budget}, got {np.mean(self.plan):g}")

    def channels(self, d: int) -> int:
        """r of the fixed-channel methods (sparq, double-sparsity, loki) at head dim ``d``."""
        return methods.channels(self.budget, d, self.r)

    @property
    def reads_levels(self) -> bool:
        """Whether the scan reads the planes through the given calibration's reconstruction tables."""
        return self.levels == "calibrated"

    def needs_calibration(self) -> bool:
        """Whether the method reads calibration statistics (a basis, DS channels, calibration σ², the calibrated
        plane gains or reconstruction tables)."""
        return self.reads_levels or methods.entry(self.method).needs_calibration(self.variance, self.gains)

    def calibration_needs(self) -> set[str]:
        """What a calibration from the prompt computes for the method (``fathom.cuda.calibration.NEEDS``)."""
        return methods.entry(self.method).calibration_needs(self.gains)

    def method_at(self, d: int, plan: tuple[float, ...] | None = None) -> Method:
        """The :class:`~fathom.methods.Method` (fathom-plan: with the per-layer budgets ``plan``)."""
        return methods.build(self.method, d, self.budget, self.r, self.variance, plan, self.gains, self.pooled)


@dataclass(frozen=True)
class ModelShape:
    """The attention shapes a cache needs, read off the model's config.

    Under transformers' tensor parallelism (a model loaded with ``distributed_config=DistributedConfig(tp_size=N)``
    or ``tp_plan="auto"``) each of the ``ranks`` processes computes attention for its own heads: ``kv_heads`` is
    this rank's share (the model's KV heads // ``ranks``; heads ``rank · kv_heads ..`` of the model, as the
    column-wise ``k_proj`` shards them), the group size is the model's. Without it ``ranks = 1``, ``rank = 0``.

    >>> import transformers
    >>> config = transformers.LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
    ...                                   num_attention_heads=4, num_key_value_heads=2)
    >>> ModelShape.of(transformers.LlamaForCausalLM(config))  # doctest: +NORMALIZE_WHITESPACE
    ModelShape(layer_types=('full_attention',), kv_heads=2, group_size=2, head_dim=16, sliding_window=None,
               context=2048, ranks=1, rank=0)
    """

    layer_types: tuple[str, ...]
    kv_heads: int  # this rank's
    group_size: int
    head_dim: int
    sliding_window: int | None
    context: int | None  # the model's context length, where its config states one
    ranks: int = 1  # tensor-parallel ranks the model's heads are split over
    rank: int = 0  # this process' place among them

    @property
    def fathom_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @classmethod
    def of(cls, model) -> ModelShape:
        return cls.of_config(model.config, *tensor_parallel_rank(model))

    @classmethod
    def of_config(cls, config, ranks: int = 1, rank: int = 0) -> ModelShape:
        """The shapes a transformers config states (a multimodal config's text decoder), on ``rank`` of ``ranks``
        tensor-parallel ranks (:func:`tensor_parallel_rank`)."""
        config = config.get_text_config(decoder=True)
        n_layers, q_heads = config.num_hidden_layers, config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or q_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // q_heads
        types = tuple(getattr(config, "layer_types", None) or ["full_attention"] * n_layers)
        unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ValueError(f"model has {', '.join(unknown)} layers; FathomCache supports full and sliding-window "
                             "attention")
        if getattr(config, "attn_logit_softcapping", None) is not None:
            raise ValueError("model soft-caps its attention logits; Fathom's exact attention does not")
        if kv_heads % ranks:
            raise ValueError(f"model must have KV heads divisible by its tensor-parallel size (model.tp_size = "
                             f"{ranks}), got {kv_heads} KV heads")
        return cls(types, kv_heads // ranks, q_heads // kv_heads, head_dim, getattr(config, "sliding_window", None),
                   getattr(config, "max_position_embeddings", None), ranks, rank)


def tensor_parallel_rank(model) -> tuple[int, int]:
    """(ranks, rank): the size of ``model``'s tensor parallelism, as transformers records it when it shards the model
    (``model.tp_size``, None when it did not), and this process' coordinate on the mesh's ``tp`` dimension (the
    whole mesh when it is one-dimensional, as transformers 5.17 builds it); (1, 0) without tensor parallelism."""
    ranks = getattr(model, "tp_size", None) or 1
    if ranks == 1:
        return 1, 0
    mesh = model._device_mesh  # set by transformers beside tp_size; its "tp" dimension orders the heads' shards
    return ranks, mesh.get_local_rank("tp" if "tp" in (mesh.mesh_dim_names or ()) else None)


def load_calibration(calibration, shape: ModelShape) -> Calibration | None:
    """A Calibration (or the path of one) checked against the model's full-attention layers; under tensor
    parallelism the whole model's is cut to this rank's KV heads, and a rank's own share is taken as it is."""
    if calibration is None:
        return None
    if isinstance(calibration, (str, Path)):
        if not Path(calibration).is_file():
            raise ValueError(f"calibration must be a .calibration.npz file or a Calibration; no file {calibration}")
        calibration = Calibration.load(calibration)
    if not isinstance(calibration, Calibration):
        raise ValueError(f"calibration must be a path or a fathom.calibration.Calibration, got "
                         f"{type(calibration).__name__}")
    layers = shape.fathom_layers
    expected = (len(layers), shape.kv_heads, shape.head_dim)
    whole = (len(layers), shape.kv_heads * shape.ranks, shape.head_dim)
    own = [shape.rank * shape.kv_heads, (shape.rank + 1) * shape.kv_heads]  # this rank's KV heads of the model's
    if shape.ranks > 1 and calibration.sigma2_raw.shape == whole:
        calibration = calibration.of_heads(*own)
    if calibration.sigma2_raw.shape != expected:
        also = f" (this rank's KV heads) or {whole} (the model's)" if shape.ranks > 1 else ""
        raise ValueError(f"calibration must have [layers, KV heads, head dim] = {expected}{also} (the model's "
                         f"full-attention layers), got {calibration.sigma2_raw.shape}")
    if calibration.meta.get("kv_heads", own) != own:
        raise ValueError(f"calibration must cover this rank's KV heads {own} (half-open, of the model's), it covers "
                         f"{calibration.meta['kv_heads']}")
    if calibration.meta.get("layers", layers) != layers:
        raise ValueError(f"calibration covers layers {calibration.meta['layers']}, the model's full-attention "
                         f"layers are {layers}")
    return calibration
