"""python -m bench soak without a GPU: the cache, decoder and graph faked, the GPU memory growing 1 MB a cycle. The
growth it reports is measured between two samples after the first cycle's, so an --every that leaves only one is
refused (it read +0.0 whatever memory did)."""

import json
import sys
import types

import pytest

from bench import soak
from bench.__main__ import main
from tests.cli import refused

torch = pytest.importorskip("torch")


class _GrowingGpu:
    """GPU memory in use: 1 MB more after every cache closed (a leak the soak must report)."""

    total = 80e9

    def __init__(self):
        self.used = 1e9

    def mem_get_info(self):
        return self.total - self.used, self.total


@pytest.fixture
def fake_gpu(monkeypatch):
    gpu = _GrowingGpu()

    class Cache:
        def __init__(self, shape):
            self.shape = shape

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            gpu.used += 1e6

        def append(self, layer, k, v):
            pass

    def fake(name, **members):
        module = types.ModuleType(name)
        module.__dict__.update(members)
        monkeypatch.setitem(sys.modules, name, module)

    fake("fathom.host")
    fake("fathom.host.cache", CacheShape=lambda **shape: types.SimpleNamespace(**shape), HostKVCache=Cache)
    fake("fathom.host.decoder", Decoder=lambda *a, **k: types.SimpleNamespace(run=lambda *a: None),
         DecoderSettings=lambda *a, **k: None)
    fake("fathom.host.graph", StepGraph=lambda *a, **k: (lambda *a: None))
    randn = torch.randn
    monkeypatch.setattr(torch, "randn", lambda *shape, device=None: randn(1))
    monkeypatch.setattr(soak, "require_cuda", lambda command: None)
    monkeypatch.setattr(soak, "_plot", lambda samples, path: path.write_bytes(b""))
    for name, value in (("mem_get_info", gpu.mem_get_info), ("synchronize", lambda: None),
                        ("memory_reserved", lambda: 0), ("memory_allocated", lambda: 0),
                        ("get_device_name", lambda: "fake GPU")):
        monkeypatch.setattr(torch.cuda, name, value)
    return gpu


def test_the_growth_is_measured_between_two_samples_after_the_first_cycle(fake_gpu, tmp_path, capsys):
    main(["soak", "--cycles", "4", "--every", "2", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "soak.json").read_text())
    assert [s["cycle"] for s in result["samples"]] == [0, 2, 4]
    assert result["growth_after_first"]["gpu_used_mb"] == pytest.approx(2.0)  # cycles 2 -> 4 leaked 1 MB each


@pytest.mark.parametrize("argv, message", [
    (["--cycles", "2", "--every", "2"], "--every must lie in 1..1 "),  # one sample after the first: growth 0
    (["--cycles", "100", "--every", "51"], "--every must lie in 1..50 "),
    (["--cycles", "1", "--every", "1"], "--cycles must lie in 2..100000"),
])
def test_an_every_that_leaves_no_growth_to_measure_is_refused(fake_gpu, tmp_path, capsys, argv, message):
    assert message in refused(["soak", *argv, "--out", str(tmp_path)], capsys)
    assert list(tmp_path.iterdir()) == []
