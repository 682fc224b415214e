"""The prompt: one dense prefill shared by the FathomCaches of several methods (:class:`Prompt`, :func:`prefill`),
and what every prefill reads off it (each batch row's non-pad positions, row 0's calibration queries)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fathom._checks import is_integer
from fathom.integrations.attention import ATTENTION, attention_implementation, prompt_sdpa
from fathom.integrations.settings import ModelShape

CALIBRATION_QUERIES = 128  # prompt queries per layer a calibration from the prompt uses (as the fidelity captures)


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

    def continued(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompts ``[B, n]`` grown by :attr:`next_token` and their mask (ones where none is given), one longer:
        what ``generate`` takes to continue a cache made with ``prompt=`` (it decodes that token first)."""
        token = self.next_token[:, None].to(input_ids.device)
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        return torch.cat([input_ids, token], 1), torch.cat([mask, torch.ones_like(token, dtype=mask.dtype)], 1)


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
                self.valid = valid_keys(attention_mask, key)
                self.row0 = nonpad_positions(self.valid)[0]  # one host read for the whole prefill
            self.queries[i] = calibration_queries(query, self.row0)
            self.scales.add(kwargs.get("scaling") or module.scaling)
        return prompt_sdpa(module, query, key, value, attention_mask, **kwargs)


def prefill(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
            rows_per_forward: int | None = None) -> Prompt:
    """Run the model's dense sdpa prefill over ``input_ids [B, n]`` (left-padded where ``attention_mask`` says)
    once, for FathomCaches of several methods to start from.

    A cache made with ``prompt=`` holds the prompt as if it had run this prefill itself; generate then continues
    from ``prompt.next_token`` (the greedy token the prefill's logits give), which it decodes as its first step:
    ``generate(cat([input_ids, next_token]), ..., max_new_tokens=N - 1)`` generates exactly what
    ``generate(input_ids, ..., max_new_tokens=N)`` with a fresh cache would (tested).

    ``rows_per_forward`` (default: every row in one forward) runs the batch through the model that many rows at a
    time. A padded batch's sdpa prefill materialises its attention mask, ``B·n²`` bytes and a floating copy (51 GiB
    at 13 rows of 32k, 137 GB of booleans at 8 of 128k), where a group of rows without padding needs none: each
    group runs without the left padding all its rows share, and its keys and values are placed back after it (zeros
    there; ``valid`` marks every padded position, as the one forward's does). Each row's keys, values, queries and
    next token are its own prefill's (tested equal to the one forward's, up to the order a different batch shape
    may sum in).

    Example::

        prompt = prefill(model, batch.input_ids, batch.attention_mask, rows_per_forward=1)  # long ragged rows
        cache = FathomCache(model, method="fathom", budget=48, prompt=prompt)
    """
    _check_prompt_inputs(input_ids, attention_mask)
    shape = ModelShape.of(model)
    if model.config._attn_implementation not in ("sdpa", ATTENTION):
        raise ValueError(f"model must use sdpa attention, got {model.config._attn_implementation!r}")
    if rows_per_forward is not None and (not is_integer(rows_per_forward) or rows_per_forward < 1):
        raise ValueError(f"rows_per_forward must be an integer >= 1 or None, got {rows_per_forward!r}")
    rows = input_ids.shape[0]
    if rows_per_forward is None or rows_per_forward >= rows:
        return _prefill(model, shape, input_ids, attention_mask)
    joined = None
    for start in range(0, rows, rows_per_forward):
        ids = input_ids[start:start + rows_per_forward]
        mask = None if attention_mask is None else attention_mask[start:start + rows_per_forward]
        shared_pad = 0
        if mask is not None:  # the leading positions every row of the group pads (one host read per group)
            real = torch.nonzero(mask.any(0)).flatten()
            shared_pad = int(real[0]) if len(real) else 0
            ids, mask = ids[:, shared_pad:], mask[:, shared_pad:]
        group = _prefill(model, shape, ids, mask)
        joined = joined or _JoinedPrompt(group, rows, input_ids.shape[1])
        joined.place(group, start, shared_pad)
        del group  # its keys and values now live in the joined prompt's: one group's at a time beside them
    return joined.prompt()


