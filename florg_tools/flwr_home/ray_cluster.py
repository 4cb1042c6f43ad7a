"""The Ray cluster address of a simulation connection (``--ray-address``): check it,
record it in ``config.toml`` and read it back as ``RAY_ADDRESS`` for the SuperLink.

Why it is kept where Flower 1.41 ignores it: see ``florg_tools.flwr_home``'s docstring.
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path

from florg_tools.flwr_home.connections import CONFIG_FILE_NAME, read_flower_config, save_config

RAY_ADDRESS_ENV_VAR = "RAY_ADDRESS"
_INIT_ARGS_KEY = "init-args"
_RAY_ADDRESS_KEY = "address"
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
    Ray's ``ray.init`` arguments; ``flwr`` 1.41 ignores that key (see the package's
    docstring), ``ray_address_env`` turns it into ``RAY_ADDRESS`` for the SuperLink.
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
