"""Fathom inside transformers' ``generate``: a drop-in ``Cache`` and the attention function it decodes with.

::

    from fathom.integrations.transformers import FathomCache
    cache = FathomCache(model, method="fathom", budget=48)
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=32, do_sample=False)

How it plugs in, through transformers' own extension points (nothing is patched):

* :class:`FathomCache` is a ``transformers.Cache`` of per-layer ``CacheLayerMixin``
  layers: a :class:`FathomLayer` for every full-attention layer, and the model's
  own ``DynamicSlidingWindowLayer`` for sliding-window layers (Gemma-3's local
  layers stay dense, exactly as the model runs them: they never hold more than
  their window, so there is nothing to offload or scan).
* Making a cache switches the model's attention implementation to ``"fathom"``,
  registered with ``AttentionInterface`` (its mask function, sdpa's, with
  ``AttentionMaskInterface``); closing the last cache on the model (or its garbage
  collection) switches it back. The function runs the stock sdpa attention for any
  layer whose cache is not a :class:`FathomLayer`, so a ``generate`` without a
  FathomCache is plain sdpa, unchanged (tested).
* Prefill (the first forward) runs the model's own sdpa attention over the
  prompt; each batch row's non-pad keys and values are appended to its session
  in the store (left padding: every row is its own ragged session).
* Every decoded token: ``FathomLayer.update`` hands the token's K/V to the
  attention function, which appends them to every session and runs the
  method's sparse step over the store (:mod:`fathom.integrations.sessions`; on the
  GPU one captured CUDA graph per layer, checked once per token).
* A later forward of several tokens (a conversation's next turn, when ``generate``
  is called again with the conversation so far) attends densely over what the
  store holds and causally within its chunk, then appends the chunk.
* One prefill for several methods: :func:`prefill` runs it once and keeps what
  a cache's prefill records (a :class:`Prompt`); ``FathomCache(..., prompt=)``
  starts from it, and ``generate`` continues from its greedy next token.

Calibration: methods that need it (fathom-rotated and loki: the basis;
double-sparsity: its channels; ``variance="calibration"``: σ²) take
``calibration=`` — a ``.calibration.npz`` written by ``python -m bench fidelity``
or a :class:`~fathom.calibration.Calibration` (e.g. ``calibrate(capture(model,
ids))`` on a calibration text, with :func:`bench.capture.capture`). Without one
it is computed **from the prompt itself** (batch row 0, its last 128 queries), layer by
layer as the prefill passes it, in torch on the model's device and only what the method
reads (:mod:`fathom.cuda.calibration`). fathom-plan's per-layer budgets are planned on
the prompt too (``plan=`` gives them): its K/V then wait for the first decode step.
"""

from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicSlidingWindowLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from fathom import methods
from fathom.calibration import Calibration
from fathom.capture import Capture
from fathom.fidelity import plan_layers
from fathom.cuda.calibration import LayerCalibration, calibrate_layer, stack
from fathom.integrations.sessions import (POOL, LayerStats, OffloadedSessions, ReferenceSessions, SessionShape,
                                          capacity)
from fathom.methods import Method
from fathom.selection import Selection

ATTENTION = "fathom"
BACKENDS = ("auto", "reference", "offloaded")
SETTINGS = ("r", "sink", "local", "variance", "plan", "calibration", "backend", "max_tokens", "hbm_gb", "pool")
CALIBRATION_QUERIES = 128  # prompt queries per layer a calibration from the prompt uses (as the fidelity captures)
RESERVE_TOKENS = 4096  # room reserved past the longest prompt when max_tokens is not given (grown beyond it)


