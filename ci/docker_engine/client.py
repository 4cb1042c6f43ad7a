"""The host side of the private engine: the ``docker`` client that builds with BuildKit,
the compose tool, what a private ``dockerd`` needs here, and a client bound to an engine.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

# The one cache folder of the docker tooling (``$FLORG_DOCKER_CACHE``): the wheelhouses
# (florg_tools) and this engine's data-roots; re-exported from here for the test machinery.
from florg_tools.deploy.docker_offline import CACHE_ENV, cache_root

__all__ = [
    "CACHE_ENV",
    "DockerClient",
    "DockerEngineError",
    "cache_root",
    "compose_command",
    "docker_cli",
    "engine_prerequisites",
]

_REQUIRED_BINARIES = ("dockerd", "containerd", "runc", "docker-proxy", "unshare", "nsenter", "ip")


class DockerEngineError(RuntimeError):
    """The private engine cannot be started or used; the message says why."""


def _client_version(cli: str) -> tuple[int, ...] | None:
    try:
        proc = subprocess.run(
            [cli, "version", "--format", "{{.Client.Version}}"],
            capture_output=True, text=True, timeout=30,
            env={**os.environ, "DOCKER_HOST": "unix:///nonexistent"},
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = (proc.stdout or "").strip().split("+")[0].split("-")[0]
    try:
        return tuple(int(p) for p in text.split(".")[:2])
    except ValueError:
        return None


def docker_cli() -> str:
    """A ``docker`` client that builds with BuildKit (``RUN --mount``): one with the buildx
    plugin, or a classic client older than 23 (those build with BuildKit themselves when
    ``DOCKER_BUILDKIT=1``). The first such of ``docker`` on PATH and ``/usr/bin/docker``
    (Debian's docker.io package)."""
    seen: list[str] = []
    for cand in (shutil.which("docker"), "/usr/bin/docker"):
        if not cand or cand in seen or not os.access(cand, os.X_OK):
            continue
        seen.append(cand)
        buildx = subprocess.run([cand, "buildx", "version"], capture_output=True, timeout=30)
        if buildx.returncode == 0:
            return cand
        version = _client_version(cand)
        if version is not None and version < (23,):
            return cand
    raise DockerEngineError(
        "no docker client that can build with BuildKit: "
        + (", ".join(seen) or "no docker found")
        + " (need the buildx plugin, or Debian's docker.io client: apt-get install docker.io)"
    )


def compose_command(docker: str) -> list[str]:
    """``docker compose`` when the client has the plugin, else ``docker-compose``."""
    probe = subprocess.run([docker, "compose", "version"], capture_output=True, timeout=30)
    if probe.returncode == 0:
        return [docker, "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise DockerEngineError("no compose tool: need `docker compose` or docker-compose")


def engine_prerequisites() -> list[str]:
    """Why a private engine cannot start here (empty when it can)."""
    problems = []
    if os.geteuid() != 0:
        problems.append(f"dockerd needs root (this process runs as uid {os.geteuid()})")
    missing = [b for b in _REQUIRED_BINARIES if shutil.which(b) is None]
    if missing:
        problems.append(
            "missing " + ", ".join(missing) + " (apt-get install docker.io iproute2 util-linux)"
        )
    if not problems:
        probe = subprocess.run(
            ["unshare", "--net", "true"], capture_output=True, text=True, timeout=30
        )
        if probe.returncode != 0:
            problems.append(
                "cannot create a network namespace (unshare --net): " + probe.stderr.strip()
            )
    return problems


@dataclass(frozen=True)
class DockerClient:
    """A ``docker`` client binary and the environment that points it at an engine."""

    cli: str
    env: dict[str, str]

    @classmethod
    def from_environment(cls) -> DockerClient:
        """The engine of this shell (``DOCKER_HOST`` or the default socket), BuildKit on."""
        env = {**os.environ, "DOCKER_BUILDKIT": "1", "COMPOSE_DOCKER_CLI_BUILD": "1"}
        return cls(docker_cli(), env)

    def run(
        self, *args: str, check: bool = True, timeout: float = 120.0, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [self.cli, *args], capture_output=True, text=True, env=self.env,
            timeout=timeout, input=input,
        )  # fmt: skip
        if check and proc.returncode != 0:
            raise DockerEngineError(
                f"docker {' '.join(args)[:300]} failed ({proc.returncode}):\n"
                f"{proc.stderr[-3000:]}\n{proc.stdout[-2000:]}"
            )
        return proc
