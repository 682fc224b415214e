import pytest

from bench import capture as bench_capture
from bench import artifacts, corpora, fidelity, models


@pytest.fixture
def nothing_loads(monkeypatch, tmp_path):
    """Every model / corpus / capture load or build fails the test if reached; the cache folder is empty. Returns
    a tmp folder (the cache is its ``cache``, never made by a refused command)."""

    def reached(*args, **kwargs):
        raise AssertionError("the arguments must be refused before anything is loaded or built")

    for module, name in ((models, "load"), (models, "ensure"), (corpora, "load"), (corpora, "ensure"),
                         (bench_capture, "load_capture"), (fidelity, "generate")):
        monkeypatch.setattr(module, name, reached)
    monkeypatch.setenv(artifacts.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path
