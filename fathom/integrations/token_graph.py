"""The model's whole decode token as one CUDA graph, through transformers' ``custom_generate``.

``generate`` prepares the inputs, logits processors and stopping criteria as usual and hands the decoding loop to
:func:`decode` (transformers' own extension point for a decoding loop: ``custom_generate=`` a callable)::

    from fathom.integrations.token_graph import decode
    cache = FathomCache(model, method="fathom", budget=48)
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=256,
                         custom_generate=decode)

:func:`decode` runs the prefill (or a conversation's next chunk) as ``generate`` does, then captures the model's
forward for one token — every layer's projections, norms and MLP, each FathomCache layer's append and sparse
step, the logits — once as a :class:`TokenGraph` and replays it per token, as gpt-fast, vLLM and SGLang do: the
host does one replay, one check of the cache's error flags and the token choice per token, not work per layer.
Each token's replay is launched before the host reads whether the previous token ended every row (vLLM's
asynchronous scheduling does the same), so the host's work per token overlaps the GPU's; the price is one
token's work when the rows end by EOS (not by length, which the host knows), and the cache then holds the last
returned token too (``generate``'s own loop leaves it out; a later call on the conversation starts after what the
cache holds either way).
The graph is kept with the offloaded sessions, so a later cache that takes them from the pool replays it without
capturing again.
The logits processors, sampling or argmax and the stopping criteria run as ``generate``'s own loop runs them.

What it needs: a FathomCache on the offloaded backend (the model on a CUDA device), every layer full attention
(sliding-window layers grow a dense cache, which a graph cannot hold), ``return_dict_in_generate`` off. Anything
else is refused before the prefill. The tokens equal those of ``generate`` without ``custom_generate`` (tested);
under the CUDA simulator there is no graph and each "replay" runs the captured work eagerly.
"""

from __future__ import annotations

import inspect
import weakref

import torch

from fathom.cuda.interop import SIMULATED
from fathom.host.graph import capture
from fathom.integrations.decoding import ordinary_tensors
from fathom.integrations.sessions import OffloadedSessions
from fathom.integrations.transformers import FathomCache, FathomLayer


def decode(model, input_ids: torch.Tensor, logits_processor, stopping_criteria, generation_config,
           **model_kwargs) -> torch.Tensor:
    """``generate``'s decoding loop with the decode token as one CUDA graph (pass as ``custom_generate=decode``).

    Returns the sequences ``int64 [B, n + new]`` as ``generate`` does (with ``return_dict_in_generate`` off).
    """
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if not isinstance(cache, FathomCache):
        raise ValueError("custom_generate=decode needs past_key_values=FathomCache(model, ...)")
    if not all(isinstance(layer, FathomLayer) for layer in cache.layers):
        raise ValueError("custom_generate=decode needs every layer to be full attention (sliding-window layers keep a "
                         "growing dense cache, which no CUDA graph holds); use generate without custom_generate")
    if generation_config.return_dict_in_generate:
        raise ValueError("custom_generate=decode returns the sequences only: set return_dict_in_generate=False")
    if generation_config.num_beams != 1:
        raise ValueError("custom_generate=decode decodes greedily or by sampling: num_beams must be 1")
    backend = cache.settings.backend
    if backend == "reference" or (backend == "auto" and model.device.type != "cuda"):
        raise ValueError("custom_generate=decode needs the offloaded backend (the model on a CUDA device)")
    mask = model_kwargs.get("attention_mask")
    past = cache.get_seq_length()
    B, n = input_ids.shape
    positions = _positions(mask, n, input_ids.device)
    logits = _forward(model, cache, input_ids[:, past:], positions[:, past:], mask)
    position = positions[:, -1]  # of the last token fed; each decoded token is one further
    decoding = cache.decoding
    unfinished = torch.ones(B, dtype=torch.bool, device=input_ids.device)
    pad = generation_config._pad_token_tensor
    has_eos = any(hasattr(criterion, "eos_token_id") for criterion in stopping_criteria)
    max_length = getattr(stopping_criteria, "max_length", None)
    stop = _StopCheck(input_ids.device)
    graph = None
    while True:
        scores = logits_processor(input_ids, logits[:, -1].to(torch.float32))
        if generation_config.do_sample:
            token = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        else:
            token = scores.argmax(dim=-1)
        if has_eos and pad is not None:
            token = torch.where(unfinished, token, pad.to(token.device))
        input_ids = torch.cat([input_ids, token[:, None]], dim=-1)
        unfinished &= ~stopping_criteria(input_ids, scores)
        if max_length is not None and input_ids.shape[1] >= max_length:  # a stop the host knows without the GPU
            return input_ids
        if graph is None:
            if not bool(unfinished.any()):  # ended at the prefill's token: no graph is captured
                return input_ids
            if decoding.sessions is None:  # fathom-plan planned on the prompt: its sessions open at the first step
                decoding.open_planned(B, input_ids.device)
            with ordinary_tensors():  # the store grown and the graph's buffers made here are written later
                decoding.sessions.reserve((max_length or input_ids.shape[1]) - input_ids.shape[1] + 1)
                graph = TokenGraph.of(model, cache, B)
        position = position + 1
        # The next token is launched before the host learns whether this one ended every row, so the GPU decodes
        # while the host waits: no gap per token. An EOS stop then costs one token's work, and the cache holds the
        # last token returned too (a later generate on the conversation starts after it).
        stop.enqueue(unfinished)
        logits = graph(token, position)
        if stop.all_finished():
            return input_ids


