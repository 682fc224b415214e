"""bench.timing's loop: a row cache's warm-up budget."""

from bench.timing import ROW_CACHE_WARMUP_MAX, warmup_most


def test_a_row_cache_warms_within_the_tokens_the_cache_can_still_append():
    """Two methods, 16 sessions on 6 physical layers (4,096 tokens of headroom, 6 appends a token): each method's
    warm-up and timed tokens fit what is left, where 512 warm-up tokens each would not."""
    left, timed = 4096 // 6, 14
    first = warmup_most(left, 2, 1, timed)
    assert first < ROW_CACHE_WARMUP_MAX and (first + timed) * 2 <= left
    second = warmup_most(left - first - timed, 1, 1, timed)
    assert first + timed + second + timed <= left
    assert warmup_most(4096, 2, 1, timed) == ROW_CACHE_WARMUP_MAX


def test_a_methods_warm_up_budget_is_split_between_its_modes():
    """Eager and graph each warm the cache: together they stay within the method's share."""
    left, timed = 4096 // 6, 28
    each = warmup_most(left, 2, 2, timed)
    assert 2 * each + timed <= left // 2 and each < warmup_most(left, 2, 1, timed)
