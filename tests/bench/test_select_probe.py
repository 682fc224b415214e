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
    assert session_lengths(131072, 16).tolist() == Setting(131072, 16, "host", ragged=True).lengths
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
    (["--threads", "16"], "--threads must be in 32..1024"),
    (["--select-threads", "2048"], "--select-threads must be in 32..1024"),
    (["--per-block", "0"], "--per-block must be >= 1"),
    (["--reps", "0"], "--reps must be >= 1"),
])
def test_bad_arguments_are_refused_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        select_probe.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("python -m bench.select_probe: error: ") and message in err
