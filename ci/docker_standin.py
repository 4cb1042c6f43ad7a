"""Stand-ins for Flower's images, for a machine that reaches package indexes but no
container registry (this project's CI machines): what tests/deployment/test_docker_engine.py runs
before the compose demo. Test machinery, not part of the tooling: on a machine that can
pull, compose pulls Flower's official images and none of this is used.

``standin`` builds local images named like Flower's official ones -- ``flwr/superlink``,
``flwr/supernode``, ``flwr/superexec`` at the project's Flower version -- from
``docker/standin/Dockerfile`` (Flower's published Dockerfiles, on a Debian 12 base made
with ``debootstrap`` from the machine's own apt mirror and ``docker import``), so that
``docker/compose.yml`` and ``docker/with-tls.yml`` run unchanged. The builds install from
the wheelhouse (``florg_tools.deploy.docker_offline``: the user-facing offline build of the
app image) and get no network. Every stand-in carries the label ``org.florg.standin.inputs``
(a hash of its inputs); one whose label matches is kept, anything else is rebuilt.

Command line (the engine of ``DOCKER_HOST``; see docs/deploy-docker.md)::

    python -m ci.docker_standin standin   # the stand-in images (fills the wheelhouse cache)
    python -m ci.docker_standin all       # docker/wheelhouse/ too (ci/docker_standin.sh)
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
import tempfile
from collections.abc import Callable
from pathlib import Path

from ci.docker_engine import DockerClient, DockerEngineError, remove_tree, unmount_under
from florg_tools.deploy.compose_gen import FLWR_VERSION
from florg_tools.deploy.docker_offline import (
    IMAGE_PYTHON,
    ROOT,
    STAMP,
    DockerOfflineError,
    build_wheelhouse,
    cache_root,
    sync_wheelhouse,
)

__all__ = [
    "DEBIAN_IMAGE",
    "DEBIAN_SUITE",
    "STANDIN_LABEL",
    "STANDIN_PYTHON",
    "DockerOfflineError",
    "debian_mirror",
    "ensure_debian_image",
    "ensure_standins",
    "prepare",
    "standin_images",
]

STANDIN_DOCKERFILE = Path("docker") / "standin" / "Dockerfile"
# The stand-ins' OS and Python: Debian 12 and its python3 (3.11), the project's Python and
# the one the wheelhouse is made for.
DEBIAN_SUITE = "bookworm"
DEBIAN_IMAGE = "florg-standin/debian:bookworm-python3"
DEBOOTSTRAP_INCLUDE = ("python3", "python3-venv", "python3-pip", "ca-certificates")
STANDIN_PYTHON = IMAGE_PYTHON
STANDIN_TARGETS = ("superlink", "supernode", "superexec")
STANDIN_LABEL = "org.florg.standin.inputs"
MIRROR_ENV = "FLORG_DEBIAN_MIRROR"
_FORMAT = 1  # bump when what goes into a stand-in changes (part of every label's hash)

Log = Callable[[str], None]


def _log(message: str) -> None:
    print(f"[docker-standin] {message}", file=sys.stderr, flush=True)


def _digest(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


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
        prog="python -m ci.docker_standin",
        description="Stand-ins for Flower's images on a machine without an image registry "
        "(docs/deploy-docker.md); `all` also fills docker/wheelhouse/.",
    )
    p.add_argument("command", choices=("standin", "all"))
    p.add_argument(
        "--no-python-check",
        action="store_true",
        help="make the wheelhouse with this Python even if it is not the stand-ins' 3.11",
    )
    args = p.parse_args(argv)
    try:
        wheelhouse = build_wheelhouse(check_python=not args.no_python_check)
        if args.command == "all":
            dest = sync_wheelhouse(wheelhouse)
            _log(f"docker/Dockerfile now builds offline from {dest}")
        images = ensure_standins(DockerClient.from_environment(), wheelhouse)
        for image, key in images.items():
            _log(f"{image}: stand-in ({STANDIN_LABEL}={key})")
    except (DockerOfflineError, DockerEngineError, OSError, subprocess.SubprocessError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
