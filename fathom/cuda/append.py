"""Appending tokens to the offloaded cache on the GPU, with every position read from the device lengths.

An append of ``m`` tokens to sessions ``sessions`` is three launches, each with a grid fixed by ``m`` (so one
launch sequence serves every step, and a CUDA graph's replay):

1. :func:`append_rows` checks the keys and values (finite keys within the fp16 range, in the raw and the store's
   basis; finite values: what ``fathom.quantize.quantize`` accepts) and writes the bf16 K/V rows at positions
   ``lengths[s] ..``; a bad element raises the layer's status flag instead (rows past ``lengths`` are not part
   of the cache yet, so nothing visible changes);
2. ``fathom.cuda.pack.seal_blocks`` packs the blocks the append completes;
3. :func:`finish_append` copies the tokens of the new open block into the tail and advances ``lengths``.

Launches 2 and 3 do nothing when the status flag is raised: a rejected append leaves the cache as it was (and a
dry run, flag ``[3]``, compiles the kernels without changing anything).
Rows are ``kv uint16 [S·H, T, 2, d]`` (bf16 bits; K then V of each token side by side, so a winner row is one
``4·d``-byte read), moved as 8-byte words.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

from fathom.cuda.half import f32_to_bf16_bits
from fathom.quantize import BLOCK

FP16_LIMIT = np.float32(65520.0)  # the smallest |x| whose float16 rounding is inf
THREADS = 256


@cuda.jit(device=True, inline=True)
def append_allowed(status):
    """No bad key or value flagged (``[0]``, ``[1]``) and no dry run (``[3]``: kernels compile, nothing changes)."""
    return status[0] == 0 and status[1] == 0 and status[3] == 0


@cuda.jit(device=True, inline=True)
def _bad_key(x):
    return not (abs(x) < FP16_LIMIT)  # NaN compares false


@cuda.jit(cache=True)
def _append_rows_kernel(k, k_store, v, lengths, sessions, heads, status, kv):
    x = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    streams, m, d = k.shape
    words = d // 4
    if x >= streams * m * words:
        return
    gi = x // (m * words)
    i = (x // words) % m
    w = x % words
    # each key and value read once: checked and rounded to bf16 (4 to a word, channel 4w lowest) from one load
    k_word = np.uint64(0)
    v_word = np.uint64(0)
    for u in range(4):
        c = 4 * w + u
        key = k[gi, i, c]
        value = v[gi, i, c]
        if _bad_key(key) or _bad_key(k_store[gi, i, c]):
            status[0] = 1
        if not abs(value) < np.float32(np.inf):
            status[1] = 1
        k_word |= np.uint64(f32_to_bf16_bits(key)) << np.uint64(16 * u)
        v_word |= np.uint64(f32_to_bf16_bits(value)) << np.uint64(16 * u)
    s = sessions[gi // heads]
    g = s * heads + gi % heads
    p = lengths[s] + i
    if p < kv.shape[1]:  # the host checked the capacity; never write past it
        kv[g, p, 0, w] = k_word
        kv[g, p, 1, w] = v_word


@cuda.jit(cache=True)
def _finish_kernel(new, new_store, tail, tail_store, lengths, sessions, heads, status):
    """One block per appended session: the open block's tokens into the tail, then the length."""
    s = sessions[cuda.blockIdx.x]
    m, d = new.shape[1], new.shape[2]
    ok = append_allowed(status)
    n0 = lengths[s]
    first = max((n0 + m) // BLOCK * BLOCK, n0)  # first token of the new open block that this append brings
    count = n0 + m - first
    for x in range(cuda.threadIdx.x, heads * count * d, cuda.blockDim.x):
        if ok:
            h = x // (count * d)
            p = first + (x // d) % count
            c = x % d
            gi = cuda.blockIdx.x * heads + h
            tail[s * heads + h, p % BLOCK, c] = new[gi, p - n0, c]
            tail_store[s * heads + h, p % BLOCK, c] = new_store[gi, p - n0, c]
    cuda.syncthreads()  # every read of lengths[s] above happens before it changes
    if cuda.threadIdx.x == 0 and ok:
        lengths[s] = n0 + m


def append_rows(k, k_store, v, lengths, sessions, heads: int, status, kv, stream=0, threads: int = THREADS) -> None:
    """Check and write the K/V rows of ``m`` appended tokens, as bf16 (rounded here: no cast launch before).

    Args:
        k, k_store, v: float32 ``[S'·H, m, d]``: keys (raw and in the store's basis; the same array when the
            store is raw) and values of sessions ``sessions``, KV head fastest.
        lengths: int32 ``[S]``; sessions: int32 ``[S']``; status: int32 flags ``[0]`` bad key, ``[1]`` bad value.
        kv: uint64 ``[S·H, T, 2, d / 4]``: the rows (host-mapped), K then V of each token, bf16 4 to a word.
    """
    streams, m, d = k.shape
    total = streams * m * (d // 4)
    if total:
        threads = min(threads, total)
        _append_rows_kernel[math.ceil(total / threads), threads, stream](k, k_store, v, lengths, sessions, heads,
                                                                        status, kv)


def finish_append(new, new_store, tail, tail_store, lengths, sessions, heads: int, status, stream=0,
                  threads: int = THREADS) -> None:
    """Copy the appended tokens of each session's new open block into the tails (raw and store basis) and advance
    ``lengths`` by ``m``; nothing when ``status`` flags the append. Shapes as in :func:`append_rows`;
    ``tail``, ``tail_store`` float32 ``[S·H, 64, d]``."""
    n_sessions = sessions.shape[0]
    if n_sessions and new.shape[1]:
        _finish_kernel[n_sessions, threads, stream](new, new_store, tail, tail_store, lengths, sessions, heads, status)
