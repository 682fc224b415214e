"""fathom.cuda.score_keys: the split order keys a scan hands the selection read back as the scores, hold each token
where the module says (word ``w``: tokens ``64 (w // 32) + w % 32`` and that + 32), order the scores as the
selection's order keys do, and keys that do not fit are refused before any launch."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from fathom.cuda.score_keys import key_columns, keys_to_scores, score_keys
from fathom.selection import order_keys


@settings(max_examples=40, deadline=None)
@given(scores=hnp.arrays(np.float32, hnp.array_shapes(min_dims=1, max_dims=3, max_side=140),
                         elements=st.floats(width=32, allow_nan=False)))
def test_keys_read_back_as_the_scores_and_keep_their_order(scores):
    keys = score_keys(scores)
    tokens = scores.shape[-1]
    assert keys.dtype == np.uint32 and keys.shape == scores.shape[:-1] + (2, key_columns(tokens))
    assert key_columns(tokens) % 32 == 0 and 0 <= 2 * key_columns(tokens) - tokens < 64
    back = keys_to_scores(keys)
    np.testing.assert_array_equal(back[..., :tokens].view(np.uint32), (scores + np.float32(0)).view(np.uint32))
    np.testing.assert_array_equal(back[..., tokens:], 0)  # the padding: +0


def test_each_word_holds_a_lanes_two_tokens():
    """Word w of each half: token 64 (w // 32) + w % 32 in its low 16 bits, that token + 32 in its high 16."""
    scores = np.linspace(-3, 3, 130, dtype=np.float32)
    keys, want = score_keys(scores), order_keys(scores)
    for w in (0, 5, 31, 32, 40, 64):
        first = 64 * (w // 32) + w % 32
        for e, j in enumerate((first, first + 32)):
            key = want[j] if j < len(scores) else order_keys(np.float32(0))
            assert (keys[0, w] >> (16 * e)) & 0xFFFF == key >> 16
            assert (keys[1, w] >> (16 * e)) & 0xFFFF == key & 0xFFFF


def test_an_unwritten_key_reads_as_nan_and_a_bad_array_is_refused():
    assert np.isnan(keys_to_scores(np.full((1, 2, 32), 0xFFFFFFFF, np.uint32))).all()
    for bad in (np.zeros((2, 32), np.uint16), np.zeros((3, 32), np.uint32), np.zeros((2, 33), np.uint32)):
        with pytest.raises(ValueError, match=r"keys must be uint32 \[\.\.\., 2, C\] with C a multiple of 32"):
            keys_to_scores(bad)


def _select(keys, tokens: int, threads: int = 32) -> None:
    """``select`` over ``keys`` with every other buffer fitting one stream of ``tokens`` tokens and its heads."""
    from numba import cuda

    from fathom.cuda.topk import select

    streams, heads = keys.shape[:2]
    z = lambda shape, dtype=np.int32: cuda.to_device(np.zeros(shape, dtype))  # noqa: E731
    select(cuda.to_device(keys), z(1), 1, 8, 0, 0, z((streams, heads, 256)), z((streams, heads, 3, 256)),
           z((streams, heads, tokens), np.uint32), z((streams, heads, tokens)), z((streams, heads, 2)),
           z((streams, heads, 4)), z((streams, tokens), np.uint32), z((streams, -(-tokens // 64)), np.uint64),
           threads=threads)


def test_select_refuses_keys_that_do_not_fit_its_tokens():
    for keys in (np.zeros((1, 2, 2, 96), np.uint32), np.zeros((1, 2, 128), np.float32),
                 np.zeros((1, 2, 2, 64), np.int32)):
        with pytest.raises(ValueError, match="keys"):
            _select(keys, 128)


def test_select_refuses_a_partial_warp():
    """The second pass votes across whole warps: threads per CTA must be a multiple of 32."""
    with pytest.raises(ValueError, match="threads a multiple of 32 in 32..1024"):
        _select(np.zeros((1, 1, 2, 32), np.uint32), 64, threads=48)
