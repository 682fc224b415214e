"""The ``"fathom"`` attention function registered with transformers, and switching a model's attention
implementation to it and back.

Importing this module registers :func:`fathom_attention` under :data:`ATTENTION` with ``AttentionInterface`` (and
sdpa's mask function with ``AttentionMaskInterface``), once. A :class:`~fathom.integrations.transformers.FathomLayer`'s
``update`` hands itself to the attention call that follows it on the same thread (:class:`_Handoff`); any other layer
runs transformers' sdpa attention. A prompt's dense attention (a prefill's) is :func:`prompt_sdpa`.
"""

from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

if TYPE_CHECKING:
    from fathom.integrations.transformers import FathomLayer

ATTENTION = "fathom"


class _Handoff(threading.local):
    """The layer whose ``update`` just ran: its attention call, next on the same thread, decodes with it."""

    layer: FathomLayer | None = None


handoff = _Handoff()


def fathom_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, **kwargs):
    """The registered attention function: a :class:`FathomLayer`'s step, else transformers' sdpa attention."""
    layer, handoff.layer = handoff.layer, None
    if layer is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if layer.layer_idx != module.layer_idx:
        raise ValueError(f"attention of layer {module.layer_idx} follows the cache update of layer {layer.layer_idx}")
    return layer.attend(module, query, key, value, attention_mask, **kwargs)


def prompt_sdpa(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
    """A prompt's dense attention: transformers' sdpa attention, except a float32 layer with grouped K/V heads
    and no mask (a prompt without padding), whose K/V are repeated to the query heads for a causal sdpa.

    ``sdpa_attention_forward`` passes ``enable_gqa`` there, which on a GPU only the math kernel serves in float32,
    materialising ``B·H·G·n²`` float32 scores: 47 GiB a layer for one 32k prompt of Qwen2.5-Coder-1.5B (RULER's
    32k prefill ran out of the H200's memory so). With equal heads the memory-efficient kernel runs it in O(n)
    memory. ``query [B, H·G, n, d]``, ``key``, ``value [B, H, n, d]`` -> (``[B, n, H·G, d]``, None), as
    ``sdpa_attention_forward`` returns."""
    if (attention_mask is not None or query.dtype != torch.float32 or key.shape[1] == query.shape[1]
            or key.shape[2] != query.shape[2]):  # sdpa's is_causal aligns top-left: only a whole prompt is causal so
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    groups = query.shape[1] // key.shape[1]
    scaling = kwargs.get("scaling")
    output = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1),
        dropout_p=kwargs.get("dropout", 0.0), scale=scaling if scaling is not None else module.scaling,
        is_causal=query.shape[2] > 1 and getattr(module, "is_causal", True))
    return output.transpose(1, 2).contiguous(), None


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


# model -> [its attention implementation before the first FathomCache, FathomCaches open on it]
_SWITCHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def switch_to_fathom(model) -> None:
    """Run ``model``'s attention through :data:`ATTENTION` while at least one FathomCache is open on it."""
    entry = _SWITCHED.setdefault(model, [model.config._attn_implementation, 0])
    entry[1] += 1
    model.set_attn_implementation(ATTENTION)


def switch_back(model) -> None:
    """One FathomCache fewer open on ``model`` (None: the model was garbage collected): the last one switches the
    model back to its own attention implementation."""
    entry = _SWITCHED.get(model) if model is not None else None
    if entry is None:
        return
    entry[1] -= 1
    if entry[1] == 0:
        del _SWITCHED[model]
        if model.config._attn_implementation == ATTENTION:
            model.set_attn_implementation(entry[0])
