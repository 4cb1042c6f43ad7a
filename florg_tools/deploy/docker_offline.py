"""The docker compose demo on a machine that reaches package indexes but no container
registry (this project's CI machines): the wheelhouse and the stand-in Flower images.

* ``wheelhouse``: every package the image builds install -- pip, setuptools, torch (the
  CPU wheel pip finds through its configured find-links), flwr, the app's dependencies
  from ``pyproject.toml`` -- and the packages that carry the offline assets, fetched on
  the HOST by its own pip (its index, find-links and CA bundle configuration apply), into
  a cache folder keyed by what it holds, then linked into ``docker/wheelhouse/``. With
  wheels there, ``docker/Dockerfile`` installs from that folder only, through a BuildKit
  bind mount that no image layer keeps; the builds need no network and get none. Neither
  the torch wheel nor a CA bundle ends up in an image.
* ``standin``: local images named like Flower's official ones -- ``flwr/superlink``,
  ``flwr/supernode``, ``flwr/superexec`` at the project's Flower version -- built from
  ``docker/standin/Dockerfile`` (Flower's published Dockerfiles, on a Debian 12 base made
  with ``debootstrap`` from the machine's own apt mirror and ``docker import``), so that
  ``docker/compose.yml`` and ``docker/with-tls.yml`` run unchanged. Every stand-in carries
  the label ``org.florg.standin.inputs`` (a hash of its inputs); one whose label matches
  is kept, anything else is rebuilt. On a machine that can pull, none of this is used.

Command line (the engine of ``DOCKER_HOST``; see docs/deploy-docker.md)::

    python -m florg_tools.deploy.docker_offline wheelhouse   # fill docker/wheelhouse/
    python -m florg_tools.deploy.docker_offline standin      # the stand-in images
    python -m florg_tools.deploy.docker_offline all          # both (scripts/docker_standin.sh)
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
from florg_tools.deploy.docker_engine import (
    DockerClient,
    DockerEngineError,
    cache_root,
    remove_tree,
    unmount_under,
)

__all__ = [
    "DEBIAN_IMAGE",
    "DEBIAN_SUITE",
    "STANDIN_LABEL",
    "STANDIN_PYTHON",
    "DockerOfflineError",
    "build_wheelhouse",
    "clear_wheelhouse",
    "debian_mirror",
    "ensure_debian_image",
    "ensure_standins",
    "standin_images",
    "sync_wheelhouse",
    "wheel_requirements",
]

ROOT = Path(__file__).resolve().parents[2]
WHEELHOUSE_DIR = Path("docker") / "wheelhouse"
STANDIN_DOCKERFILE = Path("docker") / "standin" / "Dockerfile"
KEEP_IN_WHEELHOUSE = frozenset({"README.md"})
STAMP = ".florg-wheelhouse.json"
# The stand-ins' OS and Python: Debian 12 and its python3 (3.11), the project's Python.
DEBIAN_SUITE = "bookworm"
DEBIAN_IMAGE = "florg-standin/debian:bookworm-python3"
DEBOOTSTRAP_INCLUDE = ("python3", "python3-venv", "python3-pip", "ca-certificates")
STANDIN_PYTHON = (3, 11)
STANDIN_TARGETS = ("superlink", "supernode", "superexec")
STANDIN_LABEL = "org.florg.standin.inputs"
MIRROR_ENV = "FLORG_DEBIAN_MIRROR"
_FORMAT = 1  # bump when what goes into a wheelhouse or a stand-in changes

Log = Callable[[str], None]


class DockerOfflineError(RuntimeError):
    """An offline input cannot be made; the message says why."""


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
    if check_python and sys.version_info[:2] != STANDIN_PYTHON:
        raise DockerOfflineError(
            "the wheelhouse holds wheels for the Python running this command "
            f"({sys.version_info[0]}.{sys.version_info[1]}); the stand-in images run Python "
            f"{STANDIN_PYTHON[0]}.{STANDIN_PYTHON[1]} (Debian 12): run it with that Python "
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


# --------------------------------------------------------------------------- Debian base


def _deb822_stanzas(text: str) -> list[dict[str, str]]:
    stanzas, current, key = [], {}, None
    for line in text.splitlines():
        if not line.strip():
            if current:
                stanzas.append(current)
            current, key = {}, None
        elif line.startswith("#"):
            continue
        elif line[0].isspace() and key:
            current[key] += " " + line.strip()
        elif ":" in line:
            key, _, value = line.partition(":")
            key = key.strip().lower()
            current[key] = value.strip()
    if current:
        stanzas.append(current)
    return stanzas


def debian_mirror(suite: str = DEBIAN_SUITE, apt_dir: Path = Path("/etc/apt")) -> str:
    """The Debian mirror this machine's apt uses for ``suite`` (``$FLORG_DEBIAN_MIRROR``
    overrides): read from sources.list and sources.list.d/*.list|*.sources."""
    if os.environ.get(MIRROR_ENV):
        return os.environ[MIRROR_ENV]
    files = [apt_dir / "sources.list"]
    parts = apt_dir / "sources.list.d"
    if parts.is_dir():
        files += sorted(p for p in parts.iterdir() if p.suffix in (".list", ".sources"))
    for path in files:
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        if path.suffix == ".sources":
            for st in _deb822_stanzas(text):
                if st.get("enabled", "yes").lower() == "no":
                    continue
                if "deb" in st.get("types", "").split() and suite in st.get("suites", "").split():
                    uris = st.get("uris", "").split()
                    if uris:
                        return uris[0].rstrip("/")
        else:
            for line in text.splitlines():
                words = re.sub(r"\[[^\]]*\]", " ", line.split("#", 1)[0]).split()
                if len(words) >= 3 and words[0] == "deb" and words[2] == suite:
                    return words[1].rstrip("/")
    raise DockerOfflineError(
        f"no apt source for Debian {suite} in {apt_dir} (set {MIRROR_ENV}=URL of a mirror)"
    )


def image_label(client: DockerClient, image: str, label: str = STANDIN_LABEL) -> str | None:
    """The value of ``label`` on a local image; None when the image is missing."""
    proc = client.run(
        "image", "inspect", "--format", f'{{{{ index .Config.Labels "{label}" }}}}', image,
        check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        return None
    value = proc.stdout.strip()
    return None if value in ("", "<no value>") else value


def _image_id(client: DockerClient, image: str) -> str:
    return client.run("image", "inspect", "--format", "{{.Id}}", image).stdout.strip()


def ensure_debian_image(
    client: DockerClient, *, mirror: str | None = None, log: Log = _log, timeout: float = 1200
) -> str:
    """``florg-standin/debian:bookworm-python3`` (debootstrap minbase + python3,
    python3-venv, python3-pip, ca-certificates; apt caches and the host's resolv.conf
    removed; ``docker import``); made when missing. Returns its image id."""
    key = _digest({"format": _FORMAT, "suite": DEBIAN_SUITE, "include": DEBOOTSTRAP_INCLUDE})
    if image_label(client, DEBIAN_IMAGE) == key:
        return _image_id(client, DEBIAN_IMAGE)
    if shutil.which("debootstrap") is None:
        raise DockerOfflineError("debootstrap is missing (apt-get install debootstrap)")
    mirror = mirror or debian_mirror()
    work = cache_root() / "tmp"
    work.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="debootstrap-", dir=work))
    rootfs = tmp / "rootfs"
    try:
        log(
            f"debootstrap {DEBIAN_SUITE} (minbase + {', '.join(DEBOOTSTRAP_INCLUDE)}) from {mirror}"
        )
        proc = subprocess.run(
            [
                "debootstrap", "--variant=minbase", f"--include={','.join(DEBOOTSTRAP_INCLUDE)}",
                DEBIAN_SUITE, str(rootfs), mirror,
            ],
            capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-20:])
            raise DockerOfflineError(f"debootstrap failed ({proc.returncode}):\n{tail}")
        left = unmount_under(rootfs)
        if left:
            raise DockerOfflineError(f"debootstrap left mounts: {left[:3]}")
        apt_caches = ("var/cache/apt/archives/*.deb", "var/cache/apt/*.bin", "var/lib/apt/lists/*")
        for pattern in apt_caches:
            for path in rootfs.glob(pattern):
                if path.is_file() or path.is_symlink():
                    path.unlink()
        (rootfs / "etc" / "resolv.conf").write_text("")  # the host's resolver: not ours to ship
        (rootfs / "etc" / "hostname").write_text("localhost\n")
        log(f"docker import -> {DEBIAN_IMAGE}")
        tar = subprocess.Popen(
            ["tar", "--numeric-owner", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE
        )
        try:
            imported = subprocess.run(
                [
                    client.cli, "import",
                    "--change", f"LABEL {STANDIN_LABEL}={key}",
                    "--change", 'CMD ["/bin/bash"]',
                    "-", DEBIAN_IMAGE,
                ],
                stdin=tar.stdout, capture_output=True, text=True, env=client.env, timeout=timeout,
            )  # fmt: skip
        finally:
            if tar.stdout is not None:
                tar.stdout.close()
            tar.wait(timeout=60)
        if imported.returncode != 0 or tar.returncode != 0:
            raise DockerOfflineError(
                f"docker import failed ({imported.returncode}, tar {tar.returncode}): "
                f"{imported.stderr[-2000:]}"
            )
    finally:
        remove_tree(tmp)
    return _image_id(client, DEBIAN_IMAGE)


# --------------------------------------------------------------------------- stand-ins


def standin_images() -> dict[str, str]:
    """``{target: image}``: ``superlink -> flwr/superlink:<FLWR_VERSION>``, ..."""
    return {t: f"flwr/{t}:{FLWR_VERSION}" for t in STANDIN_TARGETS}


def ensure_standins(
    client: DockerClient,
    wheelhouse: Path,
    root: Path = ROOT,
    *,
    log: Log = _log,
    timeout: float = 1800,
) -> dict[str, str]:
    """Build every stand-in whose label does not match its inputs (the Dockerfile, the
    Debian image, the wheelhouse, the Flower version), from ``wheelhouse`` (the build
    context, bind-mounted by the pip step only; no network needed). ``{image: key}``."""
    debian_id = ensure_debian_image(client, log=log)
    dockerfile = root / STANDIN_DOCKERFILE
    stamp = wheelhouse / STAMP
    key = _digest(
        {
            "format": _FORMAT,
            "dockerfile": dockerfile.read_text(encoding="utf-8"),
            "debian": debian_id,
            "wheelhouse": stamp.read_text() if stamp.is_file() else wheelhouse.name,
            "flwr": FLWR_VERSION,
        }
    )
    built = {}
    for target, image in standin_images().items():
        if image_label(client, image) == key:
            built[image] = key
            continue
        log(f"build {image} (stand-in; target {target})")
        client.run(
            "build", "--progress=plain", "-f", str(dockerfile), "--target", target,
            "-t", image, "--label", f"{STANDIN_LABEL}={key}",
            "--build-arg", f"FLWR_VERSION={FLWR_VERSION}",
            "--build-arg", f"DEBIAN_IMAGE={DEBIAN_IMAGE}",
            str(wheelhouse), timeout=timeout,
        )  # fmt: skip
        if image_label(client, image) != key:
            raise DockerOfflineError(f"{image}: built, but its label is not {key}")
        built[image] = key
    return built


def prepare(client: DockerClient, root: Path = ROOT, *, log: Log = _log) -> dict[str, str]:
    """Wheelhouse (cached, linked into docker/wheelhouse/) and the stand-in images."""
    wheelhouse = build_wheelhouse(root, log=log)
    sync_wheelhouse(wheelhouse, root)
    return ensure_standins(client, wheelhouse, root, log=log)


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m florg_tools.deploy.docker_offline",
        description="Offline inputs of the docker compose demo: the wheelhouse and the "
        "stand-ins for Flower's images (docs/deploy-docker.md).",
    )
    p.add_argument("command", choices=("wheelhouse", "standin", "all", "clear"))
    p.add_argument(
        "--no-python-check",
        action="store_true",
        help="make the wheelhouse with this Python even if it is not the stand-ins' 3.11",
    )
    args = p.parse_args(argv)
    try:
        if args.command == "clear":
            clear_wheelhouse()
            return 0
        wheelhouse = build_wheelhouse(check_python=not args.no_python_check)
        if args.command in ("wheelhouse", "all"):
            dest = sync_wheelhouse(wheelhouse)
            _log(f"docker/Dockerfile now builds offline from {dest}")
        if args.command in ("standin", "all"):
            images = ensure_standins(DockerClient.from_environment(), wheelhouse)
            for image, key in images.items():
                _log(f"{image}: stand-in ({STANDIN_LABEL}={key})")
    except (DockerOfflineError, DockerEngineError, OSError, subprocess.SubprocessError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
