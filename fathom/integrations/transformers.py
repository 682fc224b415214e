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
double-sparsity: its channels; ``variance="calibration"``: σ²; fathom-mixed: the basis and each KV head's
choice of store, which only a given calibration holds) take
``calibration=`` — a ``.calibration.npz`` written by ``python -m bench fidelity``
or a :class:`~fathom.calibration.Calibration` (e.g. ``calibrate(capture(model,
ids))`` on a calibration text, with :func:`bench.capture.capture`). Without one
it is computed **from the prompt itself** (batch row 0, its last 128 queries), layer by
layer as the prefill passes it, in torch on the model's device and only what the method
reads (:mod:`fathom.cuda.calibration`). fathom-plan's per-layer budgets are planned on
the prompt too (``plan=`` gives them): its K/V then wait for the first decode step.

This module holds the cache and its layers and re-exports the rest (``__all__``), which lives beside it:
:mod:`fathom.integrations.settings` (the settings, the model's attention shapes, the calibration given),
:mod:`fathom.integrations.attention` (the registered attention function; switching a model to it and back),
:mod:`fathom.integrations.prefill` (:class:`Prompt`, :func:`prefill`; what every prefill reads off the prompt) and
:mod:`fathom.integrations.decoding` (the state the layers of one cache share).
"""

from __future__ import annotations

import functools
import weakref

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicSlidingWindowLayer

from fathom import methods
from fathom.calibration import Calibration
from fathom.integrations.attention import (ATTENTION, handoff, switch_to_fathom, switch_back, attention_implementation,
                                           fathom_attention, prompt_sdpa)
from fathom.integrations.decoding import Decoding
from fathom.integrations.prefill import (CALIBRATION_QUERIES, Prompt, calibration_queries, check_prompt,
                                         valid_keys, prefill)
from fathom.integrations.sessions import LayerStats
from fathom.integrations.settings import (BACKENDS, RESERVE_TOKENS, SETTINGS, FathomSettings, load_calibration,
                                          ModelShape)
from fathom.methods import Method
from fathom.selection import Selection

__all__ = [
    "ATTENTION",
    "BACKENDS",
    "CALIBRATION_QUERIES",
    "RESERVE_TOKENS",
    "SETTINGS",
    "FathomCache",
    "FathomLayer",
    "FathomSettings",
    "Prompt",
    "attention_implementation",
    "fathom_attention",
    "prefill",
]


class FathomLayer(CacheLayerMixin):
    """One full-attention layer of a :class:`FathomCache`: its K/V live in the Fathom store, not here.

    ``update`` returns the new K/V unchanged (the prompt, for the model's dense prefill; one token when
    decoding) and hands itself to the attention function, which appends them to the store and decodes.
    """

    is_sliding = False

    def __init__(self, decoding: Decoding, layer_idx: int, slot: int):
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
        shape = self.decoding.shape
        if key_states.shape[1] != shape.kv_heads:  # a cache of another model, or a TP plan that leaves heads whole
            raise ValueError(f"key_states must have the {shape.kv_heads} KV heads the cache was made for (the "
                             f"model's {shape.kv_heads * shape.ranks} over {shape.ranks} tensor-parallel ranks), "
                             f"got {key_states.shape[1]}")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.length += key_states.shape[-2]
        handoff.layer = self
        return key_states, value_states

    def attend(self, module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
        """Prefill: the model's sdpa attention, then the prompt into the store. A later chunk (a conversation's next
        turn): dense over the store, causal within the chunk. Decode: append, sparse step. A refusal (ValueError)
        leaves the cache as before the forward (:meth:`Decoding.forward_refused`)."""
        m = query.shape[2]
        prefill = self.length == m
        try:
            out = self._attend(module, query, key, value, attention_mask, prefill, **kwargs)
        except ValueError:
            if not self.decoding.forward_refused(self.slot, prefill):  # not within FathomCache.update's forward
                self.length -= m
            raise
        if self.slot == len(self.decoding.shape.fathom_layers) - 1:  # no later layer refuses the forward
            self.decoding.undo_forward = None
        return out

    def _attend(self, module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, prefill: bool, **kwargs) -> tuple[torch.Tensor, None]:
        scale = kwargs.get("scaling") or module.scaling
        unsupported = [name for name in ("softcap", "s_aux", "sliding_window") if kwargs.get(name) is not None]
        if unsupported:
            raise ValueError(f"Fathom's attention does not support {', '.join(unsupported)}")
        m = query.shape[2]
        if prefill:
            dense = prompt_sdpa(module, query, key, value, attention_mask, **kwargs)
            rows = self.decoding.prompt_rows(self.slot, valid_keys(attention_mask, key))
            self.decoding.prefill(self.slot, calibration_queries(query, rows[0]), key, value, scale)
            return dense
        if m > 1:
            valid = valid_keys(None if attention_mask is None else attention_mask[..., -m:], key)  # the chunk's keys
            out = self.decoding.extend(self.slot, query, key, value, valid, scale)
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


class FathomCache(Cache):
    """A ``transformers.Cache`` that decodes every generated token with a Fathom method over the Fathom store.

    Args:
        model: a causal LM loaded the usual way, with sdpa attention (the cache switches it to ``"fathom"``,
            whose layers without a FathomCache still run sdpa, and switches it back when the last cache on it is
            closed or garbage collected).
        method: a name of :data:`fathom.methods.CATALOG` (design §7).
        budget: bits per token (fathom, fathom-rotated, fathom-mixed; fathom-plan's mean); None: 48. For sparq,
            double-sparsity and loki, ``r·4.25`` bits for r channels (68 -> r = 16, 136 -> r = 32), or ``r=``:
            one of the two must be given. Not read by dense, oracle, thumbnail (2 planes of every channel) and
            landmark.
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
            for the offloaded store's scales and top bit planes, GB; 0: all pinned in host memory),
            ``row_cache_rows`` (offloaded: HBM slots per session, layer and KV head for the rows steps selected
            recently, so only the misses cross the link; 0: none), ``pool``
            (True: offloaded sessions go back to ``fathom.integrations.sessions.POOL`` when the cache is closed,
            and the next cache of the same shape, method and capacity starts from them).

    A cache holds one conversation per batch row: a later ``generate`` with the conversation so far (the previous
    output and the new tokens) continues it — the new tokens attend densely over what the cache holds and causally
    among themselves, then decoding goes on. Sliding-window layers keep the model's own dense attention.
    :meth:`close` (also run when the cache is garbage collected) hands the offloaded memory back.
    """

    def __init__(self, model, method: str = "fathom", budget: float | None = None, k: int | None = None,
                 prompt: Prompt | None = None, **settings):
        unknown = sorted(set(settings) - set(SETTINGS))
        if unknown:
            raise ValueError(f"unknown settings {', '.join(unknown)}; known: {', '.join(SETTINGS)}")
        calibration = settings.pop("calibration", None)
        if settings.get("plan") is not None:
            if isinstance(settings["plan"], (str, bytes)) or not hasattr(settings["plan"], "__iter__"):
                raise ValueError(f"plan must be a sequence of budgets, one per full-attention layer, got "
                                 f"{settings['plan']!r}")
            settings["plan"] = tuple(settings["plan"])
        if prompt is not None and not isinstance(prompt, Prompt):
            raise ValueError(f"prompt must be a Prompt made by fathom.integrations.transformers.prefill(model, ...), "
                             f"got {type(prompt).__name__}")
        self.settings = FathomSettings(method, budget, k, **settings)
        shape = ModelShape.of(model)
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
        for name, value in (("hbm_gb", self.settings.hbm_gb), ("row_cache_rows", self.settings.row_cache_rows)):
            if value and self.settings.backend == "auto" and model.device.type != "cuda":
                raise ValueError(f"{name} places offloaded data in HBM: the model is on {model.device}, where the "
                                 "cache decodes on the reference backend (pass backend='offloaded' under the CUDA "
                                 "simulator)")
        calibration = load_calibration(calibration, shape)
        if methods.entry(method).basis == methods.PER_HEAD and (calibration is None or calibration.head_basis is None):
            raise ValueError(f"method {method!r} scans the store each (layer, KV head) chose on calibration text: pass "
                             "calibration= with a per-head basis (a .calibration.npz written by python -m bench "
                             "fidelity); a prompt cannot make that choice")
        levels = self.settings.reads_levels
        if levels and calibration is None:
            raise ValueError("levels='calibrated' reads the reconstruction tables of the calibration given: pass "
                             "calibration= (a .calibration.npz written by python -m bench fidelity holds them); a "
                             "prompt's calibration has none")
        if (self.settings.gains == "calibrated" or levels) and calibration is not None:  # here, not after the prefill
            plan = self.settings.plan  # fathom-plan's budgets from the prompt: any stand in (the check reads bases)
            if methods.entry(method).per_layer and plan is None:
                plan = (self.settings.budget,) * len(shape.fathom_layers)
            method_read = self.settings.method_at(shape.head_dim, plan)
            for slot in range(len(shape.fathom_layers)):
                LayerStats.of(calibration, slot, levels).check_for(method_read, slot)
        self.decoding = Decoding(self.settings, shape, calibration, model.config)
        slots = {layer: slot for slot, layer in enumerate(shape.fathom_layers)}
        layers = [FathomLayer(self.decoding, i, slots[i]) if t == "full_attention"
                  else DynamicSlidingWindowLayer(sliding_window=shape.sliding_window)
                  for i, t in enumerate(shape.layer_types)]
        if prompt is not None:
            check_prompt(prompt, shape)
        super().__init__(layers=layers)
        switch_to_fathom(model)
        self._release = weakref.finalize(self, _release, self.decoding, weakref.ref(model))
        if prompt is not None:
            self._fill(prompt)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' ``Cache.update``, with a forward checked before its first layer holds anything."""
        if layer_idx == 0 and not self.decoding.capturing:
            self._begin_forward(key_states)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _begin_forward(self, key_states: torch.Tensor) -> None:
        """Before any layer holds the forward's tokens: a closed cache, one a refused forward left unable to go on
        and a batch other than the cache's conversations are refused; what every layer holds is kept, so that a
        FathomLayer's refusal later in the forward leaves the whole cache as it was (sliding-window layers
        included; :meth:`Decoding.forward_refused`)."""
        if self.decoding.closed:
            raise ValueError("the FathomCache was closed")
        if self.decoding.broken is not None:
            raise ValueError(self.decoding.broken)
        batch = self.decoding.batch
        if batch is not None and key_states.shape[0] != batch:
            raise ValueError(f"the input must hold the cache's {batch} conversations, one per batch row, got "
                             f"{key_states.shape[0]} rows")
        held = [dict(vars(layer)) for layer in self.layers]  # shallow: updates replace tensors
        self.decoding.undo_forward = functools.partial(_restore, self.layers, held)

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


def _restore(layers, held: list[dict]) -> None:
    """Every layer's state as ``held`` recorded it (:meth:`FathomCache._begin_forward`)."""
    for layer, state in zip(layers, held, strict=True):
        vars(layer).clear()
        vars(layer).update(state)


def _release(decoding: Decoding, model_ref) -> None:
    """A FathomCache's end (close or garbage collection): its sessions handed back, the model switched back to its
    own attention by the last cache open on it."""
    decoding.close_sessions()
    switch_back(model_ref())
