"""A private Docker engine for the compose demo's test (test machinery, not part of the
tooling): its own ``dockerd`` (and the ``containerd`` it starts) in its OWN network
namespace, with its own data-root, exec-root, socket and config, started and stopped by
pid, and never outliving the process that started it (``engine``'s docstring).

Why a network namespace: the engine's network namespace has only a loopback interface, so
the containers (on the compose project's bridge network inside it), the builds and the
ports published on ``127.0.0.1`` can reach each other and that loopback, and nothing
else: no packet can leave the machine, whatever a container tries, and nothing here can
clash with another engine, port 8000 or a bridge of the host. The host reaches the
engine through its unix socket (a file); a host command that must dial the published
ports runs in the namespace (``nsenter --net=/proc/PID/ns/net``, :meth:`PrivateDockerd.netns`).
``--iptables=false --ip-masq=false --ip-forward=false``: the engine touches no firewall
rule and no sysctl.

Storage: ``overlay2`` where the kernel and file system allow it, else ``vfs`` (every
layer a full copy: slow and large, but it works anywhere).

The data-root (images, build cache) can be a stable folder, so that a second run on the
same machine reuses the images: :func:`cached_data_root` gives
``~/.cache/florg-docker/engine-<driver>`` (``$FLORG_DOCKER_CACHE`` moves it), locked
against a concurrent user; a data-root the daemon cannot start on is wiped and started
afresh once.

Command line (the same engine by hand; needs root)::

    python -m ci.docker_engine start --state-dir /tmp/florg-dockerd
    #   prints the exports for DOCKER_HOST, PATH, ... and the nsenter prefix
    python -m ci.docker_engine stop --state-dir /tmp/florg-dockerd
"""

# Modules: ``client`` (the docker client and compose tool, prerequisites, DockerClient),
# ``pids`` (processes by pid, mounts), ``engine`` (PrivateDockerd, start_engine, the cached
# data-root), ``__main__`` (the command line).

from __future__ import annotations

from ci.docker_engine.client import (
    CACHE_ENV,
    DockerClient,
    DockerEngineError,
    cache_root,
    compose_command,
    docker_cli,
    engine_prerequisites,
)
from ci.docker_engine.engine import (
    STORAGE_DRIVERS,
    PrivateDockerd,
    cached_data_root,
    start_engine,
)
from ci.docker_engine.pids import remove_tree, unmount_under

__all__ = [
    "CACHE_ENV",
    "STORAGE_DRIVERS",
    "DockerClient",
    "DockerEngineError",
    "PrivateDockerd",
    "cache_root",
    "cached_data_root",
    "compose_command",
    "docker_cli",
    "engine_prerequisites",
    "remove_tree",
    "start_engine",
    "unmount_under",
]
