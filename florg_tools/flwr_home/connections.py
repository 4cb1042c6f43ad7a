"""The connections of ``$FLWR_HOME/config.toml``: read the file, write a simulation
connection or a TLS connection to a SuperLink you run, keeping every other table.

(The file and how Flower reads it: docs/deploy-ray.md, "The simulation settings".)
"""

from __future__ import annotations

import math
import os
import tomllib
from pathlib import Path
from typing import Any

import tomli_w  # a dependency of flwr itself (flwr uses it to write config.toml)

CONFIG_FILE_NAME = "config.toml"
DEFAULT_CONNECTION_NAME = "local-simulation"
# Magic address: the flwr CLI starts (and leaves running) a local simulation SuperLink.
LOCAL_SUPERLINK_ADDRESS = ":local:"

# What `flwr` itself writes when no config.toml exists (flwr.cli.constant).
_FLWR_DEFAULT_CONFIG: dict[str, Any] = {
    "superlink": {
        "default": "local",
        "supergrid": {"address": "api.flower.ai"},
        "local": {"address": LOCAL_SUPERLINK_ADDRESS},
    }
}

REPO_ROOT = Path(__file__).resolve().parents[2]


def default_flwr_home() -> Path:
    """The project's Flower home: ``<repo>/.flwr_home`` (git-ignored)."""
    return REPO_ROOT / ".flwr_home"


def read_flower_config(flwr_home: Path) -> dict[str, Any]:
    """Parse ``<flwr_home>/config.toml``; an absent file reads as ``{}``."""
    path = Path(flwr_home) / CONFIG_FILE_NAME
    if not path.exists():
        return {}
    with path.open("rb") as fh:
        try:
            return tomllib.load(fh)
        except tomllib.TOMLDecodeError as err:
            raise ValueError(f"{path} is not valid TOML: {err}") from err


def _integral_cpus(num_cpus_per_client: float) -> int:
    # Flower turns options.backend.client-resources.num-cpus into the protobuf field
    # SimulationConfig.client_resources_num_cpus, a uint32: a TOML float (even 1.0) makes
    # `flwr run` crash with "TypeError: 'float' object cannot be interpreted as an integer".
    if isinstance(num_cpus_per_client, bool) or not math.isfinite(num_cpus_per_client):
        raise ValueError(f"num_cpus_per_client must be a number, got {num_cpus_per_client!r}")
    if num_cpus_per_client < 1 or float(num_cpus_per_client) != int(num_cpus_per_client):
        raise ValueError(
            "num_cpus_per_client must be a whole number >= 1: Flower stores "
            f"client-resources.num-cpus as an integer (got {num_cpus_per_client!r})"
        )
    return int(num_cpus_per_client)


def write_local_simulation_connection(
    flwr_home: Path,
    name: str = DEFAULT_CONNECTION_NAME,
    *,
    num_supernodes: int,
    num_cpus_per_client: float,
    num_gpus_per_client: float,
    address: str | None = None,
    set_default: bool = False,
) -> Path:
    """Write or replace the simulation connection ``name`` in ``<flwr_home>/config.toml``.

    Every other table and connection in the file is kept (comments are not: the file is
    re-serialised, as ``flwr`` itself does). ``address=None`` writes the ``":local:"``
    magic address (the flwr CLI starts a detached local SuperLink on demand); an explicit
    ``"host:port"`` points at a SuperLink you run yourself and is written with
    ``insecure = true``. A new file is seeded with flwr's own defaults (``local`` and
    ``supergrid`` connections). The connection becomes ``[superlink].default`` with
    ``set_default``, in a new file, or when the file names no default; otherwise the
    existing default is kept. Returns the path of ``config.toml``.
    """
    if not name or any(ch in name for ch in ".[]\"' \t\n"):
        raise ValueError(f"invalid connection name {name!r} (no dots, quotes or spaces)")
    if isinstance(num_supernodes, bool) or not isinstance(num_supernodes, int):
        raise ValueError(f"num_supernodes must be an int, got {num_supernodes!r}")
    if num_supernodes < 1:
        raise ValueError(f"num_supernodes must be >= 1, got {num_supernodes}")
    num_cpus = _integral_cpus(num_cpus_per_client)
    num_gpus = float(num_gpus_per_client)
    if not math.isfinite(num_gpus) or num_gpus < 0:
        raise ValueError(f"num_gpus_per_client must be >= 0, got {num_gpus_per_client!r}")

    connection = simulation_connection(
        address,
        num_supernodes=num_supernodes,
        num_cpus_per_client=num_cpus,
        num_gpus_per_client=num_gpus,
    )
    return _store_connection(flwr_home, name, connection, set_default)


