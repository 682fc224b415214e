"""The decoding state the layers of one FathomCache share (:class:`Decoding`): its sessions in the store, the
prefill's bookkeeping, the calibration and plan from the prompt."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import numpy as np
import torch

from fathom import methods
from fathom.calibration import Calibration
from fathom.capture import Capture
from fathom.cuda.calibration import LayerCalibration, calibrate_layer, stack
from fathom.fidelity import plan_layers
from fathom.integrations.prefill import count_positions, nonpad_positions
from fathom.integrations.sessions import (POOL, LayerStats, OffloadedSessions, ReferenceSessions, SessionShape,
                                          capacity)
from fathom.integrations.settings import RESERVE_TOKENS, FathomSettings, ModelShape
from fathom.methods import Method
from fathom.quantize import BLOCK
from fathom.selection import Selection


@contextlib.contextmanager
def ordinary_tensors():
    """Inside, inference mode is off (autograd stays off): what the sessions make or write outlives the caller's
    mode. A tensor made under ``torch.inference_mode`` is an inference tensor, which nothing outside inference mode
    may write: not generate's later ``no_grad`` steps, nor the next cache that takes the pooled sessions.
    Also a decorator (``@ordinary_tensors()``), as every ``contextlib.contextmanager`` is."""
    if not torch.is_inference_mode_enabled():
        yield
        return
    with torch.inference_mode(False), torch.no_grad():
        yield


class Decoding:
    """What the layers of one FathomCache share: settings, the sessions once opened, the prefill's bookkeeping.

    The sessions open at the first layer of the prefill, when everything they need is known (batch, k, scale,
    capacity); a calibration from the prompt is computed layer by layer on the keys' device as the prefill passes
    each layer (:func:`fathom.cuda.calibration.calibrate_layer`, only what the method reads), before the layer's
    keys enter the store. fathom-plan with budgets from the prompt needs every layer first: its prompt waits until
    the first decode step.
    """

    def __init__(self, settings: FathomSettings, shape: ModelShape, calibration: Calibration | None, config):
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
        self.capturing = False  # inside a whole-token CUDA graph capture (fathom.integrations.token_graph)
        self.closed = False
        self.undo_forward = None  # during a forward: restores every layer as before it (FathomCache._begin_forward)
        self.broken: str | None = None  # why the cache cannot go on: a refused forward left tokens in the store

    @property
    def batch(self) -> int | None:
        """The conversations the cache holds, one per batch row, once its prefill fixed them (None before)."""
        if self.sessions is not None:
            return self.sessions.shape.sessions
        return None if self.rows is None else len(self.rows)

    @property
    def calibration(self) -> Calibration | None:
        """The calibration given, or the one computed from the prompt (None before it is)."""
        if self.given_calibration is not None or len(self.layer_calibrations) < len(self.shape.fathom_layers):
            return self.given_calibration
        layers = [self.layer_calibrations[slot] for slot in range(len(self.shape.fathom_layers))]
        H, rank = self.shape.kv_heads, self.shape.rank
        return stack(layers, {"text": "prompt", "layers": self.shape.fathom_layers,
                              "kv_heads": [rank * H, (rank + 1) * H]})

    def prompt_rows(self, slot: int, valid: torch.Tensor) -> list[slice | torch.Tensor]:
        """The non-pad positions of each batch row of the prompt (``valid bool [B, n]``), read on the host once per
        prefill, at its first layer."""
        if slot == 0 or self.rows is None:
            rows = nonpad_positions(valid)
            empty = [row for row, positions in enumerate(rows) if count_positions(positions) == 0]
            if empty:
                raise ValueError(f"attention_mask row {empty[0]} holds no real token: each batch row is a "
                                 "conversation the cache holds")
            self.rows = rows
        return self.rows

    @ordinary_tensors()
    def prefill(self, slot: int, queries: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> None:
        """Record the prompt of one layer: ``k, v [B, H, n, d]`` at the positions :meth:`prompt_rows` gave, and
        ``queries [H·G, m, d]``, row 0's calibration queries (:func:`calibration_queries`)."""
        self._check_scale(scale)
        if self.calibrate_from_prompt and self.settings.gains == "calibrated" and \
                (prompt := count_positions(self.rows[0])) < BLOCK:
            raise ValueError(f"gains='calibrated' measures the plane gains on the prompt's sealed {BLOCK}-token "
                             f"blocks: row 0's prompt holds {prompt} tokens; pass a calibration= instead")
        if self.selection is None:
            longest = max(count_positions(r) for r in self.rows)
            k_top = self.settings.k if self.settings.k is not None else Selection.for_context(longest).k
            self.selection = Selection(k=k_top, sink=self.settings.sink, local=self.settings.local)
        if self.calibrate_from_prompt:
            H, G, d = self.shape.kv_heads, self.shape.group_size, self.shape.head_dim
            per_kv_head = queries.reshape(H, G, -1, d).transpose(1, 2).reshape(H, -1, d)
            self.layer_calibrations[slot] = calibrate_layer(k[0][:, self.rows[0]], per_kv_head,
                                                            self.settings.calibration_needs())
        if self.plan_from_prompt:
            H, G, d = self.shape.kv_heads, self.shape.group_size, self.shape.head_dim
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

    @ordinary_tensors()
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

    @ordinary_tensors()
    def step(self, slot: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """One decoded token of every session: ``q [B, H·G, d]``, ``k, v [B, H, d]`` -> float32 ``[B, H·G, d]``."""
        if self.capturing:  # no host work: it would not be replayed (the graph's owner checks once per token)
            return self.sessions.enqueue_step(slot, q, k, v)
        self._check_scale(scale)
        if self.sessions is None:
            self.open_planned(k.shape[0], k.device)
        self.calibrate_waiting()
        if slot == 0 and isinstance(self.sessions, OffloadedSessions):
            self.sessions.begin_token()
        return self.sessions.step(slot, q, k, v)

    def close_sessions(self) -> None:
        """Hand the sessions back (to the pool when they are offloaded and pooled) or release them; the cache
        cannot decode afterwards."""
        self._hand_back_sessions()
        self.closed = True

    def forward_refused(self, slot: int, prefill: bool) -> bool:
        """A ValueError ends the forward at full-attention layer ``slot``: every layer restored as before it
        (False: the forward did not begin at :meth:`FathomCache.update`, nothing to restore). A refused prefill
        leaves nothing behind (the sessions it opened are handed back). A later forward refused after earlier
        layers' stores took its tokens cannot be undone (the store only grows): the cache refuses to go on rather
        than decode over layers holding different tokens."""
        if prefill:
            self._forget_prefill()
        elif not self._store_consistent():
            self.broken = (f"a forward refused at full-attention layer {self.shape.fathom_layers[slot]} left its "
                           "tokens in the store of the layers before it: this FathomCache cannot go on, make a new one")
        undo, self.undo_forward = self.undo_forward, None
        if undo is None:
            return False
        undo()
        return True

    def _store_consistent(self) -> bool:
        """Whether every layer's store holds the same tokens per session, as every completed forward leaves it."""
        if self.sessions is None:
            return True
        held = [self.sessions.lengths(slot) for slot in range(len(self.shape.fathom_layers))]
        return all(np.array_equal(held[0], lengths) for lengths in held[1:])

    def _forget_prefill(self) -> None:
        """The bookkeeping as before the prefill; the sessions it opened (partly filled) handed back."""
        self._hand_back_sessions()
        self.selection, self.method, self.scale, self.rows = None, None, None, None
        self.layer_calibrations, self.uncalibrated, self.waiting, self.prompt = {}, [], {}, {}

    @ordinary_tensors()
    def _hand_back_sessions(self) -> None:
        if self.sessions is not None:
            if isinstance(self.sessions, OffloadedSessions) and self.settings.pool and not self.sessions.cache.closed:
                try:
                    self.sessions.cache.check()
                    POOL.give(self.sessions)
                except ValueError:  # a kernel flagged bad input: the memory is released, not reused
                    self.sessions.close()
            else:
                self.sessions.close()
        self.sessions = None

    def _check_scale(self, scale: float) -> None:
        if self.scale is None:
            self.scale = scale
        elif scale != self.scale:
            raise ValueError(f"layers use different softmax scales ({self.scale} and {scale}); FathomCache decodes "
                             "with one")

    def _append(self, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        for session, rows in enumerate(self.rows):
            self.sessions.append(slot, session, k[session][:, rows], v[session][:, rows])

    @ordinary_tensors()
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
                    self.sessions.calibrate(slot, LayerStats.of(self.given_calibration, slot,
                                                                self.settings.reads_levels))

    def _open(self, batch: int, device: torch.device, plan: tuple[float, ...] | None = None) -> None:
        if self.closed:
            raise ValueError("the FathomCache was closed")
        if self.sessions is not None:
            return
        s = self.shape
        offloaded = self.settings.backend == "offloaded" or (self.settings.backend == "auto" and device.type == "cuda")
        longest = max(count_positions(r) for r in self.rows)
        max_tokens = self.settings.max_tokens or capacity(longest + RESERVE_TOKENS)
        shape = SessionShape(batch, len(s.fathom_layers), s.kv_heads, s.group_size, s.head_dim, max_tokens,
                             row_cache_rows=self.settings.row_cache_rows if offloaded else 0)
        self.method = self.settings.method_at(s.head_dim, plan if plan is not None else self.settings.plan)
        if offloaded and self.settings.hbm_gb > 0:
            from fathom.host.cache import hbm_planes_for

            stores = 2 if self.method.scans_rotated else 1
            shape = replace(shape, hbm_planes=hbm_planes_for(self.settings.hbm_gb * 1e9, shape.cache_shape(), stores))
        needs, levels = self.settings.needs_calibration(), self.settings.reads_levels
        if not offloaded:
            self.sessions = ReferenceSessions(shape, self.method, self.selection, self.scale,
                                              needs_calibration=needs, levels=levels)
            return
        key = (shape, self.method, self.selection, self.scale, levels)  # OffloadedSessions.key
        pooled = POOL.take(key) if self.settings.pool else None
        self.sessions = pooled or OffloadedSessions(shape, self.method, self.selection, self.scale,
                                                    needs_calibration=needs, levels=levels)

    @ordinary_tensors()
    def open_planned(self, batch: int, device: torch.device) -> None:
        """fathom-plan from the prompt, at the first decode step: plan on row 0's prompt, then hold every layer."""
        if self.closed:
            raise ValueError("the FathomCache was closed")
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
