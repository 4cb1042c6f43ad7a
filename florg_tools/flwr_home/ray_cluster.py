"""The Ray cluster address of a simulation connection (``--ray-address``): check it,
record it in ``config.toml`` and read it back as ``RAY_ADDRESS`` for the SuperLink.

Flower ignores an address in the connection's ``options.backend.init-args``; why it is
recorded there anyway: docs/deploy-ray.md, "Attaching the simulation to an existing Ray
cluster". ``quiet_ray_env``: Ray's settings that keep two messages nobody can act on off a
local simulation's console (the launcher's).
"""

from __future__ import annotations

import ipaddress
import os
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from florg_tools.flwr_home.connections import CONFIG_FILE_NAME, read_flower_config, save_config

RAY_ADDRESS_ENV_VAR = "RAY_ADDRESS"
_INIT_ARGS_KEY = "init-args"
_RAY_ADDRESS_KEY = "address"
# What the launcher sets for the simulation it starts (``quiet_ray_env``): Ray's own
# switches, read by ``flwr-simulation`` (the Ray driver) and the Ray actors it starts.
RAY_ACCEL_OVERRIDE_ENV_VAR = "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO"
RAY_LOG_SKIP_ENV_VAR = "RAY_DEDUP_LOGS_SKIP_REGEX"
ACTOR_EXIT_LINE_RE = "Manually terminating ClientAppActor"
_HOSTNAME_RE = re.compile(
    r"(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*"
)


def validate_ray_address(address: str) -> str:
    """Check a Ray cluster address for ``--ray-address``; return it without blanks.

    Accepted: ``auto`` (the cluster last started with ``ray start`` on the machine that
    runs the simulation, found through ``/tmp/ray/ray_current_cluster``) or the head's
    GCS address ``HOST:PORT`` (``ray start --head --port PORT``; HOST a host name, an
    IPv4 address or a bracketed ``[IPv6]``). Refused with a ``ValueError``: Ray Client
    addresses (``ray://``; the simulation must run on a machine of the cluster), ``local``
    (a private Ray instance: leave ``--ray-address`` out), a missing or bad port.
    """
    if not isinstance(address, str):
        raise ValueError(f"ray address must be a string, got {address!r}")
    text = address.strip()
    if text == "auto":
        return text
    if not text:
        raise ValueError("ray address is empty; give HOST:PORT of the Ray head or 'auto'")
    if text == "local":
        raise ValueError(
            "ray address 'local' means a private Ray instance per run, which is the "
            "default: leave --ray-address out"
        )
    if "://" in text:
        raise ValueError(
            f"ray address {text!r}: Ray Client (ray://) and URL addresses are not supported; "
            "run the SuperLink on a machine of the cluster (usually the head) and give the "
            "head's GCS address HOST:PORT (the --port of `ray start --head`, default 6379)"
        )
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise ValueError(f"ray address {text!r} has no port: expected HOST:PORT or 'auto'")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"ray address {text!r}: port must be an integer in 1..65535")
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError as err:
            raise ValueError(f"ray address {text!r}: bad IPv6 address {host}") from err
    elif ":" in host:
        raise ValueError(f"ray address {text!r}: write an IPv6 host in brackets, [::1]:6379")
    elif not _HOSTNAME_RE.fullmatch(host):
        raise ValueError(f"ray address {text!r}: {host!r} is not a host name or IP address")
    return text


def set_ray_address(flwr_home: Path, name: str, address: str | None) -> Path:
    """Record (or with ``None`` remove) the Ray cluster address of connection ``name``.

    It is kept as ``[superlink.NAME.options.backend.init-args] address``, the place of
    Ray's ``ray.init`` arguments; ``flwr`` ignores that key (docs/deploy-ray.md),
    ``ray_address_env`` turns it into ``RAY_ADDRESS`` for the SuperLink.
    """
    path = Path(flwr_home).expanduser() / CONFIG_FILE_NAME
    config = read_flower_config(Path(flwr_home).expanduser())
    connection = config.get("superlink", {}).get(name)
    if not isinstance(connection, dict):
        raise ValueError(f"{path} has no connection '{name}'")
    options = connection.setdefault("options", {})
    if not isinstance(options, dict):
        raise ValueError(f"{path}: [superlink.{name}.options] must be a table")
    backend = options.setdefault("backend", {})
    if not isinstance(backend, dict):
        raise ValueError(f"{path}: [superlink.{name}.options.backend] must be a table")
    init_args = backend.setdefault(_INIT_ARGS_KEY, {})
    if not isinstance(init_args, dict):
        raise ValueError(f"{path}: [superlink.{name}.options.backend.init-args] must be a table")
    if address is None:
        init_args.pop(_RAY_ADDRESS_KEY, None)
        if not init_args:
            backend.pop(_INIT_ARGS_KEY)
    else:
        init_args[_RAY_ADDRESS_KEY] = validate_ray_address(address)
    save_config(path, config)
    return path


