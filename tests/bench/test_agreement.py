"""The agreement bench on a tiny random Llama (no download): the batched teacher-forced path equals the step
path through FathomCache for every method, dense against dense and methods that read everything agree on every
step, the crossing is interpolated as documented, and bad arguments are refused before any model is loaded."""

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from bench import agreement, models  # noqa: E402
from bench.capture import capture  # noqa: E402
from bench.decoding import MethodSpec  # noqa: E402
from fathom.calibration import calibrate  # noqa: E402
from fathom.selection import Selection  # noqa: E402
from tests.cli import refused  # noqa: E402
from tests.tiny_models import tiny_llama  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # 5.24 renames generate's past_key_values to cache

CONTEXT, STEPS, K, VOCAB = 160, 24, 8, 97  # VOCAB: tiny_llama's


@pytest.fixture(scope="module")
def tiny():
    """A tiny Llama (d = 16, GQA 2:1), a prompt, its dense continuation, and a calibration on another prompt."""
    model = tiny_llama()
    rng = np.random.default_rng(0)
    ids = rng.integers(1, VOCAB, CONTEXT)
    calibration_ids = torch.as_tensor(rng.integers(1, VOCAB, 256))[None]
    return model, ids, calibrate(capture(model, calibration_ids, positions=64))


def test_batched_path_equals_the_step_path_through_fathomcache_for_every_method(tiny, tmp_path):
    model, ids, calibration = tiny
    path = tmp_path / "tiny.calibration.npz"
    calibration.save(path)
    prefix, teacher = agreement.dense_continuation(model, ids, STEPS)
    for text in ("dense", "oracle", "fathom@12", "fathom@24", "fathom-rotated@16", "sparq@17", "double-sparsity@17",
                 "loki@17", "thumbnail", "landmark"):
        spec = MethodSpec.parse(text, head_dim=16)
        attention = agreement.TeacherAttention(spec.method_at(16), Selection(k=K), calibration, [0, 1])
        batched = agreement.batched_logits(model, prefix, ids[-1], teacher, attention)
        step = agreement.step_logits(model, ids, teacher, spec, K, path)
        np.testing.assert_allclose(batched, step, rtol=1e-4, atol=1e-4, err_msg=text)
        np.testing.assert_array_equal(batched.argmax(-1), step.argmax(-1), err_msg=text)


@pytest.mark.gpu
def test_on_a_gpu_the_step_path_decodes_on_the_offloaded_backend_as_the_reference_does(tiny, tmp_path):
    """``--device cuda --path step`` (FATHOM_GPU=1): the model in bf16 on the GPU, each method's FathomCache on the
    offloaded backend (the GPU kernels, bf16 rows in pinned host memory) against the same cache on the reference
    backend: the same greedy token at every step, logits within bf16 rounding."""
    model, ids, calibration = tiny
    path = tmp_path / "tiny.calibration.npz"
    calibration.save(path)
    model = copy.deepcopy(model).to("cuda", torch.bfloat16)
    _, teacher = agreement.dense_continuation(model, ids, STEPS)
    for text in ("dense", "fathom@24", "fathom-rotated@16", "sparq@17"):
        spec = MethodSpec.parse(text, head_dim=16)
        offloaded = agreement.step_logits(model, ids, teacher, spec, K, path)
        reference = agreement.step_logits(model, ids, teacher, spec, K, path, backend="reference")
        assert offloaded.shape == (STEPS, VOCAB) and np.isfinite(offloaded).all(), text
        np.testing.assert_array_equal(offloaded.argmax(-1), reference.argmax(-1), err_msg=text)
        np.testing.assert_allclose(offloaded, reference, rtol=0, atol=0.05 * np.abs(reference).max(), err_msg=text)


def test_sparse_methods_change_the_logits_at_a_small_k(tiny):
    """Not a vacuous equality: at k = 8 of 160+ tokens a scan method's logits differ from dense."""
    model, ids, calibration = tiny
    prefix, teacher = agreement.dense_continuation(model, ids, STEPS)
    logits = {text: agreement.batched_logits(model, prefix, ids[-1], teacher, agreement.TeacherAttention(
        MethodSpec.parse(text, 16).method_at(16), Selection(k=K), calibration, [0, 1]))
        for text in ("dense", "sparq@17")}
    assert np.abs(logits["dense"] - logits["sparq@17"]).max() > 1e-3


def test_dense_and_methods_reading_everything_agree_on_every_step(tiny):
    model, ids, _ = tiny
    specs = [MethodSpec.parse(t, 16) for t in ("dense", "oracle", "fathom@68")]  # 68 = 16 channels · 4.25
    results = agreement.measure(model, [ids, ids[::-1].copy()], STEPS, specs, k=CONTEXT + STEPS, calibration=None)
    for label, result in results.items():
        assert np.array(result["agree"]).shape == (2, STEPS)
        assert np.array(result["agree"]).all(), label
    assert results["fathom@68"]["bits_read"] == [68.0, 68.0]


def test_crossing_is_interpolated_in_log2_bits_and_says_when_it_cannot():
    curve = [(32, 0.80), (48, 0.86), (64, 0.90), (92, 0.93), (136, 0.95)]
    bits, how = agreement.bits_to_reach(curve, 0.92)
    assert how == "interpolated" and bits == pytest.approx(2 ** (np.log2(64) + (2 / 3) * np.log2(92 / 64)))
    assert agreement.bits_to_reach(curve, 0.5) == (32, "at most")
    assert agreement.bits_to_reach(curve, 0.99) == (None, "not reached")
    non_monotone = [(32, 0.9), (48, 0.85), (64, 0.95)]
    assert agreement.bits_to_reach(non_monotone, 0.92)[0] == pytest.approx(2 ** (np.log2(48) + 0.7 * np.log2(64 / 48)))


def test_method_grid_keeps_the_channel_fractions_at_d_64_and_d_128():
    grid64 = agreement.method_grid(64, "raw")
    assert {"sparq@34", "sparq@68", "sparq@136", "loki@34", "double-sparsity@68"} <= set(grid64)
    assert not any(label.startswith("fathom-rotated") for label in grid64)
    grid128 = agreement.method_grid(128, "rotated")
    assert {"fathom-rotated@92", "fathom@92", "loki@68", "loki@136"} <= set(grid128)
    assert "sparq@34" not in grid128


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps"),
    (["--windows", "0"], "--windows"),
    (["--context", "100"], "--context"),
    (["--model", "nope"], "--model"),
    (["-k", "0"], "-k"),
    (["--methods", "sparq@70"], "r·4.25"),
    (["--methods", "oracle@12"], "reads no budget"),
    (["--methods", "dense", "dense"], "more than once"),
    (["--calibration", "/nonexistent.npz"], "--calibration"),
    (["--device", "cuda"], "--device cuda needs --path step"),
])
def test_bad_arguments_are_refused_before_any_model_load(monkeypatch, capsys, argv, message):
    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(models, "load", no_load)
    assert message in refused(["agreement", *argv], capsys)