class _StopCheck:
    """Whether every row has finished, copied to the host behind an event (not a stream-ordered ``.item()``), so
    reading it waits for the stopping check only, not for work launched after it."""

    def __init__(self, device: torch.device):
        self._gpu = device.type == "cuda" and not SIMULATED
        self._host = torch.zeros((), dtype=torch.bool, pin_memory=self._gpu)
        self._ready = torch.cuda.Event() if self._gpu else None

    def enqueue(self, unfinished: torch.Tensor) -> None:
        self._host.copy_(~unfinished.any(), non_blocking=self._gpu)
        if self._gpu:
            self._ready.record()

    def all_finished(self) -> bool:
        if self._gpu:
            self._ready.synchronize()
        return bool(self._host)


class TokenGraph:
    """One decode token of ``model`` over ``cache`` (every layer a FathomCache layer), captured once.

    ``graph(token int64 [B], position int64 [B])`` appends the token to every session of every layer, decodes it
    and returns the logits ``[B, 1, vocab]`` (a static buffer, overwritten by the next call). Before each replay
    the cache's flags are checked and its capacity for the token made sure of; the capacity must not grow while
    the graph lives (the caller reserves it first), since growing moves the store the graph reads.
    """

    @classmethod
    def of(cls, model, cache: FathomCache, batch: int) -> TokenGraph:
        """The graph of ``model`` over ``cache``'s sessions: the one captured on them before when they come from the
        pool (same model, same store), bound to ``cache``; else captured now and kept with the sessions."""
        cache.decoding.calibrate_waiting()  # before a capture: the capture does no host work
        sessions = cache.decoding.sessions
        kept = sessions.token_graphs.get((id(model), batch))
        if kept is not None and kept.model is model and kept.store is sessions.cache:
            kept._cache = weakref.ref(cache)
            return kept
        graph = cls(model, cache, batch)
        sessions.token_graphs[(id(model), batch)] = graph
        return graph

    def __init__(self, model, cache: FathomCache, batch: int):
        # weak: the graph stays with the sessions, which the pool keeps past the cache and the model
        self._model, self._cache = weakref.ref(model), weakref.ref(cache)
        self.sessions: OffloadedSessions = cache.decoding.sessions
        self.store = self.sessions.cache
        device = model.device
        self.token = torch.zeros((batch, 1), dtype=torch.long, device=device)
        self.position = torch.zeros((batch, 1), dtype=torch.long, device=device)
        self.logits = None
        self._graph = None
        if not SIMULATED:
            self._capture()

    @property
    def model(self):
        """The model captured (None once it is gone)."""
        return self._model()

    @property
    def cache(self) -> FathomCache | None:
        """The FathomCache the graph decodes for now (None once it is gone)."""
        return self._cache()

    def __call__(self, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        self.sessions.begin_token()  # flags raised by the last token, and room for this one (no growth: reserved)
        if self.sessions.cache is not self.store:
            raise ValueError("the FathomCache's store grew (past the room reserved for it) since this TokenGraph was "
                             "captured: capture a new one")
        self.token.copy_(token[:, None])
        self.position.copy_(position[:, None])
        if self._graph is not None:
            self._graph.replay()
        else:
            self._forward_enqueued()
        self.sessions.advance()
        for layer in self.cache.layers:
            layer.length += 1
        return self.logits

    def _forward_enqueued(self) -> None:
        """The token's forward with every Fathom step launched directly on the current stream (what the capture
        records) and no host state changed: the layers' lengths are restored after."""
        cache = self.cache
        lengths = [layer.length for layer in cache.layers]
        cache.decoding.capturing = True
        try:
            with torch.no_grad():  # not inference_mode: the step graphs' buffers made here are written later
                self.logits = _forward(self.model, cache, self.token, self.position, None)
        finally:
            cache.decoding.capturing = False
            for layer, length in zip(cache.layers, lengths):
                layer.length = length

    def _capture(self) -> None:
        """As a step graph is captured (``fathom.host.graph.capture``): a warm-up with the appends dry, then the
        capture, with the collector off."""
        self._graph = capture(self.store, [lambda stream: self._forward_enqueued()])


def _positions(mask: torch.Tensor | None, n: int, device) -> torch.Tensor:
    """Position ids ``[B, n]`` as ``generate`` makes them: counted over the non-pad positions (left padding)."""
    if mask is None:
        return torch.arange(n, device=device)[None]
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def _forward(model, cache: FathomCache, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None):
    """The model's forward over ``ids`` with ``cache``, the last position's logits (transformers 5.17 names the
    cache ``past_key_values``, later versions ``cache``)."""
    cache_argument = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    if positions.shape[0] != ids.shape[0]:
        positions = positions.expand(ids.shape[0], -1)
    return model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1,
                 **{cache_argument: cache}).logits