@dataclass(frozen=True)
class FathomSettings:
    """What a :class:`FathomCache` decodes with (validated here; the model-dependent checks are the cache's).

    ``budget``: bits per token for fathom, fathom-rotated and fathom-plan (the plan's mean); for sparq,
    double-sparsity and loki it names ``r = budget / 4.25`` channels at 4 bits (68 -> 16, 136 -> 32) unless
    ``r`` is given; other methods do not read it. ``k``: top-k per query head (None: design §6's k by the
    longest prompt). ``plan``: fathom-plan's per-layer budgets, one per full-attention layer (None: planned
    on the prompt). ``max_tokens``: per session, offloaded backend (None: the longest prompt plus
    :data:`RESERVE_TOKENS`, in a bucket of :func:`~fathom.integrations.sessions.capacity`; grown when needed).
    ``hbm_gb``: HBM the offloaded store's scales and top bit planes may take (GB; 0: every plane pinned in host
    memory): the most planes per channel that fit at the cache's capacity when it is made (``fathom.layout``'s
    tiers; a grown cache keeps its tier). ``pool``: offloaded sessions are handed to
    ``fathom.integrations.sessions.POOL`` when the cache closes.
    """

    method: str = "fathom"
    budget: float = 48
    k: int | None = None
    r: int | None = None
    sink: int = 4
    local: int = 32
    variance: str | None = None  # None: the store basis' default σ² source (fathom.methods.DEFAULT_VARIANCE)
    plan: tuple[float, ...] | None = None
    backend: str = "auto"
    max_tokens: int | None = None
    hbm_gb: float = 0.0
    pool: bool = True

    def __post_init__(self):
        entry = methods.entry(self.method)
        methods.check_budget(self.method, self.budget, planned=self.plan is not None)
        for name in ("k", "r", "max_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer))
                                      or value < (0 if name == "k" else 1)):
                raise ValueError(f"{name} must be None or an integer >= {0 if name == 'k' else 1}, got {value!r}")
        for name in ("sink", "local"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.r is not None and entry.budget != "channels":
            raise ValueError(f"r is read by {', '.join(methods.names('channels'))} only; method is {self.method!r}")
        if self.variance is not None and self.variance not in methods.VARIANCE_SOURCES:
            raise ValueError(f"variance must be None or one of {methods.VARIANCE_SOURCES}, got {self.variance!r}")
        if isinstance(self.hbm_gb, bool) or not isinstance(self.hbm_gb, (int, float, np.integer, np.floating)) \
                or not np.isfinite(self.hbm_gb) or self.hbm_gb < 0:
            raise ValueError(f"hbm_gb must be a finite number of GB >= 0, got {self.hbm_gb!r}")
        if self.hbm_gb > 0 and self.backend == "reference":
            raise ValueError("hbm_gb places the offloaded store's top planes in HBM: the reference backend has none")
        if not isinstance(self.pool, bool):
            raise ValueError(f"pool must be True or False, got {self.pool!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.plan is not None:
            if not entry.per_layer:
                raise ValueError(f"plan is fathom-plan's per-layer budgets; method is {self.method!r}")
            if not all(isinstance(b, (int, float)) and np.isfinite(b) and b >= 0 for b in self.plan):
                raise ValueError(f"plan must hold finite budgets >= 0, got {self.plan!r}")
            if np.mean(self.plan) > self.budget + 1e-9:
                raise ValueError(f"plan must average at most budget = {self.budget}, got {np.mean(self.plan):g}")

    def channels(self, d: int) -> int:
        """r of the fixed-channel methods (sparq, double-sparsity, loki) at head dim ``d``."""
        return methods.channels(self.budget, d, self.r)

    def needs_calibration(self) -> bool:
        """Whether the method reads calibration statistics (a basis, DS channels or calibration σ²)."""
        return methods.entry(self.method).needs_calibration(self.variance)

    def method_at(self, d: int, plan: tuple[float, ...] | None = None) -> Method:
        """The :class:`~fathom.methods.Method` (fathom-plan: with the per-layer budgets ``plan``)."""
        return methods.build(self.method, d, self.budget, self.r, self.variance, plan)


@dataclass(frozen=True)
class _ModelShape:
    """The attention shapes a cache needs, read off the model's config."""

    layer_types: tuple[str, ...]
    kv_heads: int
    group: int
    head_dim: int
    sliding_window: int | None
    context: int | None  # the model's context length, where its config states one

    @property
    def fathom_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @classmethod
    def of(cls, model) -> _ModelShape:
        config = model.config.get_text_config(decoder=True)
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
        return cls(types, kv_heads, q_heads // kv_heads, head_dim, getattr(config, "sliding_window", None),
                   getattr(config, "max_position_embeddings", None))


def _load_calibration(calibration, shape: _ModelShape) -> Calibration | None:
    """A Calibration (or the path of one) checked against the model's full-attention layers."""
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
    if calibration.sigma2_raw.shape != expected:
        raise ValueError(f"calibration must have [layers, KV heads, head dim] = {expected} (the model's "
                         f"full-attention layers), got {calibration.sigma2_raw.shape}")
    if calibration.meta.get("layers", layers) != layers:
        raise ValueError(f"calibration covers layers {calibration.meta['layers']}, the model's full-attention "
                         f"layers are {layers}")
    return calibration


class _Decoding:
    """What the layers of one FathomCache share: settings, the sessions once opened, the prefill's bookkeeping.

    The sessions open at the first layer of the prefill, when everything they need is known (batch, k, scale,
    capacity); a calibration from the prompt is computed layer by layer on the keys' device as the prefill passes
    each layer (:func:`fathom.cuda.calibration.calibrate_layer`, only what the method reads), before the layer's
    keys enter the store. fathom-plan with budgets from the prompt needs every layer first: its prompt waits until
    the first decode step.
    """

    def __init__(self, settings: FathomSettings, shape: _ModelShape, calibration: Calibration | None, config):
        self.settings, self.shape, self.given_calibration, self.config = settings, shape, calibration, config
        self.plan_from_prompt = methods.entry(settings.method).per_layer and settings.plan is None
        self.calibrate_from_prompt = settings.needs_calibration() and calibration is None
        self.selection: Selection | None = None
        self.method: Method | None = None
        self.scale: float | None = None
        self.sessions: ReferenceSessions | OffloadedSessions | None = None
        self.layer_calibrations: dict[int, LayerCalibration] = {}  # slot -> from the prompt
        self.uncalibrated: list[int] = []  # slots holding the prompt whose calibration waits for the first step
        self.rows: list[slice] | None = None  # the current prefill's non-pad positions per batch row
        self.waiting: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # slot -> k, v (fathom-plan from the prompt)
        self.prompt: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}  # slot -> row 0's k, v, q
        self.capturing = False  # inside a whole-token CUDA graph capture (fathom.integrations.graph)
        self.closed = False

    @property
    def calibration(self) -> Calibration | None:
        """The calibration given, or the one computed from the prompt (None before it is)."""
        if self.given_calibration is not None or len(self.layer_calibrations) < len(self.shape.fathom_layers):
            return self.given_calibration
        layers = [self.layer_calibrations[slot] for slot in range(len(self.shape.fathom_layers))]
        return stack(layers, {"text": "prompt", "layers": self.shape.fathom_layers})

    def prompt_rows(self, slot: int, valid: torch.Tensor) -> list[slice | torch.Tensor]:
        """The non-pad positions of each batch row of the prompt (``valid bool [B, n]``), read on the host once per
        prefill, at its first layer."""
        if slot == 0 or self.rows is None:
            self.rows = _rows(valid)
        return self.rows

    def prefill(self, slot: int, queries: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> None:
        """Record the prompt of one layer: ``k, v [B, H, n, d]`` at the positions :meth:`prompt_rows` gave, and
        ``queries [H·G, m, d]``, row 0's calibration queries (:func:`_calibration_queries`)."""
        self._check_scale(scale)
        if self.selection is None:
            longest = max(_count(r) for r in self.rows)
            k_top = self.settings.k if self.settings.k is not None else Selection.for_context(longest).k
            self.selection = Selection(k=k_top, sink=self.settings.sink, local=self.settings.local)
        if self.calibrate_from_prompt:
            H, G, d = self.shape.kv_heads, self.shape.group, self.shape.head_dim
            per_kv_head = queries.reshape(H, G, -1, d).transpose(1, 2).reshape(H, -1, d)
            self.layer_calibrations[slot] = calibrate_layer(k[0][:, self.rows[0]], per_kv_head,
                                                            _calibration_needs(self.settings))
        if self.plan_from_prompt:
            H, G, d = self.shape.kv_heads, self.shape.group, self.shape.head_dim
            per_head = queries.reshape(H, G, -1, d).transpose(1, 2)
            self.prompt[slot] = tuple(x.detach().to("cpu", torch.float32).numpy()
                                      for x in (k[0][:, self.rows[0]], v[0][:, self.rows[0]], per_head))
            self.waiting[slot] = (k, v)
            return
        self._open(k.shape[0], k.device)
        if isinstance(self.sessions, OffloadedSessions) and not self.sessions.cache.rotated:
            # the raw store does not depend on the calibration: applied at the first step, all layers in one copy
            # to the host, not one sync per layer in the middle of the prefill
            self.uncalibrated.append(slot)
        else:
            self._calibrate([slot])
        self._append(slot, k, v)

    def extend(self, slot: int, query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
               scale: float) -> torch.Tensor:
        """A conversation's next chunk: ``query [B, H·G, m, d]``, ``k, v [B, H, m, d]`` -> ``[B, m, H·G, d]``,
        dense over what each session holds and causal within the chunk; the chunk then enters the store."""
        self._check_scale(scale)
        if self.closed:
            raise ValueError("the FathomCache was closed")
        if self.sessions is None:
            raise ValueError("a FathomCache continues a conversation only after a decode step of its prefill")
        if slot == 0 and not bool(valid.all()):
            raise ValueError("a continuation chunk must hold no padding (every row's new tokens are real tokens); "
                             "pad the first turn only")
        out = self.sessions.extend(slot, query, k, v)
        return out.transpose(1, 2)

    def step(self, slot: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """One decoded token of every session: ``q [B, H·G, d]``, ``k, v [B, H, d]`` -> float32 ``[B, H·G, d]``."""
        if self.capturing:  # no host work: it would not be replayed (the graph's owner checks once per token)
            return self.sessions.enqueue_step(slot, q, k, v)
        self._check_scale(scale)
        if self.sessions is None:
            self._open_planned(k.shape[0], k.device)
        self.calibrate_waiting()
        if slot == 0 and isinstance(self.sessions, OffloadedSessions):
            self.sessions.begin_token()
        return self.sessions.step(slot, q, k, v)

    def close_sessions(self) -> None:
        """Hand the sessions back (to the pool when they are offloaded and pooled) or release them; the cache
        cannot decode afterwards."""
        if self.sessions is not None:
            if isinstance(self.sessions, OffloadedSessions) and self.settings.pool and not self.sessions.cache.closed:
                try:
                    self.sessions.cache.check()
                    POOL.give(self.sessions)
                except ValueError:  # a kernel flagged bad input: the memory is released, not reused
                    self.sessions.close()
            else:
                self.sessions.close()
        self.sessions, self.closed = None, True

    def _check_scale(self, scale: float) -> None:
        if self.scale is None:
            self.scale = scale
        elif scale != self.scale:
            raise ValueError(f"layers use different softmax scales ({self.scale} and {scale}); FathomCache decodes "
                             "with one")

    def _append(self, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        for session, rows in enumerate(self.rows):
            self.sessions.append(slot, session, k[session][:, rows], v[session][:, rows])

    def calibrate_waiting(self) -> None:
        """The layers whose calibration waited for the first step (:meth:`prefill`), calibrated now: the prompt's
        statistics reach the host in one go. Called before the first step, eager or captured."""
        self._calibrate(self.uncalibrated)
        self.uncalibrated = []

    def _calibrate(self, slots: list[int]) -> None:
        """Calibrate ``slots``: those with a calibration from the prompt from one stack of them (one copy to the
        host), the others from the calibration given, if any."""
        from_prompt = [slot for slot in slots if slot in self.layer_calibrations]
        if from_prompt:
            stacked = stack([self.layer_calibrations[slot] for slot in from_prompt], {})
            for i, slot in enumerate(from_prompt):
                self.sessions.calibrate(slot, LayerStats.of(stacked, i))
        if self.given_calibration is not None:
            for slot in slots:
                if slot not in self.layer_calibrations:
                    self.sessions.calibrate(slot, LayerStats.of(self.given_calibration, slot))

    def _open(self, batch: int, device: torch.device, plan: tuple[float, ...] | None = None) -> None:
        if self.closed:
            raise ValueError("the FathomCache was closed")
        if self.sessions is not None:
            return
        s = self.shape
        offloaded = self.settings.backend == "offloaded" or (self.settings.backend == "auto" and device.type == "cuda")
        longest = max(_count(r) for r in self.rows)
        max_tokens = self.settings.max_tokens or capacity(longest + RESERVE_TOKENS)
        shape = SessionShape(batch, len(s.fathom_layers), s.kv_heads, s.group, s.head_dim, max_tokens)
        self.method = self.settings.method_at(s.head_dim, plan if plan is not None else self.settings.plan)
        if offloaded and self.settings.hbm_gb > 0:
            from fathom.host.cache import hbm_planes_for

            stores = 2 if self.method.scans_rotated else 1
            shape = replace(shape, hbm_planes=hbm_planes_for(self.settings.hbm_gb * 1e9, shape.cache_shape(), stores))
        needs = self.settings.needs_calibration()
        if not offloaded:
            self.sessions = ReferenceSessions(shape, self.method, self.selection, self.scale,
                                              needs_calibration=needs)
            return
        pooled = POOL.take((shape, self.method, self.selection, self.scale)) if self.settings.pool else None
        self.sessions = pooled or OffloadedSessions(shape, self.method, self.selection, self.scale,
                                                    needs_calibration=needs)

    def _open_planned(self, batch: int, device: torch.device) -> None:
        """fathom-plan from the prompt, at the first decode step: plan on row 0's prompt, then hold every layer."""
        capture = self._prompt_capture()
        calibration = self.calibration
        planned = plan_layers(capture, calibration, [self.settings.budget], self.selection)[0]
        self._open(batch, device, planned.policy.budgets)
        self._calibrate(list(self.waiting))
        for slot, (k, v) in self.waiting.items():
            self._append(slot, k, v)
        self.waiting.clear()
        self.prompt.clear()

    def _prompt_capture(self) -> Capture:
        """Row 0's prompt as a :class:`~fathom.capture.Capture` of every full-attention layer."""
        slots = range(len(self.shape.fathom_layers))
        keys, values, queries = (np.stack([self.prompt[i][j] for i in slots]) for j in range(3))
        n, P = keys.shape[2], queries.shape[2]
        return Capture(keys, values, queries, np.arange(n - P, n), self.scale,
                       {"text": "prompt", "layers": self.shape.fathom_layers})


class _Handoff(threading.local):
    """The layer whose ``update`` just ran: its attention call, next on the same thread, decodes with it."""

    layer: FathomLayer | None = None


_handoff = _Handoff()


class FathomLayer(CacheLayerMixin):
    """One full-attention layer of a :class:`FathomCache`: its K/V live in the Fathom store, not here.

    ``update`` returns the new K/V unchanged (the prompt, for the model's dense prefill; one token when
    decoding) and hands itself to the attention function, which appends them to the store and decodes.
    """

    is_sliding = False

    def __init__(self, decoding: _Decoding, layer_idx: int, slot: int):
        super().__init__()
        self.decoding, self.layer_idx, self.slot = decoding, layer_idx, slot
        self.length = 0  # positions seen (padded): what generate's cache positions and masks count

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Accepts every 5.x call form (``update(k, v)``, ``(k, v, cache_kwargs)``, ``(k, v, kwargs=...)``)."""
        if not self.decoding.capturing:
            implementation = self.decoding.config._attn_implementation
            if implementation != ATTENTION:
                raise ValueError(f"the model's attention implementation is {implementation!r}; FathomCache decodes "
                                 f"through {ATTENTION!r} (set by FathomCache(model, ...))")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.length += key_states.shape[-2]
        _handoff.layer = self
        return key_states, value_states

    def attend(self, module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
        """Prefill: the model's sdpa attention, then the prompt into the store. A later chunk (a conversation's next
        turn): dense over the store, causal within the chunk. Decode: append, sparse step."""
        scale = kwargs.get("scaling") or module.scaling
        unsupported = [name for name in ("softcap", "s_aux", "sliding_window") if kwargs.get(name) is not None]
        if unsupported:
            raise ValueError(f"Fathom's attention does not support {', '.join(unsupported)}")
        m = query.shape[2]
        if self.length == m:  # the prefill
            dense = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
            rows = self.decoding.prompt_rows(self.slot, _valid_keys(attention_mask, key))
            self.decoding.prefill(self.slot, _calibration_queries(query, rows[0]), key, value, scale)
            return dense
        if m > 1:
            valid = _valid_keys(None if attention_mask is None else attention_mask[..., -m:], key)  # the chunk's keys
            try:
                out = self.decoding.extend(self.slot, query, key, value, valid, scale)
            except ValueError:
                self.length -= m  # refused before the store changed: this layer is as before the call
                raise
            return out.to(query.dtype), None
        out = self.decoding.step(self.slot, query[:, :, 0], key[:, :, 0], value[:, :, 0], scale)
        return out.to(query.dtype)[:, None], None  # [B, 1, H·G, dv], as sdpa's output

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        raise NotImplementedError("a FathomCache is not reset: make a new one per conversation")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("FathomCache does not support beam search")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("FathomCache does not roll back tokens (assisted decoding)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.length:
            raise NotImplementedError("FathomCache does not repeat sessions once filled")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.length:
            raise NotImplementedError("FathomCache does not drop sessions once filled")


def _rows(valid: torch.Tensor) -> list[slice | torch.Tensor]:
    """Each batch row's non-pad positions of ``valid bool [B, n]``: a slice when they are one run (left or no
    padding), else their indices on the device. One read of ``valid`` on the host."""
    rows = []
    for row in valid.cpu().numpy():
        positions = np.flatnonzero(row)
        if len(positions) and positions[-1] - positions[0] + 1 != len(positions):
            rows.append(torch.as_tensor(positions, device=valid.device))
        else:
            rows.append(slice(int(positions[0]), int(positions[-1]) + 1) if len(positions) else slice(0, 0))
    return rows


def _count(rows: slice | torch.Tensor) -> int:
    """How many positions :func:`_rows` names for one batch row."""
    return rows.stop - rows.start if isinstance(rows, slice) else len(rows)


def _calibration_needs(settings: FathomSettings) -> set[str]:
    """What a calibration from the prompt computes for ``settings``' method (``fathom.cuda.calibration.NEEDS``)."""
    return methods.entry(settings.method).calibration_needs()


def _valid_keys(attention_mask: torch.Tensor | None, key: torch.Tensor) -> torch.Tensor:
    """bool ``[B, n]``: the prompt positions that are not padding (what the last query may attend to)."""
    B, n = key.shape[0], key.shape[2]
    if attention_mask is None:
        return torch.ones((B, n), dtype=torch.bool, device=key.device)
    last = attention_mask[:, 0, -1, :n].expand(B, n)
    return last if last.dtype == torch.bool else last == 0


def _calibration_queries(query: torch.Tensor, rows: slice | torch.Tensor) -> torch.Tensor:
    """Row 0's queries at its last :data:`CALIBRATION_QUERIES` non-pad positions ``rows``: ``[H·G, m, d]`` of
    ``query [B, H·G, n, d]`` (what a calibration or plan from the prompt reads)."""
    return query[0][:, rows][:, -CALIBRATION_QUERIES:]


def fathom_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, **kwargs):
    """The registered attention function: a :class:`FathomLayer`'s step, else transformers' sdpa attention."""
    layer, _handoff.layer = _handoff.layer, None
    if layer is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if layer.layer_idx != module.layer_idx:
        raise ValueError(f"attention of layer {module.layer_idx} follows the cache update of layer {layer.layer_idx}")
    return layer.attend(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(ATTENTION, fathom_attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)


@contextmanager
def attention_implementation(model, name: str, function):
    """Within the block ``model`` runs ``function`` as its attention (registered with transformers under ``name``,
    with sdpa's mask); its own implementation is restored after, also on an error."""
    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, sdpa_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


@dataclass(frozen=True)
class Prompt:
    """One dense prefill of a batch of prompts, to fill the FathomCaches of several methods without running it
    again (:func:`prefill`; ``FathomCache(model, ..., prompt=prompt)``).

    ``keys``, ``values``: per decoder layer ``[B, H, n, d]``; ``queries``: per full-attention layer row 0's
    calibration queries ``[H·G, m, d]`` (None for sliding-window layers); ``valid bool [B, n]``: the non-pad
    positions; ``scale``: the softmax scale; ``next_token int64 [B]``: the greedy token after each prompt.
    """

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    queries: tuple[torch.Tensor | None, ...]
    valid: torch.Tensor
    scale: float
    next_token: torch.Tensor


class _PromptRecorder:
    """The attention function of :func:`prefill`: the model's sdpa attention, recording what a FathomCache's
    prefill would record."""

    def __init__(self, layer_types: tuple[str, ...]):
        self.layer_types = layer_types
        self.keys, self.values, self.queries, self.valid, self.scales = {}, {}, {}, None, set()
        self.row0: slice | torch.Tensor | None = None  # batch row 0's non-pad positions

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        i = module.layer_idx
        self.keys[i], self.values[i] = key, value
        if self.layer_types[i] == "full_attention":
            if self.valid is None:
                self.valid = _valid_keys(attention_mask, key)
                self.row0 = _rows(self.valid)[0]  # one host read for the whole prefill
            self.queries[i] = _calibration_queries(query, self.row0)
            self.scales.add(kwargs.get("scaling") or module.scaling)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def prefill(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> Prompt:
    """Run the model's dense sdpa prefill over ``input_ids [B, n]`` (left-padded where ``attention_mask`` says)
    once, for FathomCaches of several methods to start from.

    A cache made with ``prompt=`` holds the prompt as if it had run this prefill itself; generate then continues
    from ``prompt.next_token`` (the greedy token the prefill's logits give), which it decodes as its first step:
    ``generate(cat([input_ids, next_token]), ..., max_new_tokens=N - 1)`` generates exactly what
    ``generate(input_ids, ..., max_new_tokens=N)`` with a fresh cache would (tested).
    """
    shape = _ModelShape.of(model)
    if model.config._attn_implementation not in ("sdpa", ATTENTION):
        raise ValueError(f"model must use sdpa attention, got {model.config._attn_implementation!r}")
    recorder = _PromptRecorder(shape.layer_types)
    positions = None
    if attention_mask is not None:  # as generate places left-padded rows: the first real token at position 0
        positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
    with attention_implementation(model, "fathom_prompt", recorder), torch.inference_mode():
        logits = model(input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False,
                       logits_to_keep=1).logits
    if len(recorder.scales) != 1:
        raise ValueError(f"layers use different softmax scales {recorder.scales}; FathomCache decodes with one")
    layers = range(len(shape.layer_types))
    return Prompt(tuple(recorder.keys[i] for i in layers), tuple(recorder.values[i] for i in layers),
                  tuple(recorder.queries.get(i) for i in layers), recorder.valid, recorder.scales.pop(),
                  logits[:, -1].argmax(dim=-1))


def _check_prompt(prompt: Prompt, shape: _ModelShape) -> None:
    """A :class:`Prompt` of another model is refused before the cache holds any of it."""
    if len(prompt.keys) != len(shape.layer_types):
        raise ValueError(f"prompt holds {len(prompt.keys)} layers, the model has {len(shape.layer_types)}")
    for i in shape.fathom_layers:
        B, H, n, d = prompt.keys[i].shape
        if (H, d) != (shape.kv_heads, shape.head_dim) or prompt.valid.shape != (B, n):
            raise ValueError(f"prompt layer {i} holds keys [B, H, n, d] = {[B, H, n, d]}, the model has "
                             f"H = {shape.kv_heads}, d = {shape.head_dim}")


class FathomCache(Cache):
    """A ``transformers.Cache`` that decodes every generated token with a Fathom method over the Fathom store.

    Args:
        model: a causal LM loaded the usual way, with sdpa attention (the cache switches it to ``"fathom"``,
            whose layers without a FathomCache still run sdpa, and switches it back when the last cache on it is
            closed or garbage collected).
        method: a name of :data:`fathom.methods.CATALOG` (design §7).
        budget: bits per token (fathom, fathom-rotated; fathom-plan's mean). For sparq, double-sparsity and
            loki, ``r·4.25`` bits for r channels (68 -> r = 16, 136 -> r = 32) unless ``r=`` is given.
            Not read by dense, oracle, thumbnail (2 planes of every channel) and landmark.
        k: top-k per query head; None: design §6's k by the longest prompt (``Selection.for_context``).
        prompt: a :func:`prefill` of this model: the cache starts holding it (one dense prefill shared by the
            caches of several methods); generate then continues from ``prompt.next_token``.
        **settings: ``r``, ``sink`` (4), ``local`` (32), ``variance`` ("store" | "calibration"; default the
            store basis' own: store σ² on raw channels, calibration σ² on the rotated store),
            ``plan`` (fathom-plan's budgets per full-attention layer), ``calibration`` (a ``.calibration.npz``
            path or a :class:`~fathom.calibration.Calibration`; without one, computed from the prompt when a
            method needs it), ``backend`` ("auto": offloaded when the model is on a CUDA device, else the
            NumPy "reference"), ``max_tokens`` (per session, offloaded; default the longest prompt plus
            :data:`RESERVE_TOKENS`, rounded up to a bucket, and grown when a session needs more), ``hbm_gb`` (HBM
            for the offloaded store's scales and top bit planes, GB; 0: all pinned in host memory), ``pool``
            (True: offloaded sessions go back to ``fathom.integrations.sessions.POOL`` when the cache is closed,
            and the next cache of the same shape, method and capacity starts from them).

    A cache holds one conversation per batch row: a later ``generate`` with the conversation so far (the previous
    output and the new tokens) continues it — the new tokens attend densely over what the cache holds and causally
    among themselves, then decoding goes on. Sliding-window layers keep the model's own dense attention.
    :meth:`close` (also run when the cache is garbage collected) hands the offloaded memory back.
    """

    def __init__(self, model, method: str = "fathom", budget: float = 48, k: int | None = None,
                 prompt: Prompt | None = None, **settings):
        unknown = sorted(set(settings) - set(SETTINGS))
        if unknown:
            raise ValueError(f"unknown settings {', '.join(unknown)}; known: {', '.join(SETTINGS)}")
        calibration = settings.pop("calibration", None)
        if settings.get("plan") is not None:
            settings["plan"] = tuple(settings["plan"])
        self.settings = FathomSettings(method, budget, k, **settings)
        shape = _ModelShape.of(model)
        implementation = model.config._attn_implementation
        if implementation not in ("sdpa", ATTENTION):
            raise ValueError(f"model must use sdpa attention (attn_implementation='sdpa'), got {implementation!r}")
        if methods.entry(method).budget == "channels":
            self.settings.channels(shape.head_dim)
        if self.settings.plan is not None and len(self.settings.plan) != len(shape.fathom_layers):
            raise ValueError(f"plan must have one budget per full-attention layer ({len(shape.fathom_layers)}), "
                             f"got {len(self.settings.plan)}")
        if self.settings.backend == "offloaded":
            from fathom.cuda.interop import DEVICE
            if model.device.type != DEVICE.type:
                raise ValueError(f"backend 'offloaded' needs the model on {DEVICE.type}, it is on {model.device}")
        if self.settings.hbm_gb > 0 and self.settings.backend == "auto" and model.device.type != "cuda":
            raise ValueError(f"hbm_gb places the offloaded store's top planes in HBM: the model is on {model.device}, "
                             "where the cache decodes on the reference backend (pass backend='offloaded' under the "
                             "CUDA simulator)")
        calibration = _load_calibration(calibration, shape)
        self.decoding = _Decoding(self.settings, shape, calibration, model.config)
        slots = {layer: slot for slot, layer in enumerate(shape.fathom_layers)}
        layers = [FathomLayer(self.decoding, i, slots[i]) if t == "full_attention"
                  else DynamicSlidingWindowLayer(sliding_window=shape.sliding_window)
                  for i, t in enumerate(shape.layer_types)]
        if prompt is not None:
            _check_prompt(prompt, shape)
        super().__init__(layers=layers)
        _switch(model)
        self._release = weakref.finalize(self, _release, self.decoding, weakref.ref(model))
        if prompt is not None:
            self._fill(prompt)

    def _fill(self, prompt: Prompt) -> None:
        """Hold ``prompt`` as this cache's own prefill would have left it."""
        for layer, k, v, queries in zip(self.layers, prompt.keys, prompt.values, prompt.queries, strict=True):
            if isinstance(layer, FathomLayer):
                layer.lazy_initialization(k, v)
                layer.length = k.shape[2]
                self.decoding.prompt_rows(layer.slot, prompt.valid)
                self.decoding.prefill(layer.slot, queries, k, v, prompt.scale)
            else:
                layer.update(k, v)

    @property
    def selection(self) -> Selection | None:
        """The selection protocol in use (None until the prefill fixes k)."""
        return self.decoding.selection

    @property
    def method(self) -> Method | None:
        """The method decoded with (fathom-plan: with its per-layer budgets); None until the sessions open."""
        return self.decoding.method

    @property
    def calibration(self) -> Calibration | None:
        """The calibration in use: the one given, or the prompt's once computed (None if the method needs none)."""
        return self.decoding.calibration

    def lengths(self) -> np.ndarray:
        """Tokens each session holds in the store (int64 ``[B]``; pad positions are not held)."""
        if self.decoding.sessions is None:
            raise ValueError("the cache holds no sessions before its prefill")
        return self.decoding.sessions.lengths(0)

    def close(self) -> None:
        """Hand the sessions' memory back (to the pool, see ``pool``) and, if no other FathomCache uses the model,
        restore its attention implementation. The cache cannot decode afterwards."""
        self._release()


# model -> [its attention implementation before the first FathomCache, FathomCaches open on it]
_SWITCHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _switch(model) -> None:
    """Run ``model``'s attention through :data:`ATTENTION` while at least one FathomCache is open on it."""
    entry = _SWITCHED.setdefault(model, [model.config._attn_implementation, 0])
    entry[1] += 1
    model.set_attn_implementation(ATTENTION)


def _release(decoding: _Decoding, model_ref) -> None:
    """A FathomCache's end (close or garbage collection): its sessions handed back, the model switched back to its
    own attention by the last cache open on it."""
    decoding.close_sessions()
    model = model_ref()
    entry = _SWITCHED.get(model) if model is not None else None
    if entry is None:
        return
    entry[1] -= 1
    if entry[1] == 0:
        del _SWITCHED[model]
        if model.config._attn_implementation == ATTENTION:
            model.set_attn_implementation(entry[0])
