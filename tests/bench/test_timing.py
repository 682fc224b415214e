"""bench.timing's loop: a row cache's warm-up budget, the layers pinned memory holds, the sessions' lengths."""

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


def test_the_physical_layers_fit_the_pinned_budget_as_the_cache_counts_it():
    """16 ragged sessions of 128k with the store in HBM: the cache reserves max_tokens a session, so the layers
    chosen fit --host-gb by the cache's own count (the estimate from the ragged lengths chose 17 layers, 160 GB)."""
    from argparse import Namespace

    from bench.timing_run import cache_shape, held_layers
    from bench.timing_settings import LAYERS, Setting
    from fathom.host.cache import PinnedLayer, store_names

    for regime, sessions, host_gb in (("hbm", 16, 90.0), ("host", 16, 90.0), ("host", 1, 90.0), ("hbm", 1, 1.0)):
        setting = Setting(131072, sessions, regime, ragged=sessions == 16)
        args = Namespace(host_gb=host_gb, hbm_planes=2, row_cache_rows=32768)
        layers = held_layers(setting, args)
        per_layer = PinnedLayer.nbytes(cache_shape(setting, args, layers), store_names(rotated=True))  # a layer's
        pinned = layers * per_layer
        if layers > 1:  # one layer is the floor, whatever the budget
            assert pinned <= host_gb * 1e9
        if layers < LAYERS:
            assert pinned + per_layer > host_gb * 1e9  # one layer more would not fit
    assert held_layers(Setting(131072, 16, "hbm", ragged=True), Namespace(host_gb=90.0, hbm_planes=2,
                                                                          row_cache_rows=32768)) == 9


def test_sessions_complete_their_blocks_on_different_tokens():
    """Several sessions, ragged or not, end at different places in their blocks, as a server's do: over 64 appended
    tokens each session completes one block and no token completes more than ceil(S / 64); the longest session holds
    the context, and every session is within a block of its block-aligned length. One session is as it was."""
    import numpy as np

    from bench.timing_settings import Setting

    assert Setting(1048576, 1, "host").lengths == [1048576]
    for sessions, ragged in ((16, True), (4, False), (3, True), (64, True)):
        setting = Setting(131072, sessions, "host", ragged=ragged)
        lengths, aligned = np.array(setting.lengths), np.array(setting.block_lengths)
        assert lengths.max() == 131072 and ((aligned - lengths >= 0) & (aligned - lengths < 64)).all()
        completes = np.array([(lengths + t + 1) % 64 == 0 for t in range(64)])  # [token, session]
        assert (completes.sum(axis=0) == 1).all() and completes.sum(axis=1).max() == -(-sessions // 64)
