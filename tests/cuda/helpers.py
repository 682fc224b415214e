"""Shared test helpers for the GPU path."""

import numpy as np
import torch

from fathom.cuda.interop import SIMULATED
from fathom.cuda.score_keys import HALVES, key_columns, keys_to_scores
from fathom.layout import StoreLayout
from fathom.quantize import BLOCK, PLANES
from fathom.scoring import LANDMARK_TOKENS
from fathom.selection import order_keys


def write_store(planes: np.ndarray, scales: np.ndarray, layout: StoreLayout, stream: int, near: np.ndarray,
                far: np.ndarray) -> None:
    """The inverse of ``StoreLayout.read``: one stream's reference planes ``uint64 [d, 4, n_blocks]`` and scales
    ``float16 [d, n_blocks]`` into host ``near`` and ``far``."""
    arrays = {True: near, False: far}
    for c in range(layout.d):
        for block in range(planes.shape[2]):
            for p in range(PLANES):
                in_near, index = layout.word(stream, block, c, p)
                arrays[in_near][index] = planes[c, p, block]
            in_near, index = layout.scale(stream, block, c)
            arrays[in_near].view(np.uint16)[index] = scales.view(np.uint16)[c, block]


def unwritten_keys(streams: int, heads: int, tokens: int):
    """A device keys buffer (``fathom.cuda.score_keys``) for ``tokens`` tokens whose every entry reads back as NaN:
    what a scan leaves unwritten shows."""
    from numba import cuda

    return cuda.to_device(np.full((streams, heads, HALVES, key_columns(tokens)), 0xFFFFFFFF, np.uint32))


def read_scores(keys, tokens: int) -> np.ndarray:
    """float32 ``[streams, G, tokens]``: the scores a device keys buffer holds."""
    return keys_to_scores(keys.copy_to_host())[..., :tokens]


def top_byte_histogram(scores: np.ndarray) -> np.ndarray:
    """Per head of ``scores float32 [G, n]``, counts of the top byte of the order-preserving key -> int32 [G, 256]."""
    return np.stack([np.bincount(row >> 24, minlength=256) for row in order_keys(scores)]).astype(np.int32)


def selected(decoder, layer: int) -> np.ndarray:
    """The decoder's last step's selection over each (session, KV head)'s context as bool ``[S·H, G, max n]``, read
    back from its row list and head masks (a host copy)."""
    n = decoder.cache.lengths(layer)
    heads = decoder.cache.shape.kv_heads
    mask = np.zeros((decoder.cache.shape.streams, decoder.group_size, int(n.max())), bool)
    rows, bits = decoder.row_index.cpu().numpy(), decoder.head_mask.cpu().numpy()
    counts = decoder.n_rows.cpu().numpy()
    for g in range(mask.shape[0]):
        if decoder.dense:
            mask[g, :, :n[g // heads]] = True
            continue
        chosen = (bits[g, :counts[g], None] >> np.arange(decoder.group_size)) & 1
        mask[g][:, rows[g, :counts[g]]] = chosen.T.astype(bool)
    return mask


def sealed_planes(cache, layer: int, stream: int, basis: str = "raw") -> tuple[np.ndarray, np.ndarray]:
    """One (session, KV head)'s sealed planes ``uint64 [d, 4, n_blocks]`` and scales ``float16 [d, n_blocks]`` of an
    offloaded cache, read back on the host through the store's layout (syncs)."""
    store = cache.layer(layer).stores[basis]
    if not SIMULATED:
        torch.cuda.synchronize()
    n_blocks = int(cache.lengths(layer)[stream // cache.shape.kv_heads]) // BLOCK
    return cache.shape.layout.read(store.near.cpu().numpy(), store.far.cpu().numpy(), stream, n_blocks)


def sealed_landmarks(cache, layer: int, stream: int) -> np.ndarray:
    """One (session, KV head)'s landmarks of the sealed blocks, ``float16 [n_sealed / 8, d]``, read on the host
    (syncs)."""
    marks = cache.layer(layer).marks
    if not SIMULATED:
        torch.cuda.synchronize()
    n_sealed = int(cache.lengths(layer)[stream // cache.shape.kv_heads]) // BLOCK * BLOCK
    return marks.host[stream, :n_sealed // LANDMARK_TOKENS, 0].copy().view(np.float16)
