"""python -m bench.pinned_probe without a GPU: the CUDA driver, numba and the GPU work faked, the allocations 1 MiB
a GiB. An --out it cannot write is refused before any pinning (it was found only when the JSON was written, after
the measurements), the rates are GB/s of the bytes pinned (they were GiB/s under a GB/s name), and the command is
recorded as it ran."""

import json
import sys
import types

import pytest

from bench import pinned_probe

torch = pytest.importorskip("torch")


@pytest.fixture
def fake_cuda(monkeypatch):
    """Every driver call succeeds; what pinning reached is counted in ``calls``."""
    calls = []

    def ok(*values):
        def call(*args):
            calls.append(args)
            return (0, *values)
        return call

    driver = types.SimpleNamespace(
        cuMemHostAlloc=ok(4096), cuMemsetD8=ok(), cuMemHostGetDevicePointer=ok(4096), cuCtxSynchronize=ok(),
        cuMemFreeHost=ok(), cuMemHostRegister=ok(), cuMemHostUnregister=ok(), CU_MEMHOSTALLOC_DEVICEMAP=1,
        CU_MEMHOSTALLOC_PORTABLE=2, CU_MEMHOSTREGISTER_DEVICEMAP=1, CU_MEMHOSTREGISTER_PORTABLE=2)
    for name, module in (("cuda", types.ModuleType("cuda")), ("cuda.bindings", types.ModuleType("cuda.bindings")),
                         ("numba", types.ModuleType("numba"))):
        monkeypatch.setitem(sys.modules, name, module)
    sys.modules["cuda.bindings"].driver = driver
    sys.modules["numba"].cuda = types.SimpleNamespace(current_context=lambda: None)
    randn, zeros = torch.randn, torch.zeros
    monkeypatch.setattr(torch, "randn", lambda *shape, device=None, dtype=None: randn(2, 2))
    monkeypatch.setattr(torch, "zeros", lambda *shape, device=None: zeros(*shape))
    for name, value in (("is_available", lambda: True), ("synchronize", lambda: None),
                        ("get_device_name", lambda: "fake GPU")):
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(pinned_probe, "GIB", 1 << 20)  # a "GiB" of 1 MiB: the probe's own arithmetic, in seconds
    return calls


def test_an_out_it_cannot_write_is_refused_before_anything_is_pinned(fake_cuda, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as exit_info:
        pinned_probe.main(["--gib", "1", "--out", str(tmp_path / "file" / "probe.json")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "error: --out" in err and "cannot write there" in err, err
    assert fake_cuda == []  # no driver call: refused before the pinning


def test_the_rates_are_gb_per_second_of_the_bytes_pinned_and_the_command_is_recorded(fake_cuda, tmp_path):
    out = tmp_path / "a folder" / "probe.json"
    pinned_probe.main(["--gib", "2", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["command"] == f"python -m bench.pinned_probe --gib 2 --out '{out}'"
    bytes_pinned = 2 * pinned_probe.GIB
    for way in ("hostalloc+memset", "hostalloc", "register t1", "register t16", "register t16 c8"):
        record = result[way]
        seconds = sum(v for k, v in record.items() if k.endswith("_s") and k not in ("free_s", "GB_per_s"))
        assert record["GB_per_s"] == pytest.approx(bytes_pinned / 1e9 / seconds)
