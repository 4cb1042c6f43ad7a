"""Offline builds of the docker compose demo's app image: the wheelhouse
(``build_wheelhouse``, ``sync_wheelhouse``, ``clear_wheelhouse``).

Every package the image builds install (pip, setuptools, the CPU torch wheel, flwr, the
app's dependencies from ``pyproject.toml``) and the packages that carry the offline assets
are fetched on the host by its own pip, with its own index, find-links and CA bundle, into a
cache folder keyed by what it holds (``cache_root()``: ``$FLORG_DOCKER_CACHE``, else
``~/.cache/florg-docker``), then linked into ``docker/wheelhouse/``; ``docker/Dockerfile``
then installs from that folder only, through a BuildKit bind mount no layer keeps.

    python -m florg_tools.deploy.docker_offline wheelhouse   # fill docker/wheelhouse/
    python -m florg_tools.deploy.docker_offline clear        # empty docker/wheelhouse/
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import tomllib
from collections.abc import Callable
from pathlib import Path

from florg_tools.assets import Source, download, select_assets
from florg_tools.deploy.compose_gen import FLWR_VERSION

__all__ = [
    "CACHE_ENV",
    "IMAGE_PYTHON",
    "DockerOfflineError",
    "build_wheelhouse",
    "cache_root",
    "clear_wheelhouse",
    "sync_wheelhouse",
    "wheel_requirements",
    "wheelhouse_has_wheels",
]

ROOT = Path(__file__).resolve().parents[2]
WHEELHOUSE_DIR = Path("docker") / "wheelhouse"
KEEP_IN_WHEELHOUSE = frozenset({"README.md"})
STAMP = ".florg-wheelhouse.json"
# The Python of the images that install the wheels: the project's Python, 3.11, which is
# also Debian 12's python3 (the stand-in images, ci/docker_standin.py). Wheels of compiled
# packages are made for the Python that runs pip, so build_wheelhouse checks it.
IMAGE_PYTHON = (3, 11)
CACHE_ENV = "FLORG_DOCKER_CACHE"
_FORMAT = 1  # bump when what goes into a wheelhouse changes

Log = Callable[[str], None]


class DockerOfflineError(RuntimeError):
    """An offline input cannot be made; the message says why."""


def cache_root() -> Path:
    """``$FLORG_DOCKER_CACHE``, else ``~/.cache/florg-docker``: the wheelhouses (and, on
    the test machines, the private engine's images, ci/docker_engine/)."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser().resolve() if env else Path.home() / ".cache" / "florg-docker"


def _log(message: str) -> None:
    print(f"[docker-offline] {message}", file=sys.stderr, flush=True)


def _digest(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- wheelhouse


def dockerfile_arg(name: str, root: Path = ROOT) -> str:
    """The default of ``ARG name=...`` in docker/Dockerfile."""
    text = (root / "docker" / "Dockerfile").read_text(encoding="utf-8")
    match = re.search(rf"^ARG {re.escape(name)}=(\S+)\s*$", text, re.MULTILINE)
    if not match:
        raise DockerOfflineError(f"docker/Dockerfile has no ARG {name}=...")
    return match.group(1)


def wheel_requirements(root: Path = ROOT) -> list[str]:
    """What the image builds install: pip and setuptools (the stand-in venv; the build
    backend of this project), torch at the Dockerfile's pin, flwr at the images' version
    with its ``dp`` extra (dp-accounting, for ``dp=central``), and every dependency of
    pyproject.toml but torch and flwr (as docker/Dockerfile)."""
    deps = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    rest = [d for d in deps if re.split(r"[\[<>=!~; ]", d)[0] not in ("torch", "flwr")]
    torch = dockerfile_arg("TORCH_VERSION", root)
    return ["pip", "setuptools>=68", f"torch=={torch}", f"flwr[dp]=={FLWR_VERSION}", *rest]


def _asset_sources() -> list[Source]:
    """The pinned packages of the default assets (what the image's fetch downloads)."""
    sources: dict[str, Source] = {}
    for asset in select_assets():
        sources.setdefault(asset.source.filename, asset.source)
    return list(sources.values())


def wheelhouse_key(root: Path = ROOT) -> str:
    sources = [(s.filename, s.sha256) for s in _asset_sources()]
    return _digest(
        {
            "format": _FORMAT,
            "requirements": wheel_requirements(root),
            "assets": sources,
            "python": f"cp{sys.version_info[0]}{sys.version_info[1]}",
            "platform": sysconfig.get_platform(),
        }
    )


def build_wheelhouse(
    root: Path = ROOT, *, check_python: bool = True, log: Log = _log, timeout: float = 1800
) -> Path:
    """The cached wheelhouse for this checkout (made with the host's pip when missing):
    ``<cache>/wheelhouse/<key>``, complete once its stamp exists (written last; a partial
    folder is never used)."""
    if check_python and sys.version_info[:2] != IMAGE_PYTHON:
        raise DockerOfflineError(
            "the wheelhouse holds wheels for the Python running this command "
            f"({sys.version_info[0]}.{sys.version_info[1]}); the images run Python "
            f"{IMAGE_PYTHON[0]}.{IMAGE_PYTHON[1]}: run it with that Python "
            "(the project's .venv), or pass --no-python-check for another base image"
        )
    key = wheelhouse_key(root)
    final = cache_root() / "wheelhouse" / key
    if (final / STAMP).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{key}.partial-", dir=final.parent))
    try:
        reqs = wheel_requirements(root)
        log(f"wheelhouse {key}: pip wheel {' '.join(reqs)}")
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-input", "--progress-bar", "off"]
        proc = subprocess.run(
            [*cmd, "--wheel-dir", str(tmp), *reqs],
            capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        if proc.returncode != 0:
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-20:])
            raise DockerOfflineError(f"pip wheel failed ({proc.returncode}):\n{tail}")
        for source in _asset_sources():
            log(f"wheelhouse {key}: asset package {source.filename}")
            download(source, tmp)
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
        if not any(name.startswith("torch-") for name in files):
            raise DockerOfflineError(f"pip wheel left no torch wheel in {tmp}")
        (tmp / STAMP).write_text(json.dumps({"key": key, "files": files}, indent=1) + "\n")
        try:
            tmp.rename(final)
        except OSError:  # another run finished the same wheelhouse first
            if not (final / STAMP).is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"wheelhouse {key}: {len(files)} files in {final}")
    return final


