"""fathom.cuda.append: the appended K/V rows are torch's bf16 of the float32 keys and values, bit for bit, at each
session's length; a bad key or value is flagged."""

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import cuda

from fathom.cuda.append import append_rows


def _awkward(rng, shape):
    """float32 with every rounding case of bf16: exact halves (ties to even both ways), just above and below a half,
    subnormals, both zeros, large magnitudes that round up a binade, and plain normals."""
    low = rng.integers(0, 1 << 16, shape).astype(np.uint32)
    low[rng.random(shape) < 0.3] = 0x8000  # a tie
    low[rng.random(shape) < 0.1] = 0x7FFF
    low[rng.random(shape) < 0.1] = 0x8001
    high = rng.integers(0, 1 << 16, shape).astype(np.uint32)
    high = np.where(rng.random(shape) < 0.1, high & 0x807F, high)  # subnormals and zeros
    high = np.where((high & 0x7F80) == 0x7F80, high & 0xFF7F, high)  # no inf / NaN: what an append accepts
    x = ((high << 16) | low).view(np.float32)
    x[rng.random(shape) < 0.1] = np.float32(-0.0)
    return x


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**31), sessions=st.integers(1, 3), heads=st.sampled_from([1, 2]), m=st.integers(1, 3))
def test_rows_are_torch_bf16_at_each_sessions_length(seed, sessions, heads, m):
    rng = np.random.default_rng(seed)
    d, tokens = 8, 6
    streams = sessions * heads
    k = _awkward(rng, (streams, m, d))
    k = np.clip(k, -60000, 60000).astype(np.float32)  # keys stay within fp16's range
    v = _awkward(rng, (streams, m, d))
    lengths = rng.integers(0, tokens - m + 1, sessions).astype(np.int32)
    kv = cuda.to_device(np.zeros((streams, tokens, 2, d // 4), np.uint64))
    status = cuda.to_device(np.zeros(4, np.int32))
    append_rows(cuda.to_device(k), cuda.to_device(k), cuda.to_device(v), cuda.to_device(lengths),
                cuda.to_device(np.arange(sessions, dtype=np.int32)), heads, status, kv, threads=32)
    assert not status.copy_to_host().any()
    rows = kv.copy_to_host()
    for name, x, side in (("k", k, 0), ("v", v, 1)):
        want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint64)  # 4 to a word
        for g in range(streams):
            p = lengths[g // heads]
            np.testing.assert_array_equal(rows[g, p:p + m, side], want[g], err_msg=name)
        untouched = np.ones(rows.shape[:2], bool)
        for g in range(streams):
            untouched[g, lengths[g // heads]:lengths[g // heads] + m] = False
        assert not rows[untouched].any()


def test_a_key_beyond_fp16_or_a_value_not_finite_is_flagged():
    for key, value, flag in ((70000.0, 1.0, 0), (1.0, np.inf, 1), (np.nan, 1.0, 0), (1.0, np.nan, 1)):
        k = np.ones((1, 1, 4), np.float32)
        v = np.ones((1, 1, 4), np.float32)
        k[0, 0, 2], v[0, 0, 3] = key, value
        status = cuda.to_device(np.zeros(4, np.int32))
        kv = cuda.to_device(np.zeros((1, 2, 2, 1), np.uint64))
        append_rows(cuda.to_device(k), cuda.to_device(k), cuda.to_device(v), cuda.to_device(np.zeros(1, np.int32)),
                    cuda.to_device(np.zeros(1, np.int32)), 1, status, kv)
        flags = status.copy_to_host()
        assert flags[flag] == 1 and flags[1 - flag] == 0
