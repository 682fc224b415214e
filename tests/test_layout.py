"""fathom.layout: the tiered store's near and far addresses cover every word of both arrays exactly once, and the
two ends are today's single-array store word for word (t = 0: all in far, t = 4: all in near)."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fathom.layout import (SCALES_PER_WORD, StoreLayout, plane_in_near, plane_word, record_offset, scale_index,
                           scales_in_near)
from fathom.quantize import PLANES

shapes = st.builds(StoreLayout, streams=st.integers(1, 3), segments=st.integers(1, 3), d=st.integers(1, 5),
                   cap=st.sampled_from([1, 2, 3, 4, 8]), hbm_planes=st.integers(0, PLANES))


def _whole_record_words(layout: StoreLayout) -> dict[tuple, int]:
    """Every word of the single-array store (scales, then planes 0..3 per record), keyed by what it holds."""
    words = {}
    for g in range(layout.streams):
        for seg in range(layout.segments):
            for c in range(layout.d):
                record = record_offset(g, seg, c, layout.segments, layout.d, layout.record_words)
                for w in range(layout.scale_words):
                    words["scales", g, seg, c, w] = record + w
                for p in range(PLANES):
                    for b in range(layout.cap):
                        words["plane", g, seg, c, p, b] = record + layout.scale_words + p * layout.cap + b
    return words


def _tiered_words(layout: StoreLayout) -> dict[tuple, tuple[bool, int]]:
    """The same words in the tiered store: ``(in_near, index)`` each."""
    t, words = layout.hbm_planes, {}
    for g in range(layout.streams):
        for seg in range(layout.segments):
            for c in range(layout.d):
                near, far = layout.near_record(g, seg, c), layout.far_record(g, seg, c)
                scale_record = near if scales_in_near(t) else far
                for w in range(layout.scale_words):  # scale_index counts fp16 halves: its word holds 4
                    words["scales", g, seg, c, w] = (scales_in_near(t),
                                                     scale_index(scale_record, w * SCALES_PER_WORD) // SCALES_PER_WORD)
                for p in range(PLANES):
                    for b in range(layout.cap):
                        in_near = plane_in_near(p, t)
                        words["plane", g, seg, c, p, b] = (
                            in_near, plane_word(near if in_near else far, p, b, layout.scale_words, layout.cap, t))
    return words


@given(shapes)
def test_near_and_far_hold_every_word_exactly_once(layout):
    words = _tiered_words(layout)
    for in_near, size in ((True, layout.near_words), (False, layout.far_words)):
        indices = sorted(index for near, index in words.values() if near == in_near)
        assert indices == list(range(size))  # every word of the array, once
    assert layout.near_words + layout.far_words == len(_whole_record_words(layout))


@given(shapes)
def test_the_ends_are_the_single_array_store(layout):
    whole = _whole_record_words(layout)
    for t, in_near in ((0, False), (PLANES, True)):
        end = StoreLayout(layout.streams, layout.segments, layout.d, layout.cap, hbm_planes=t)
        assert (end.far_words if t == 0 else end.near_words) == len(whole)
        assert {k: (in_near, i) for k, i in whole.items()} == _tiered_words(end)


def test_read_inverts_the_addresses():
    layout = StoreLayout(streams=2, segments=2, d=3, cap=2, hbm_planes=2)
    rng = np.random.default_rng(0)
    near = rng.integers(0, 2**63, layout.near_words, dtype=np.uint64)
    far = rng.integers(0, 2**63, layout.far_words, dtype=np.uint64)
    planes, scales = layout.read(near, far, stream=1, n_blocks=3)
    # block 2 is block 0 of segment 1; plane 3 is the far record's second plane (t = 2, cap = 2)
    assert planes[1, 3, 2] == far[layout.far_record(1, 1, 1) + (3 - 2) * 2 + 0]
    assert planes[1, 1, 2] == near[layout.near_record(1, 1, 1) + layout.scale_words + 1 * 2 + 0]
    assert scales[2, 1].view(np.uint16) == near.view(np.uint16)[layout.near_record(1, 0, 2) * 4 + 1]


def test_a_tier_outside_the_planes_is_refused():
    with pytest.raises(ValueError, match="hbm_planes"):
        StoreLayout(1, 1, 1, 1, hbm_planes=5)
