"""``python -m bench channel-stats``: per-channel statistics of a real capture, for synthetic keys that look real.

The GPU timing (``python -m bench timing``) needs Qwen3-8B-shaped keys and queries at up to a million tokens,
which no model here can produce; it draws them channel by channel from the statistics of a real d = 128 capture
(default Qwen2.5-Coder-1.5B on Paul Graham's essays): per (layer, KV head, channel) the mean and standard
deviation of the post-RoPE keys over the window's tokens, and of the decode queries over positions and the
group's heads. Writes ``bench/data/channel-stats-<model>-<n>-<text>.npz`` with the command that made it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from bench.cli import UsageError, writable_folder
from bench.report import command_line

DATA = Path(__file__).resolve().parent / "data"
MIN_CONTEXT = 128  # the capture's decode positions (bench.capture.decode_positions) are its last 128 tokens
FIELDS = ("key_mean", "key_std", "query_mean", "query_std")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="qwen2.5-coder-1.5b", help="a real model (see bench fetch)")
    parser.add_argument("--context", type=int, default=4096,
                        help=f"window length in tokens ({MIN_CONTEXT} .. the model's; default %(default)s)")
    parser.add_argument("--corpus", default="paul-graham", help="the text (a corpus name)")
    parser.add_argument("--cache", type=Path, default=None, help="model / corpus / capture cache folder")
    parser.add_argument("--out", type=Path, default=DATA, help="output folder (default bench/data)")


def statistics(keys: np.ndarray, queries: np.ndarray) -> dict[str, np.ndarray]:
    """keys ``[L, H, n, d]``, queries ``[L, H, P, G, d]`` -> mean / std per (layer, KV head, channel), float32."""
    q = queries.reshape(queries.shape[:2] + (-1, queries.shape[-1]))
    return {"key_mean": keys.mean(axis=2), "key_std": keys.std(axis=2), "query_mean": q.mean(axis=2),
            "query_std": q.std(axis=2)}


def load(path: Path, name: str = "--stats") -> dict:
    """The statistics and their provenance (``meta``) from a file this command wrote. A file that is not one
    (unreadable, arrays missing, shapes that disagree, a standard deviation negative or not finite) is refused with
    a :class:`~bench.cli.UsageError` naming it as the argument ``name`` gave it."""
    try:
        with np.load(path) as f:
            stats = {field: f[field] for field in FIELDS}
            stats["meta"] = json.loads(str(f["meta"]))
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as error:
        raise UsageError(f"{name} {path}: not channel statistics of python -m bench channel-stats ({error})") \
            from None
    shape = stats["key_mean"].shape
    wrong = [field for field in FIELDS if stats[field].ndim != 3 or stats[field].shape != shape]
    if wrong:
        raise UsageError(f"{name} {path}: {wrong[0]} has shape {stats[wrong[0]].shape}, not [layers, KV heads, d] "
                         f"= {shape} as key_mean")
    if not all(np.isfinite(stats[field]).all() for field in FIELDS) or \
            (stats["key_std"] < 0).any() or (stats["query_std"] < 0).any():
        raise UsageError(f"{name} {path}: its statistics hold a non-finite value or a negative standard deviation")
    return stats


def run(args: argparse.Namespace) -> Path:
    from bench.capture import load_capture
    from bench.models import MODELS

    from bench.corpora import is_corpus

    if args.model not in MODELS:
        raise UsageError(f"--model must be one of {sorted(MODELS)}, got {args.model!r}")
    if not MIN_CONTEXT <= args.context <= MODELS[args.model].context:
        raise UsageError(f"--context must lie in {MIN_CONTEXT}..{MODELS[args.model].context}, got {args.context}")
    if not is_corpus(args.corpus):
        raise UsageError(f"--corpus {args.corpus!r} is not a corpus (see python -m bench fetch --help)")
    writable_folder("--out", args.out)
    capture, seconds = load_capture(args.model, args.corpus, args.context, args.cache)
    stats = statistics(capture.keys.astype(np.float64), capture.queries.astype(np.float64))
    # the command as it ran (``python -m bench`` sets it; sys.argv is another program's when main(argv) is called)
    command = getattr(args, "command_line", None) or command_line()
    meta = {"command": command, "model": args.model, "context": args.context, "text": args.corpus,
            "capture": capture.shape, "prefill_s": round(seconds, 1)}
    path = args.out / f"channel-stats-{args.model}-{args.context}-{args.corpus}.npz"
    partial = path.with_name(path.name + ".partial")  # written whole, then renamed: timing never reads half a file
    with partial.open("wb") as sink:
        np.savez(sink, **{k: v.astype(np.float32) for k, v in stats.items()}, meta=json.dumps(meta))
    partial.replace(path)
    return path