def ray_address_env(flwr_home: Path, name: str | None = None) -> dict[str, str]:
    """``{"RAY_ADDRESS": ...}`` for connection ``name`` (default: the file's default
    connection) when it records a Ray cluster address, else ``{}``. Merge it into the
    environment of the SuperLink: its ``flwr-simulation`` then attaches to that cluster."""
    superlink = read_flower_config(Path(flwr_home).expanduser()).get("superlink", {})
    if not isinstance(superlink, dict):
        return {}
    if name is None:
        name = superlink.get("default") if isinstance(superlink.get("default"), str) else None
    connection = superlink.get(name) if name else None
    try:
        address = connection["options"]["backend"][_INIT_ARGS_KEY][_RAY_ADDRESS_KEY]
    except (KeyError, TypeError):
        return {}
    return {RAY_ADDRESS_ENV_VAR: validate_ray_address(address)}


def _connection(flwr_home: Path, name: str | None) -> dict[str, Any]:
    superlink = read_flower_config(Path(flwr_home).expanduser()).get("superlink", {})
    if not isinstance(superlink, dict):
        return {}
    if name is None:
        name = superlink.get("default") if isinstance(superlink.get("default"), str) else None
    connection = superlink.get(name) if name else None
    return connection if isinstance(connection, dict) else {}


def _torch_cuda_device_count() -> int:
    """CUDA devices torch sees here (what ``pick_device`` uses); 0 when it cannot tell. On
    Linux, without a GPU driver's device node (NVIDIA, ROCm, WSL) there is none: no import."""
    if sys.platform.startswith("linux") and not any(
        Path("/dev", node).exists() for node in ("nvidiactl", "kfd", "dxg")
    ):
        return 0
    try:
        import torch

        return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
    except Exception:  # no torch, or a broken CUDA install: no GPU for the app either
        return 0


def quiet_ray_env(
    flwr_home: Path,
    name: str | None = None,
    environ: Mapping[str, str] | None = None,
    cuda_device_count: Callable[[], int] = _torch_cuda_device_count,
) -> dict[str, str]:
    """Environment for the SuperLink of a local simulation (connection ``name`` of
    ``flwr_home``) that keeps two Ray messages nobody can act on off its console; a value
    ``environ`` (default ``os.environ``) sets already is kept.

    * ``RAY_DEDUP_LOGS_SKIP_REGEX``: Flower's actors log ``Manually terminating
      ClientAppActor`` (WARNING) when a simulation ends normally and its Ray backend
      terminates them (``flwr.simulation.ray_transport.ray_actor``); Ray forwards actor
      output to the driver (``flwr-simulation``), which skips the lines this regex matches
      (Ray's log deduplication; ``RAY_DEDUP_LOGS=0`` turns that off). Every other actor
      line is still forwarded; a regex already set is extended.
    * ``RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=0``: the switch Ray 2.55's ``ray.init``
      FutureWarning ("Tip: In future versions of Ray, Ray will no longer override
      accelerator visible devices env var if num_gpus=0 ...") asks for. With it Ray stops
      setting ``CUDA_VISIBLE_DEVICES=""`` for actors given no GPU, so it is only set where
      that changes nothing a ClientApp sees: every ClientApp gets a GPU (the connection's
      ``client-resources`` ``num-gpus`` > 0: Ray sets the variable either way) or, on a
      private Ray instance, torch sees no CUDA device on this machine. With ``num-gpus`` 0
      beside a GPU, or on a Ray cluster, Ray keeps hiding the GPUs (docs/deploy-ray.md)
      and prints its tip.
    """
    environ = os.environ if environ is None else environ
    env: dict[str, str] = {}
    skip = environ.get(RAY_LOG_SKIP_ENV_VAR)
    if not skip:
        env[RAY_LOG_SKIP_ENV_VAR] = ACTOR_EXIT_LINE_RE
    elif ACTOR_EXIT_LINE_RE not in skip:
        env[RAY_LOG_SKIP_ENV_VAR] = f"(?:{skip})|(?:{ACTOR_EXIT_LINE_RE})"
    if RAY_ACCEL_OVERRIDE_ENV_VAR in environ:
        return env
    connection = _connection(flwr_home, name)
    try:
        num_gpus = float(connection["options"]["backend"]["client-resources"]["num-gpus"])
    except (KeyError, TypeError, ValueError):
        num_gpus = 0.0  # Flower's default: no GPU for a ClientApp
    on_cluster = bool(environ.get(RAY_ADDRESS_ENV_VAR) or ray_address_env(flwr_home, name))
    if num_gpus > 0 or (not on_cluster and cuda_device_count() == 0):
        env[RAY_ACCEL_OVERRIDE_ENV_VAR] = "0"
    return env
