"""Which Fathom method a decoding bench runs: ``name@bits`` specs, their FathomCache, the model's calibration.

A spec names a method of :data:`fathom.methods.CATALOG` and,
where the method reads a budget, its bits per token, always written (design §4):
``fathom@48``, ``sparq@68`` (r = 16 channels at 4.25 bits: a fixed-channel
method's bits are 4.25·r), ``double-sparsity@136``; the methods without a
budget are bare: ``dense``, ``oracle``, ``thumbnail``, ``landmark``. Specs
are checked against a model's head dim before anything is loaded
(:func:`parse_specs`), and one :class:`~fathom.integrations.transformers.
FathomCache` is made per ``generate`` call (:meth:`MethodSpec.cache`).

Example::

    >>> from bench.decoding import MethodSpec
    >>> MethodSpec.parse("double-sparsity@136", head_dim=64).budget
    136.0
    >>> MethodSpec.parse("oracle", head_dim=64).label
    'oracle'
    >>> MethodSpec.parse("fathom-mixed[gains,pooled]@48", head_dim=64).label
    'fathom-mixed[gains,pooled]@48'
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.cli import UsageError
from bench import models
from bench.report import RESULTS
from fathom import methods
from fathom.bits import fixed_channel_bits
from fathom.quantize import BLOCK
from fathom.selection import Selection, always_kept

# The catalog's methods by budget rule (fathom.methods.CATALOG): bare, @bits, and @bits naming r channels
NO_BUDGET = methods.names("none")
FIXED_CHANNELS = methods.names("channels")
BUDGETED = methods.names("bits") + FIXED_CHANNELS
PER_LAYER = tuple(n for n in methods.NAMES if methods.entry(n).per_layer)  # budgets planned on data: no bench plans


def spec_help(exclude: tuple[str, ...] = ()) -> str:
    """The ``--methods`` help of a decoding bench: which methods take bits and how (``exclude``: refused there)."""
    bare = [m for m in NO_BUDGET if m not in exclude]
    flat = [m for m in methods.names("bits") if m not in exclude]
    return (f"method specs: {', '.join(bare)} bare (they read no budget); {', '.join(flat)} need @BITS, the scan "
            f"bits per token (e.g. fathom@48), and the water-filled ones take tags: a σ² source, gains (the "
            f"calibrated plane gains), pooled (e.g. fathom-mixed[gains,pooled]@48); the fixed-channel methods "
            f"{', '.join(FIXED_CHANNELS)} need @BITS = 4.25·r for r channels (e.g. sparq@68 is r = 16)")


def choosable_tokens(n: int, positions: int, sel: Selection) -> int:
    """Tokens top-k chooses from at the first of the last ``positions`` decode positions of an ``n``-token
    window (context ``n - positions + 1``): its sealed 64-token blocks less the sink and the local window."""
    context = n - positions + 1
    return int(np.count_nonzero(~always_kept(context, context // BLOCK * BLOCK, sel))) if context > 0 else 0


def min_context(positions: int, sel: Selection) -> int:
    """The shortest window whose first decode position leaves ``sel.k + 1`` tokens to choose from, so that
    top-k really selects (:func:`choosable_tokens` > k)."""
    need = sel.k + sel.sink + 1  # sealed tokens beyond the sink, and clear of the local window
    return max(-(-need // BLOCK) * BLOCK, need + sel.local) + positions - 1


def check_top_k(sel: Selection, n: int, positions: int, given: bool, context_flag: str = "--context") -> None:
    """Refuse a top-k that would not select: ``k`` at least the tokens it chooses from at the first of the last
    ``positions`` decode positions of an ``n``-token window (``given``: ``-k`` was passed, else the context is what
    is too short for the default k). Every method would then attend every token and agree with dense."""
    choosable = choosable_tokens(n, positions, sel)
    if sel.k >= choosable and given and choosable > 1:
        raise UsageError(
            f"-k must lie in 1..{choosable - 1} for a {n}-token context at {positions} decode positions (top-k "
            f"must leave some of the {choosable} tokens it chooses from at the first: its sealed {BLOCK}-token "
            f"blocks less sink {sel.sink} and local {sel.local}), got {sel.k}")
    if sel.k >= choosable:
        raise UsageError(
            f"{context_flag} {n} is too short for k = {sel.k} at {positions} decode positions: it must be >= "
            f"{min_context(positions, sel)} (sink {sel.sink} + local {sel.local} + k in sealed {BLOCK}-token "
            f"blocks before the first decode position)")


@dataclass(frozen=True)
class MethodSpec:
    """One method of FathomCache at one budget (None for the methods that read none), with the water-filling
    choices its spec's tags name (:func:`fathom.methods.read_spec`)."""

    method: str
    budget: float | None = None
    variance: str | None = None
    gains: str = "design"
    pooled: bool = False

    @property
    def spec(self) -> methods.Spec:
        return methods.Spec(self.method, self.budget, self.variance, self.gains, self.pooled)

    @property
    def label(self) -> str:
        return self.spec.label

    def method_at(self, head_dim: int):
        """The :class:`fathom.methods.Method` FathomCache decodes with at head dim ``head_dim``."""
        return methods.build(self.method, head_dim, self.budget, variance=self.variance, gains=self.gains,
                             pooled=self.pooled)

    @classmethod
    def parse(cls, text: str, head_dim: int) -> MethodSpec:
        """``name``, ``name@bits`` or ``name[tags]@bits``, checked for a model of head dim ``head_dim`` (UsageError
        names the spec)."""
        try:
            spec = methods.read_spec(text)
            if spec.budget is not None:
                methods.check_budget(spec.name, spec.budget)
                if methods.entry(spec.name).budget == "channels":
                    methods.channels(spec.budget, head_dim)  # r = bits / 4.25 must be an integer channel count <= d
        except ValueError as error:
            raise UsageError(f"method {text!r}: {error}") from None
        return cls(*spec)

    def cache(self, model, k: int | None = None, calibration: str | Path | None = None, **settings):
        """A fresh FathomCache of this method for one ``generate`` call of ``model`` (``settings``: FathomCache's,
        e.g. ``max_tokens``)."""
        from fathom.integrations.transformers import FathomCache

        return FathomCache(model, method=self.method, k=k, calibration=calibration, **self.spec.settings(), **settings)