def sync_wheelhouse(src: Path, root: Path = ROOT) -> Path:
    """Make ``docker/wheelhouse/`` hold exactly the files of ``src`` (hard links where
    possible) besides its README.md."""
    dest = root / WHEELHOUSE_DIR
    dest.mkdir(parents=True, exist_ok=True)
    want = {p.name: p for p in src.iterdir() if p.is_file() and not p.name.startswith(".")}
    for path in dest.iterdir():
        if path.name in KEEP_IN_WHEELHOUSE:
            continue
        same = path.name in want and path.is_file() and not path.is_symlink()
        if same and path.stat().st_size == want[path.name].stat().st_size:
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    for name, path in want.items():
        target = dest / name
        if target.exists():
            continue
        try:
            os.link(path, target)
        except OSError:
            shutil.copy2(path, target)
    return dest


def clear_wheelhouse(root: Path = ROOT) -> None:
    """Leave only README.md in ``docker/wheelhouse/`` (online builds again)."""
    dest = root / WHEELHOUSE_DIR
    if not dest.is_dir():
        return
    for path in dest.iterdir():
        if path.name in KEEP_IN_WHEELHOUSE:
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def wheelhouse_has_wheels(root: Path = ROOT) -> bool:
    return any((root / WHEELHOUSE_DIR).glob("*.whl"))


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m florg_tools.deploy.docker_offline",
        description="The wheelhouse of the docker compose demo's offline app image build "
        "(docs/deploy-docker.md): fill docker/wheelhouse/, or empty it again.",
    )
    p.add_argument("command", choices=("wheelhouse", "clear"))
    p.add_argument(
        "--no-python-check",
        action="store_true",
        help=f"make the wheelhouse with this Python even if it is not the images' "
        f"{IMAGE_PYTHON[0]}.{IMAGE_PYTHON[1]}",
    )
    args = p.parse_args(argv)
    try:
        if args.command == "clear":
            clear_wheelhouse()
            return 0
        wheelhouse = build_wheelhouse(check_python=not args.no_python_check)
        dest = sync_wheelhouse(wheelhouse)
        _log(f"docker/Dockerfile now builds offline from {dest}")
    except (DockerOfflineError, OSError, subprocess.SubprocessError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
