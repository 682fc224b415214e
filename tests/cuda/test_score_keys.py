"""fathom.cuda.score_keys: the split order keys a scan hands the selection read back as the scores, order the scores
as the selection's order keys do, and a select over keys that do not fit is refused before any launch."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from fathom.cuda.score_keys import key_width, keys_to_scores, score_keys
from fathom.selection import order_keys


@settings(max_examples=40, deadline=None)
@given(scores=hnp.arrays(np.float32, hnp.array_shapes(min_dims=1, max_dims=3, max_side=9),
                         elements=st.floats(width=32, allow_nan=False)))
def test_keys_read_back_as_the_scores_and_keep_their_order(scores):
    keys = score_keys(scores)
    tokens = scores.shape[-1]
    assert keys.dtype == np.uint16 and keys.shape == scores.shape[:-1] + (2, key_width(tokens))
    assert key_width(tokens) % 2 == 0 and key_width(tokens) - tokens in (0, 1)
    back = keys_to_scores(keys)
    np.testing.assert_array_equal(back[..., :tokens].view(np.uint32), (scores + np.float32(0)).view(np.uint32))
    whole = (keys[..., 0, :].astype(np.uint32) << 16) | keys[..., 1, :]
    np.testing.assert_array_equal(whole[..., :tokens], order_keys(scores))


def test_an_unwritten_key_reads_as_nan_and_a_bad_array_is_refused():
    assert np.isnan(keys_to_scores(np.full((1, 2, 4), 0xFFFF, np.uint16))).all()
    for bad in (np.zeros((2, 4), np.uint32), np.zeros((3, 4), np.uint16), np.zeros(4, np.uint16)):
        with pytest.raises(ValueError, match=r"keys must be uint16 \[\.\.\., 2, W\]"):
            keys_to_scores(bad)


def test_select_refuses_keys_that_do_not_fit_its_tokens():
    from numba import cuda

    from fathom.cuda.topk import select

    streams, heads, tokens = 1, 2, 128
    z = lambda shape, dtype=np.int32: cuda.to_device(np.zeros(shape, dtype))  # noqa: E731
    for keys in (np.zeros((streams, heads, 2, 130), np.uint16), np.zeros((streams, heads, tokens), np.uint32),
                 np.zeros((streams, heads, 2, tokens), np.int16)):
        with pytest.raises(ValueError, match="keys"):
            select(cuda.to_device(keys), z(1), 1, 8, 0, 0, z((streams, heads, 256)), z((streams, heads, 3, 256)),
                   z((streams, heads, tokens), np.uint32), z((streams, heads, tokens)), z((streams, heads, 2)),
                   z((streams, heads, 4)), z((streams, tokens), np.uint32), z((streams, 2), np.uint64))
