import numpy as np
import pytest
from hypothesis import given, strategies as st

from fathom.growing import GrowingRows


@given(st.lists(st.integers(0, 70), max_size=12))
def test_rows_grown_in_pieces_equal_the_rows_appended(pieces):
    rng = np.random.default_rng(len(pieces))
    x = rng.standard_normal((sum(pieces), 3)).astype(np.float32)
    rows, start = GrowingRows(3), 0
    for m in pieces:
        rows.append(x[start:start + m])
        start += m
        np.testing.assert_array_equal(rows.array, x[:start])
    assert len(rows) == len(x) and rows.array.flags.c_contiguous


def test_rows_refuse_bad_input():
    rows = GrowingRows(3, np.float16)
    with pytest.raises(ValueError, match="x must have 3 columns"):
        rows.append(np.zeros((1, 4), np.float16))
    with pytest.raises(ValueError, match="x must have dtype float16"):
        rows.append(np.zeros((1, 3), np.float32))
    with pytest.raises(ValueError, match="width must be positive"):
        GrowingRows(0)
