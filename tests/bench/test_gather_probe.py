"""python -m bench.gather_probe without a GPU: the row patterns it gathers (each index lies where its pattern says),
and bad arguments refused in one line, exit 2, before any memory is pinned."""

import json

import pytest

from bench import gather_probe
from bench.gather_probe import GIB, patterns, row_index

torch = pytest.importorskip("torch")


def test_the_patterns_of_8_gib_of_512_byte_rows():
    total = 8 * GIB // 512
    assert patterns(total, 512, 131072) == [
        ("random", GIB // 4 // 512, GIB // 4 // 512), ("random", 2 * GIB // 512, 2 * GIB // 512),
        ("random", total, total),
        ("runs", 2, total), ("runs", 8, total), ("runs", 32, total), ("runs", 128, total),
        ("pages", 512, 512 * 8), ("pages", 4096, 4096 * 8), ("pages", 32768, 32768 * 8),
        ("regions", 512, 512 * 4096), ("regions", 4096, total)]  # 32,768 regions (64 GiB) do not fit
    # a quarter GiB: one footprint, no run longer than a gather, no 512 regions (1 GiB)
    quarter = GIB // 4 // 256
    assert [p for p in patterns(quarter, 256, 64) if p[0] != "pages"] == [
        ("random", quarter, quarter), ("runs", 2, quarter), ("runs", 8, quarter), ("runs", 32, quarter)]


@pytest.mark.parametrize("row_bytes", [256, 512])
def test_every_index_lies_where_its_pattern_says(row_bytes):
    total, gathered = 64 * (2 << 20) // row_bytes, 4096  # 64 regions of 2 MiB
    generator = torch.Generator().manual_seed(0)
    per_page, per_region = 4096 // row_bytes, (2 << 20) // row_bytes
    for pattern, parameter in [("random", total // 4), ("runs", 8), ("pages", 512), ("regions", 8)]:
        index = row_index(pattern, parameter, total, row_bytes, gathered, generator, "cpu")
        assert index.numel() == gathered and int(index.min()) >= 0 and int(index.max()) < total
        if pattern == "random":
            assert int(index.max()) < parameter
        elif pattern == "runs":
            runs = index.view(-1, 8)
            assert (runs[:, 0] % 8 == 0).all() and (runs - runs[:, :1] == torch.arange(8)).all()
        elif pattern == "pages":
            assert len(torch.unique(index // per_page)) <= parameter < len(torch.unique(index % total))
        else:
            assert len(torch.unique(index // per_region)) == parameter


@pytest.mark.parametrize("argv, message", [
    (["--gib", "0"], "--gib must be >= 1, got 0"),
    (["--row-bytes", "384"], "--row-bytes must be a multiple of 4 that divides 4096, got 384"),
    (["--row-bytes", "2"], "--row-bytes must be a multiple of 4"),
    (["--rows", "64"], "--rows must lie in 128..16777216"),
    (["--gib", "1", "--rows", "2097153"], "--rows must lie in 128..2097152"),
])
def test_bad_arguments_are_refused_in_one_line(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        gather_probe.main([*argv, "--out", str(tmp_path / "probe.json")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and f"error: {message}" in err, err
    assert not (tmp_path / "probe.json").exists()


def test_an_out_it_cannot_write_is_refused_before_a_gpu_is_asked_for(tmp_path, capsys, monkeypatch):
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: asked.append(1) or True)
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as exit_info:
        gather_probe.main(["--gib", "1", "--out", str(tmp_path / "file" / "probe.json")])
    assert exit_info.value.code == 2 and "error: --out" in capsys.readouterr().err and asked == []


def test_without_a_gpu_it_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        gather_probe.main(["--out", str(tmp_path / "probe.json")])
    assert exit_info.value.code == 2 and "needs a CUDA GPU" in capsys.readouterr().err


class FakeEvent:
    """A CUDA event pair whose interval is 1 ms."""

    def __init__(self, enable_timing=True):
        pass

    def record(self):
        pass

    def elapsed_time(self, other):
        return 1.0


def test_each_small_gather_reads_fresh_rows_of_the_next_layer(tmp_path, monkeypatch):
    """A small gather repeated on one index would find its translations cached: every repetition (2 untimed, 10
    timed) draws new rows, 512 MiB further on, as a step's layers follow each other."""
    monkeypatch.setattr(gather_probe, "GIB", 1 << 20)
    monkeypatch.setattr(gather_probe, "LAYER_BYTES", 1 << 20)  # a "layer" of 1 MiB: 8 of them in the buffer
    monkeypatch.setattr(gather_probe, "SMALL_GATHERS", (256,))
    monkeypatch.setattr(gather_probe, "DEVICE", "cpu")
    for name, value in (("is_available", lambda: True), ("synchronize", lambda: None),
                        ("get_device_name", lambda: "fake GPU"), ("Event", FakeEvent)):
        monkeypatch.setattr(torch.cuda, name, value)
    seen = []
    select = torch.index_select

    def recording(rows, dim, index):
        seen.append(index.clone())
        return select(rows, dim, index)

    monkeypatch.setattr(torch, "index_select", recording)
    gather_probe.main(["--gib", "8", "--rows", "1024", "--out", str(tmp_path / "probe.json")])
    small = [index for index in seen if index.numel() == 256]
    layer = (1 << 20) // 512
    assert len(small) == 12 and [int(i.min()) // layer for i in small] == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]
    assert all(int(i.max()) // layer == rep % 8 for rep, i in enumerate(small))
    assert not any(torch.equal(small[0], i) for i in small[1:])


def test_a_run_end_to_end_under_the_simulator(tmp_path, monkeypatch):
    """Fathom's mapped buffer is host memory under the CUDA simulator, and the row ids are drawn on the CPU: the
    whole probe runs, a "GiB" of 1 MiB, each rate the bytes moved a millisecond."""
    monkeypatch.setattr(gather_probe, "GIB", 1 << 20)
    monkeypatch.setattr(gather_probe, "DEVICE", "cpu")
    for name, value in (("is_available", lambda: True), ("synchronize", lambda: None),
                        ("get_device_name", lambda: "fake GPU"), ("Event", FakeEvent)):
        monkeypatch.setattr(torch.cuda, name, value)
    out = tmp_path / "probe.json"
    gather_probe.main(["--gib", "8", "--rows", "1024", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["command"] == f"python -m bench.gather_probe --gib 8 --rows 1024 --out {out}"
    kinds = [(r["pattern"], r["parameter"]) for r in result["results"]]
    assert kinds == [("random", 512), ("random", 4096), ("random", 16384), ("runs", 2), ("runs", 8), ("runs", 32),
                     ("runs", 128), ("pages", 512), ("small", 1024), ("small", 4096), ("small", 16384),
                     ("long read", 1 << 18), ("long read", 1 << 21)]
    gathered = {"random": 1024 * 512, "runs": 1024 * 512, "pages": 1024 * 512}
    for r in result["results"]:
        moved = gathered.get(r["pattern"], r["parameter"] * (512 if r["pattern"] == "small" else 1))
        assert r["GB_per_s"] == pytest.approx((10 if r["pattern"] != "long read" else 3) * moved / 1e-3 / 1e9)
    table = out.with_suffix(".md").read_text()
    assert "| in runs of 8 consecutive rows, at random | 8.000 |" in table
    assert "| a long read (a sum) of 2 GiB | 2.000 |" in table
    assert "| a small gather: 4,096 rows at random | 8.000 |" in table  # a "layer" of 512 MiB > the 8 "GiB" held
