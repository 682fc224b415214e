"""Capture real attention inputs: post-RoPE keys, values and the last P decode queries of every layer.

One dense fp32 prefill (CPU or GPU) over a real text window. The keys, values
and queries are recorded inside attention through transformers' own
extension point (a registered attention function that records its inputs and
then runs the stock SDPA attention), so they are exactly what the model's
attention sees: after RoPE and after QK-norm where the model has it. On a GPU
the SDPA runs over chunks of query rows (fp32 with grouped heads has no fused
kernel there: a 32k prefill's scores were 48 GB at once). Only
global-attention layers are kept (sliding-window layers never see the long
context). Captures are cached on disk with the digests of the model build and
the text they were made from, and are remade when either changes.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from bench import artifacts, corpora, models
from bench.cli import UsageError
from fathom.capture import Capture

ATTENTION_NAME = "fathom_capture"
GPU_QUERY_CHUNK = 4096  # query rows per SDPA call on a GPU: 12 heads x 4k x 32k fp32 scores are 6 GB, not 48


def decode_positions(n: int) -> int:
    """P = 128 decode positions, 64 at >= 64k tokens (issue "Real-model fidelity")."""
    return 64 if n >= 65536 else 128


def attend_in_chunks(module, query, key, value, attention_mask, chunk: int, **kwargs):
    """transformers' ``sdpa_attention_forward`` over ``chunk`` query rows at a time: the same output (each row's
    softmax is its own), at most ``chunk`` × n scores at once. Query row ``p`` of ``n`` sits at key position
    ``kv - n + p``; with no mask it sees the keys up to it (causal), else the rows ``attention_mask`` gives it (a
    sliding window's included)."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    n, kv = query.shape[2], key.shape[2]
    if n <= chunk:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    outputs = []
    for start in range(0, n, chunk):
        stop = min(start + chunk, n)
        if attention_mask is None:
            seen = kv - n + stop  # the keys the chunk's last row sees
            rows = torch.arange(kv - n + start, seen, device=query.device)
            mask = (torch.arange(seen, device=query.device)[None, :] <= rows[:, None])[None, None]
            keys, values = key[:, :, :seen], value[:, :, :seen]
        else:  # a mask of one row broadcasts over the queries
            mask = attention_mask if attention_mask.shape[2] == 1 else attention_mask[:, :, start:stop]
            keys, values = key, value
        outputs.append(sdpa_attention_forward(module, query[:, :, start:stop], keys, values, mask, **kwargs)[0])
    return torch.cat(outputs, dim=1), None


class _Recorder:
    """An attention function that records each layer's inputs, then attends with SDPA (ticking ``progress``), over
    ``query_chunk`` query rows at a time (None: all at once)."""

    def __init__(self, positions: int, layers: set[int], progress: tqdm, query_chunk: int | None = None):
        self.positions, self.layers, self.progress = positions, layers, progress
        self.query_chunk = query_chunk
        self.keys: dict[int, np.ndarray] = {}
        self.values: dict[int, np.ndarray] = {}
        self.queries: dict[int, np.ndarray] = {}
        self.scales: dict[int, float] = {}

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        layer = module.layer_idx
        if layer in self.layers:
            # query [1, Hq, n, d]; key / value [1, H, n, d] (before GQA repetition)
            self.keys[layer] = key[0].float().cpu().numpy().copy()
            self.values[layer] = value[0].float().cpu().numpy().copy()
            self.queries[layer] = query[0, :, -self.positions:].float().cpu().numpy().copy()
            self.scales[layer] = float(kwargs.get("scaling") or module.scaling)
        self.progress.update(1)
        if self.query_chunk is None:
            return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        return attend_in_chunks(module, query, key, value, attention_mask, self.query_chunk, **kwargs)


def global_layers(config) -> list[int]:
    """Layers that attend over the whole context (all of them unless the model has sliding-window layers)."""
    types = getattr(config, "layer_types", None)
    if not types:
        return list(range(config.num_hidden_layers))
    return [i for i, t in enumerate(types) if t == "full_attention"]


def window(tokenizer, text: str, n: int, name: str = "text"):
    """The first ``n`` token ids of ``text`` (called ``name`` in errors) as a ``[1, n]`` tensor."""
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=True).input_ids[:, :n]
    if ids.shape[1] < n:
        raise UsageError(f"{name} has only {ids.shape[1]} tokens, fewer than the context {n} (--context)")
    return ids