def _check_prompt_inputs(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
    """Refuse what :func:`prefill` cannot hold before the model runs: ids that are not ``[B, n]`` integers, a mask of
    another shape, and a row that is not left-padded (its next token would be read at a pad position) or holds no
    real token. One read of the mask on the host."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2 or input_ids.shape[1] == 0 \
            or input_ids.dtype.is_floating_point:
        raise ValueError(f"input_ids must be integer token ids [B, n] with n >= 1, got "
                         f"{getattr(input_ids, 'shape', type(input_ids).__name__)}")
    if attention_mask is None:
        return
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask must have input_ids' shape {tuple(input_ids.shape)}, got "
                         f"{getattr(attention_mask, 'shape', type(attention_mask).__name__)}")
    mask = attention_mask.detach().to("cpu", torch.int64).numpy()
    if not np.isin(mask, (0, 1)).all():
        raise ValueError("attention_mask must hold 0 (padding) and 1 (real tokens) only")
    empty = np.flatnonzero(mask.sum(1) == 0)
    if len(empty):
        raise ValueError(f"attention_mask row {empty[0]} holds no real token")
    right = np.flatnonzero((np.diff(mask, axis=1) < 0).any(1))
    if len(right):
        raise ValueError(f"attention_mask row {right[0]} is not left-padded (a 0 after a 1): prefill reads each "
                         "row's next token at its last position")


class _JoinedPrompt:
    """The :class:`Prompt` of a batch prefilled in row groups: every layer's keys and values (and ``valid``)
    allocated once for all rows, each group's copied in at its rows and placed after the padding it left out
    (zeros there, ``valid`` False); row 0's calibration queries are the first group's."""

    def __init__(self, first: Prompt, rows: int, n: int):
        def empty(t):
            return torch.zeros((rows, t.shape[1], n, t.shape[3]), dtype=t.dtype, device=t.device)

        self.keys, self.values = [empty(k) for k in first.keys], [empty(v) for v in first.values]
        self.valid = torch.zeros((rows, n), dtype=torch.bool, device=first.valid.device)
        self.queries, self.scale, self.next_tokens = first.queries, first.scale, []

    def place(self, group: Prompt, start: int, shared_pad: int) -> None:
        if group.scale != self.scale:
            raise ValueError(f"row groups decode with different softmax scales {group.scale} and {self.scale}")
        stop = start + group.valid.shape[0]
        for joined, part in zip(self.keys + self.values, group.keys + group.values):
            joined[start:stop, :, shared_pad:] = part
        self.valid[start:stop, shared_pad:] = group.valid
        self.next_tokens.append(group.next_token)

    def prompt(self) -> Prompt:
        return Prompt(tuple(self.keys), tuple(self.values), self.queries, self.valid, self.scale,
                      torch.cat(self.next_tokens))


def _prefill(model, shape: ModelShape, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> Prompt:
    """:func:`prefill` of one forward over every row of ``input_ids``."""
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


def check_prompt(prompt: Prompt, shape: ModelShape) -> None:
    """A :class:`Prompt` of another model is refused before the cache holds any of it."""
    if len(prompt.keys) != len(shape.layer_types):
        raise ValueError(f"prompt holds {len(prompt.keys)} layers, the model has {len(shape.layer_types)}")
    for i in shape.fathom_layers:
        B, H, n, d = prompt.keys[i].shape
        if (H, d) != (shape.kv_heads, shape.head_dim) or prompt.valid.shape != (B, n):
            raise ValueError(f"prompt layer {i} holds keys [B, H, n, d] = {[B, H, n, d]}, the model has "
                             f"H = {shape.kv_heads}, d = {shape.head_dim}")


def nonpad_positions(valid: torch.Tensor) -> list[slice | torch.Tensor]:
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


def count_positions(rows: slice | torch.Tensor) -> int:
    """How many positions :func:`nonpad_positions` names for one batch row."""
    return rows.stop - rows.start if isinstance(rows, slice) else len(rows)


def valid_keys(attention_mask: torch.Tensor | None, key: torch.Tensor) -> torch.Tensor:
    """bool ``[B, n]``: the prompt positions that are not padding (what the last query may attend to)."""
    B, n = key.shape[0], key.shape[2]
    if attention_mask is None:
        return torch.ones((B, n), dtype=torch.bool, device=key.device)
    last = attention_mask[:, 0, -1, :n].expand(B, n)
    return last if last.dtype == torch.bool else last == 0


def calibration_queries(query: torch.Tensor, rows: slice | torch.Tensor) -> torch.Tensor:
    """Row 0's queries at its last :data:`CALIBRATION_QUERIES` non-pad positions ``rows``: ``[H·G, m, d]`` of
    ``query [B, H·G, n, d]`` (what a calibration or plan from the prompt reads)."""
    return query[0][:, rows][:, -CALIBRATION_QUERIES:].clone()  # a view would keep the whole query alive