def simulation_connection(
    address: str | None,
    *,
    num_supernodes: int,
    num_cpus_per_client: float,
    num_gpus_per_client: float,
    ray_num_cpus: int | None = None,
) -> dict[str, Any]:
    """The ``[superlink.NAME]`` table of a simulation connection (values as given)::

        {"address": ..., "insecure": True,
         "options": {"num-supernodes": N,
                     "backend": {"client-resources": {"num-cpus": C, "num-gpus": G}}}}

    ``ray_num_cpus``: the logical CPUs Ray starts with (``backend.init-args.num-cpus``;
    default: the machine's), so that more one-CPU ClientApp actors than cores run at once.

    ``address=None`` gives the ``":local:"`` magic address (and no ``insecure``); an
    explicit ``"host:port"`` is a SuperLink you run yourself, reached without TLS.
    """
    connection: dict[str, Any] = {}
    if address is None:
        connection["address"] = LOCAL_SUPERLINK_ADDRESS
    else:
        connection["address"] = address
        connection["insecure"] = True
    connection["options"] = {
        "num-supernodes": num_supernodes,
        "backend": {
            "client-resources": {"num-cpus": num_cpus_per_client, "num-gpus": num_gpus_per_client}
        },
    }
    if ray_num_cpus is not None:
        connection["options"]["backend"]["init-args"] = {"num-cpus": int(ray_num_cpus)}
    return connection


def _store_connection(
    flwr_home: Path, name: str, connection: dict[str, Any], set_default: bool
) -> Path:
    """Write ``[superlink.<name>]`` into ``<flwr_home>/config.toml`` atomically, keeping
    every other table; a new file is seeded with flwr's own defaults. ``name`` becomes the
    default with ``set_default``, in a new file, or when the file names none."""
    flwr_home = Path(flwr_home).expanduser()
    flwr_home.mkdir(parents=True, exist_ok=True)
    path = flwr_home / CONFIG_FILE_NAME
    is_new = not path.exists()
    config = _copy(_FLWR_DEFAULT_CONFIG) if is_new else read_flower_config(flwr_home)
    superlink = config.setdefault("superlink", {})
    if not isinstance(superlink, dict):
        raise ValueError(f"{path}: [superlink] must be a table")
    superlink[name] = connection
    if set_default or is_new or not isinstance(superlink.get("default"), str):
        superlink["default"] = name
    save_config(path, config)
    return path


def write_tls_connection(
    flwr_home: Path,
    name: str,
    address: str,
    *,
    root_certificates: Path | str | None,
    insecure: bool = False,
    set_default: bool = False,
) -> Path:
    """Write or replace the connection ``name`` to a SuperLink you run (deployment)::

        [superlink.NAME]
        address = "HOST:PORT"
        root-certificates = "/abs/path/ca.crt"   # the CA that signed the SuperLink's cert

    ``flwr run . NAME`` (or ``python -m florg_tools.launch --connection NAME``) then submits
    runs to that SuperLink over TLS. ``insecure=True`` (no ``root_certificates``) writes
    ``insecure = true`` instead, refused unless HOST is a loopback address. Other tables of
    ``config.toml`` are kept; ``set_default`` (or a file without a default) makes NAME the
    default. Returns the path of ``config.toml``.
    """
    from florg_tools.deploy.commands import is_loopback, split_address

    if not name or any(ch in name for ch in ".[]\"' \t\n"):
        raise ValueError(f"invalid connection name {name!r} (no dots, quotes or spaces)")
    host, _ = split_address(address)
    connection: dict[str, Any] = {"address": address}
    if insecure:
        if root_certificates is not None:
            raise ValueError("give root_certificates or insecure=True, not both")
        if not is_loopback(host):
            raise ValueError(
                f"refusing an insecure connection to {address}: not a loopback address; "
                "pass the CA certificate (root_certificates) to use TLS"
            )
        connection["insecure"] = True
    else:
        if root_certificates is None:
            raise ValueError(f"connection {name!r}: root_certificates (the CA file) is required")
        ca = Path(root_certificates).expanduser().resolve()
        if not ca.is_file():
            raise ValueError(f"connection {name!r}: root certificate file {ca} does not exist")
        connection["root-certificates"] = str(ca)  # flwr requires an absolute path
    return _store_connection(flwr_home, name, connection, set_default)


def _copy(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_copy(v) for v in obj]
    return obj


def _default_first(config: dict[str, Any]) -> dict[str, Any]:
    """Put ``[superlink].default`` before the connection tables (cosmetic)."""
    superlink = config.get("superlink")
    if not isinstance(superlink, dict) or "default" not in superlink:
        return config
    ordered = {"default": superlink["default"]}
    ordered.update((k, v) for k, v in superlink.items() if k != "default")
    return {**config, "superlink": ordered}


def save_config(path: Path, config: dict[str, Any]) -> None:
    """Write ``config`` to ``path`` atomically (``[superlink].default`` first)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(tomli_w.dumps(_default_first(config)), encoding="utf-8")
    os.replace(tmp, path)