def capture(model, ids, positions: int | None = None, meta: dict | None = None,
            query_chunk: int | None = None) -> Capture:
    """Run ``model`` densely over token ids ``[1, n]`` (on the model's device) and record every global layer.

    Returns keys ``[L, H, n, d]``, values, and the queries of the last ``P``
    positions ``[L, H, P, G, d]`` (query head ``h`` belongs to KV head ``h // G``).
    ``query_chunk``: query rows per SDPA call (default :data:`GPU_QUERY_CHUNK` on a GPU; all at once on the CPU, as
    the committed CPU captures were made).
    """
    import torch

    from fathom.integrations.attention import attention_implementation

    n = ids.shape[1]
    positions = positions or decode_positions(n)
    _check_positions(positions, n)
    layers = global_layers(model.config)
    with tqdm(total=model.config.num_hidden_layers, desc=f"prefill {n} tokens", unit="layer") as bar:
        if query_chunk is None and model.device.type == "cuda":
            query_chunk = GPU_QUERY_CHUNK
        recorder = _Recorder(positions, set(layers), bar, query_chunk)
        with attention_implementation(model, ATTENTION_NAME, recorder), torch.inference_mode():
            model(ids.to(model.device), use_cache=False, logits_to_keep=1)
    scales = {recorder.scales[i] for i in layers}
    if len(scales) != 1:
        raise ValueError(f"layers use different softmax scales {scales}; a Capture holds one")
    keys = np.stack([recorder.keys[i] for i in layers])  # [L, H, n, d]
    H = keys.shape[1]
    queries = np.stack([recorder.queries[i] for i in layers])  # [L, Hq, P, d]
    L, Hq, P, d = queries.shape
    queries = queries.reshape(L, H, Hq // H, P, d).transpose(0, 1, 3, 2, 4)  # [L, H, P, G, d]
    return Capture(keys, np.stack([recorder.values[i] for i in layers]), np.ascontiguousarray(queries),
                   np.arange(n - P, n), scales.pop(), {**(meta or {}), "layers": layers, "synthetic": False})


def _check_positions(positions: int, n: int) -> None:
    """A capture records the queries of its last ``positions`` tokens: more than the ``n`` it holds would be fewer
    queries than its name and meta promise (and a cached one that never matches, made twice per call)."""
    if not 1 <= positions <= n:
        raise ValueError(f"decode positions must lie in 1..{n} for a {n}-token capture, got {positions}")


def load_capture(model_name: str, corpus: str | Path, n: int, cache: str | Path | None = None,
                 positions: int | None = None, loaded=None, device: str = "cpu") -> tuple[Capture, float]:
    """The capture of ``model_name`` over the first ``n`` tokens of a corpus (a name or a UTF-8 file),
    cached on disk; returns it with the seconds its prefill took (recorded with the capture, so a cached
    capture reports the time it took when it was made).

    A cached capture is used only if its file matches the digest recorded when it was written and it was
    made from the same model build (:func:`bench.models.digest`) and the same text (sha256); otherwise it
    is remade. ``loaded``: a callable returning the loaded ``(model, tokenizer)``, called only to make one.
    ``device``: where the fp32 prefill runs ("cpu" or "cuda"); recorded in the capture's meta.
    """
    positions = positions or decode_positions(n)
    _check_positions(positions, n)  # before the text, the model or a prefill is touched
    if isinstance(corpus, Path):
        text, text_name = corpus.read_text(encoding="utf-8"), corpus.name
    else:
        text, text_name = corpora.load(corpus, cache), corpus
    text_sha256 = hashlib.sha256(text.encode()).hexdigest()
    tag = text_sha256[:12] if isinstance(corpus, Path) else corpus
    path = artifacts.cache_dir(cache) / "captures" / f"{model_name}-{tag}-{n}-{positions}.npz"

    def made_from() -> dict:
        return {"model_sha256": models.digest(model_name, cache), "text_sha256": text_sha256}

    def build(partial: Path) -> None:
        model, tokenizer = loaded() if loaded else models.load(model_name, cache)
        model.to(device)
        start = time.perf_counter()
        meta = {"model": model_name, "context": n, "text": text_name, "device": device, **made_from()}
        result = capture(model, window(tokenizer, text, n, text_name), positions, meta=meta)
        result.meta["prefill_s"] = round(time.perf_counter() - start, 1)
        with partial.open("wb") as sink:
            result.save(sink)

    def load(cached: Path) -> Capture:
        result = Capture.load(cached)
        if {key: result.meta.get(key) for key in ("model_sha256", "text_sha256")} != made_from():
            raise artifacts.CacheMismatch(f"{cached} was made from another build of {model_name} or another text")
        if result.keys.shape[2] != n or len(result.positions) != positions:  # a file renamed or copied over
            raise artifacts.CacheMismatch(f"{cached} holds {result.keys.shape[2]} tokens and "
                                          f"{len(result.positions)} decode positions, not {n} and {positions}")
        return result

    result = artifacts.load_cached(path, build, load)
    return result, result.meta["prefill_s"]


def add_probe_arguments(parser, calibration_help: str) -> None:
    """The arguments of a research probe over one cached capture (``bench.plane_probe``, ``bench.tier_split``):
    the model, the text, its length, the decode positions, the calibration and the results folder."""
    from bench.report import RESULTS

    parser.add_argument("--model", default="smollm2-135m", help="one of " + ", ".join(models.MODELS))
    parser.add_argument("--corpus", default="paul-graham", help="evaluation corpus (default paul-graham)")
    parser.add_argument("--context", type=int, default=4096, help="tokens (default 4096)")
    parser.add_argument("--positions", type=int, default=128, help="decode positions (default 128)")
    parser.add_argument("--calibration", type=Path, default=None, help=calibration_help)
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder (default bench/results)")


def check_probe_arguments(args):
    """:func:`add_probe_arguments`' values checked before any capture is made -> the model's
    :class:`~bench.models.ModelInfo` and the calibration to read (``--calibration``, else the model's committed one,
    else None). Raises :class:`~bench.cli.UsageError` naming the argument."""
    from bench import cli, decoding
    from fathom.quantize import BLOCK

    info = models.model_argument(args.model)
    if not BLOCK * 2 <= args.context <= info.context:
        raise UsageError(f"--context must lie in {BLOCK * 2}..{info.context}, got {args.context}")
    if not 1 <= args.positions < args.context // 2:
        raise UsageError(f"--positions must lie in 1..{args.context // 2 - 1}, got {args.positions}")
    corpora.check_argument("--corpus", args.corpus)
    calibration = args.calibration or decoding.default_calibration(args.model)
    if calibration is not None:
        decoding.check_calibration(calibration, args.model)
    cli.writable_folder("--out", args.out)
    return info, calibration


def probe_capture(parser, args) -> Capture:
    """The capture a research probe reads (:func:`load_capture` of ``args``' model, corpus, context and positions),
    its failures in one line as ``python -m bench`` gives them: a text too short for the context
    (:class:`~bench.cli.UsageError`) exits 2, a failed download or cache repair (:class:`~bench.artifacts.FetchError`)
    exits 1."""
    try:
        capture, _ = load_capture(args.model, args.corpus, args.context, positions=args.positions)
    except UsageError as error:
        parser.exit(2, f"error: {error}\n")
    except artifacts.FetchError as error:
        parser.exit(1, f"error: {error}\n")
    return capture