def hf_cache(model, prompt=None, offloading: bool = False):
    """transformers' own DynamicCache (the K/V in HBM; ``offloading``: its offloaded cache, in host memory), holding
    ``prompt`` (a :func:`fathom.integrations.prefill.prefill` of ``model``) when given: every layer's keys and
    values by the cache's own ``update``, so ``generate`` continues from ``prompt.next_token`` as it does with a
    FathomCache made with ``prompt=`` (tested to generate what the cache's own prefill does)."""
    import transformers

    cache = transformers.DynamicCache(config=model.config, offloading=offloading)
    if prompt is not None:
        for layer, (keys, values) in enumerate(zip(prompt.keys, prompt.values, strict=True)):
            cache.update(keys, values, layer)
    return cache


def head_dim(model) -> int:
    """The attention head dim of a loaded transformers model."""
    config = model.config.get_text_config(decoder=True)
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def parse_specs(texts: list[str], head_dim: int) -> list[MethodSpec]:
    """Every spec checked, none twice."""
    specs = [MethodSpec.parse(t, head_dim) for t in texts]
    labels = [s.label for s in specs]
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        raise UsageError(f"methods name {', '.join(repeated)} more than once")
    return specs


def fixed_channel_budget(r: int) -> str:
    """The bits of r channels at 4 bits, as a spec's budget (``68`` for r = 16)."""
    return f"{fixed_channel_bits(r):g}"


def default_calibration(model: str, results: Path = RESULTS) -> Path | None:
    """The committed calibration of ``model`` from the fidelity bench (calibrated on Jane Austen), the one of
    the longest context when there are several; None when there is none."""
    found = []
    for path in results.glob(f"fidelity-{model}-*k-*.calibration.npz"):
        context = path.name.removeprefix(f"fidelity-{model}-").split("k-", 1)[0]
        if context.isdigit() and not path.name.endswith("-quick.calibration.npz"):
            found.append((int(context), path.name, path))
    return max(found)[2] if found else None


def require_calibration(specs: list[MethodSpec], calibration: Path | None, model: str) -> None:
    """Refuse specs that read calibration statistics (a basis, DS channels, calibration σ²) when ``model`` has
    no calibration file."""
    needs = [s.label for s in specs if methods.entry(s.method).needs_calibration()]
    if calibration is None and needs:
        raise UsageError(f"--calibration is needed by {', '.join(needs)} and {model} has none under bench/results "
                         f"(python -m bench fidelity --model {model} writes one)")


def check_calibration(path: Path, model: str) -> None:
    """Refuse a calibration file that is missing, lacks what the benches read (every array of
    :class:`fathom.calibration.Calibration`), or is not shaped for ``model``: ``[layers, KV heads, d]`` with the
    model's KV heads and head dim, and its full-attention layers (every layer of a model without sliding windows)."""
    import json

    from fathom.calibration import Calibration

    if not path.is_file():
        raise UsageError(f"--calibration {path}: no such file")
    info = models.info(model)
    try:
        calibration = Calibration.load(path)
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as error:
        raise UsageError(f"--calibration {path}: not a .calibration.npz of the fidelity bench ({error})") from None
    shape = calibration.sigma2_raw.shape
    if shape[1:] != (info.kv_heads, info.head_dim):
        raise UsageError(f"--calibration {path}: holds [layers, KV heads, d] = {shape}, {model} has "
                         f"{info.kv_heads} KV heads of d = {info.head_dim}")
    layers = shape[0]
    if (info.sliding_window is None and layers != info.layers) or not 1 <= layers <= info.layers:
        raise UsageError(f"--calibration {path}: holds {layers} layers, {model} has "
                         f"{info.layers if info.sliding_window is None else 'at most ' + str(info.layers)} "
                         "full-attention layers")
    wanted = {"sigma2_rotated": shape, "ds_rank": shape, "basis": shape + (info.head_dim,)}
    wrong = [name for name, want in wanted.items() if getattr(calibration, name).shape != want]
    if wrong:
        raise UsageError(f"--calibration {path}: {wrong[0]} has shape {getattr(calibration, wrong[0]).shape}, "
                         f"not {wanted[wrong[0]]}")
