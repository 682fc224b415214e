"""python -m bench.select_probe without a GPU: its batches are the timing bench's, its histogram is the scan's, its
selection (under the CUDA simulator, at a tiny size) is the reference's, and bad arguments are refused in one line,
exit 2."""

import numpy as np
import pytest

from bench import select_probe
from bench.select_probe import LOCAL, SINK, SelectionBuffers, session_lengths, top_histogram
from fathom.selection import Selection
from fathom.selection import select as ref_select
from tests.cuda.helpers import top_byte_histogram

torch = pytest.importorskip("torch")


def test_a_batch_is_ragged_as_the_timing_bench_makes_it():
    from bench.timing_settings import Setting

    assert session_lengths(131072, 1).tolist() == [131072]
    assert session_lengths(131072, 16).tolist() == Setting(131072, 16, "host", ragged=True).block_lengths
    assert session_lengths(131072, 16)[0] == 8192


def test_the_histogram_counts_each_candidates_top_byte_as_the_scan_does():
    rng = np.random.default_rng(0)
    lengths = np.array([300, 130], np.int32)
    scores = (rng.standard_normal((4, 3, 320)) * 10.0 ** rng.integers(-3, 4, (4, 3, 320))).astype(np.float32)
    scores[0, 0, 5] = -0.0
    hist = top_histogram(torch.from_numpy(scores), torch.from_numpy(lengths), 2, SINK, LOCAL).numpy()
    for g in range(4):
        n = lengths[g // 2]
        assert np.array_equal(hist[g], top_byte_histogram(scores[g, :, SINK:min(n // 64 * 64, n - LOCAL)]))


def test_its_selection_is_the_reference_selection():
    """Two ragged sessions of one KV head, k = 40: the rows ``union_rows`` compacts are each stream's tokens that
    some head of the reference selects, with those heads' bits."""
    sel = SelectionBuffers(640, 2, kv_heads=1, k=40)
    sel.select(per_block=256, threads=32, select_threads=64, stream=0)
    n_rows, row_index, head_mask = (x.cpu().numpy() for x in sel.rows(0))
    for g, n in enumerate(sel.lengths.tolist()):
        chosen = ref_select(sel.scores[g, :, :n // 64 * 64].cpu().numpy(), n, Selection(k=40, sink=SINK, local=LOCAL))
        rows = np.flatnonzero(chosen.any(axis=0))
        assert np.array_equal(row_index[g, :n_rows[g]], rows)
        masks = (chosen[:, rows] * (1 << np.arange(chosen.shape[0]))[:, None]).sum(axis=0)
        assert np.array_equal(head_mask[g, :n_rows[g]], masks)


@pytest.mark.parametrize("argv, message", [
    (["--context", "1024"], "--context must be >= 4096"),
    (["--threads", "16"], "--threads must be multiples of 32 in 32..1024"),
    (["--threads", "256,48"], "--threads must be multiples of 32 in 32..1024"),
    (["--select-threads", "2048"], "--select-threads must be in 32..1024"),
    (["--per-block", "0"], "--per-block must be >= 1"),
    (["--reps", "0"], "--reps must be >= 1"),
    (["--census", "--context", "4100"], "--context must be a multiple of 64"),
    (["--census", "--model", "gpt-9"], "--model must be one of"),
    (["--census", "--model", "smollm2-135m", "--context", "131072"], "--context must be at most"),
    (["--census", "--model", "qwen2.5-coder-1.5b", "--context", "16384", "--corpus", "nowhere"],
     "--corpus must be one of"),
    (["--census", "--corpus", "cpython"], "--corpus is read only with --model"),
    (["--model", "qwen2.5-coder-1.5b"], "--model and --corpus are read only with --census"),
    (["--corpus", "cpython"], "--model and --corpus are read only with --census"),
])
def test_bad_arguments_are_refused_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        select_probe.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("python -m bench.select_probe: error: ") and message in err


def test_the_census_counts_the_kth_bin_and_its_ties():
    """bin_census on scores whose k-th largest key shares its top 16 bits with known others; census at 4k over one
    layer of the statistics' model: a record per query head, the bin at least the ties, at least one each."""
    from bench.select_probe import bin_census, census

    scores = np.full(64 + SINK + LOCAL, -5.0, np.float32)
    scores[SINK:SINK + 3] = [8.0, 4.0, 4.0]  # the 2nd largest (k = 2) is 4.0, tied once more
    scores[SINK + 3] = np.float32(4.0) + np.float32(2.0 ** -20)  # the same top 16 key bits as 4.0, a larger key
    assert bin_census(scores, k=2) == (3, 1)  # 4.0 + 2^-20 is the 2nd largest; the bin holds it and both 4.0s
    assert bin_census(scores, k=3) == (3, 2)
    with pytest.raises(ValueError, match="more than k = 64 candidates"):
        bin_census(scores, k=64)
    records = census(4096, layers=[0])
    heads = {(r["layer"], r["kv_head"], r["head"]) for r in records}
    assert len(heads) == len(records) == 2 * 4 + 4  # the model's 2 KV heads x G = 4, then the probe's 4
    assert all(r["in_bin"] >= r["ties"] >= 1 for r in records)
    assert all(0 < r["blocks_second"] <= r["blocks_first_carried"] <= r["blocks_first"] <= 1 for r in records)


def test_the_block_census_counts_the_blocks_each_pass_acts_on():
    """Four blocks of candidates: the largest and a key of the k-th's top two bytes in the second, the k-th largest
    (k = 2) in the third, one of its top byte only in the fourth, the first holding none: the second pass acts on two
    blocks of four, the first on three; the (4k)-th largest lies below the k-th's top byte, so the first pass counts
    from the carried prefix as without it."""
    from bench.select_probe import block_census

    scores = np.full(4 * 64 + LOCAL, -5.0, np.float32)  # candidates: tokens SINK .. 255, blocks 0..3
    scores[64 + 10] = 8.0
    scores[64 + 11] = 4.0
    scores[128 + 5] = np.float32(4.0) + np.float32(2.0 ** -20)  # the 2nd largest: 4.0's top 16 key bits
    scores[192 + 7] = 3.0  # the k-th's top byte (sign and the exponent's top 7 bits), not its top 16 bits
    census = block_census(scores, k=2)
    assert census["blocks_second"] == 0.5 and census["blocks_first"] == census["blocks_first_carried"] == 0.75


def test_a_captures_census_reads_its_last_position_at_the_contexts_k():
    """capture_census over a small capture: one record per (layer, KV head, query head), counted over the sealed
    tokens before the last decode position with design §6's k for that context (128 here), as head_census counts
    them directly."""
    from bench.select_probe import capture_census, head_census
    from fathom.capture import Capture

    rng = np.random.default_rng(1)
    keys = rng.standard_normal((2, 1, 640, 64)).astype(np.float32) + np.float32(3.0)
    queries = rng.standard_normal((2, 1, 2, 3, 64)).astype(np.float32)
    capture = Capture(keys, keys.copy(), queries, np.array([300, 600]), 0.125)
    records = capture_census(capture)
    assert len(records) == 2 * 1 * 3
    for layer in range(2):
        want = head_census(keys[layer, 0, :576], queries[layer, 0, 1], 128, layer, 0)
        assert [r for r in records if r["layer"] == layer] == want
