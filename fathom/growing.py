"""Rows of a growing session: an append-only ``[n, width]`` array with amortised O(1) appends.

What a decoded session keeps besides its bit planes — exact keys and values,
landmarks, dequantized copies of the sealed blocks — grows by one row per
decode step. :class:`GrowingRows` doubles its capacity when full, so an append never
copies what is already held more than a constant number of times on average,
and :attr:`GrowingRows.array` is always a C-contiguous view of the rows held.

Example::

    >>> import numpy as np
    >>> from fathom.growing import GrowingRows
    >>> rows = GrowingRows(3)
    >>> rows.append(np.ones((2, 3), np.float32))
    >>> rows.append(np.zeros((1, 3), np.float32))
    >>> rows.array.shape, rows.array[:, 0].tolist()
    ((3, 3), [1.0, 1.0, 0.0])
"""

from __future__ import annotations

import numpy as np

from fathom import _checks


class GrowingRows:
    """An append-only ``[n, width]`` array of ``dtype`` (default float32)."""

    def __init__(self, width: int, dtype=np.float32):
        if width <= 0:
            raise ValueError(f"width must be positive, got {width}")
        self._data = np.zeros((0, width), dtype)
        self._n = 0

    def __len__(self) -> int:
        return self._n

    @property
    def array(self) -> np.ndarray:
        """The rows held, ``[n, width]`` (a view: valid until the next append)."""
        return self._data[:self._n]

    def append(self, x: np.ndarray) -> None:
        """Append ``x [m, width]`` (m >= 0) of the rows' dtype."""
        x = _checks.array("x", x, ndim=2, dtype=self._data.dtype)
        if x.shape[1] != self._data.shape[1]:
            raise ValueError(f"x must have {self._data.shape[1]} columns, got shape {x.shape}")
        end = self._n + len(x)
        if end > len(self._data):
            grown = np.zeros((max(end, 2 * len(self._data)), self._data.shape[1]), self._data.dtype)
            grown[:self._n] = self.array
            self._data = grown
        self._data[self._n:end] = x
        self._n = end
