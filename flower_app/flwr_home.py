"""Manage the Flower CLI home directory (``$FLWR_HOME``) and its ``config.toml``.

Since Flower 1.27 the CLI no longer reads connections ("federations") from the app's
``pyproject.toml``: they live in ``$FLWR_HOME/config.toml`` (a ``[tool.flwr.federations]``
table in ``pyproject.toml`` is migrated there and commented out by ``flwr run``). In
Flower 1.41 a connection looks like this::

    [superlink]
    default = "local-simulation"

    [superlink.local-simulation]
    address = ":local:"          # or "127.0.0.1:PORT" for a SuperLink you started
    insecure = true              # only meaningful with an explicit address

    [superlink.local-simulation.options]
    num-supernodes = 2

    [superlink.local-simulation.options.backend.client-resources]
    num-cpus = 1                 # must be an INTEGER in 1.41 (protobuf int field)
    num-gpus = 0.0

``address = ":local:"`` makes every ``flwr`` command lazily start a *detached*
``flower-superlink --simulation`` on ``127.0.0.1:39091`` (override with the environment
variable ``FLWR_LOCAL_SUPERLINK_HTTP_API_PORT``), with its state in
``$FLWR_HOME/local-superlink/state.db``; it keeps running after ``flwr run`` returns.
An explicit ``address`` is treated as user-managed (nothing is started).

``options.*`` in a connection is deprecated in 1.41 (``flwr run`` prints a warning) but
still honoured: it is sent as the per-run simulation config override.

Command line::

    python -m flower_app.flwr_home setup [--flwr-home DIR] [--num-supernodes N]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tomllib
from pathlib import Path
from typing import Any

import tomli_w  # a dependency of flwr itself (flwr uses it to write config.toml)

__all__ = [
    "CONFIG_FILE_NAME",
    "DEFAULT_CONNECTION_NAME",
    "LOCAL_SUPERLINK_ADDRESS",
    "default_flwr_home",
    "detect_defaults",
    "main",
    "read_flower_config",
    "write_local_simulation_connection",
]

CONFIG_FILE_NAME = "config.toml"
DEFAULT_CONNECTION_NAME = "local-simulation"
# Magic address: the flwr CLI starts (and leaves running) a local simulation SuperLink.
LOCAL_SUPERLINK_ADDRESS = ":local:"

# What `flwr` itself writes when no config.toml exists (flwr.cli.constant in 1.41).
_FLWR_DEFAULT_CONFIG: dict[str, Any] = {
    "superlink": {
        "default": "local",
        "supergrid": {"address": "api.flower.ai"},
        "local": {"address": LOCAL_SUPERLINK_ADDRESS},
    }
}

REPO_ROOT = Path(__file__).resolve().parent.parent


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
    # Flower 1.41 turns options.backend.client-resources.num-cpus into the protobuf field
    # SimulationConfig.client_resources_num_cpus, an int64: a TOML float (even 1.0) makes
    # `flwr run` crash with "TypeError: 'float' object cannot be interpreted as an integer".
    if isinstance(num_cpus_per_client, bool) or not math.isfinite(num_cpus_per_client):
        raise ValueError(f"num_cpus_per_client must be a number, got {num_cpus_per_client!r}")
    if num_cpus_per_client < 1 or float(num_cpus_per_client) != int(num_cpus_per_client):
        raise ValueError(
            "num_cpus_per_client must be a whole number >= 1: Flower 1.41 stores "
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

    flwr_home = Path(flwr_home).expanduser()
    flwr_home.mkdir(parents=True, exist_ok=True)
    path = flwr_home / CONFIG_FILE_NAME
    is_new = not path.exists()
    config = _copy(_FLWR_DEFAULT_CONFIG) if is_new else read_flower_config(flwr_home)

    superlink = config.setdefault("superlink", {})
    if not isinstance(superlink, dict):
        raise ValueError(f"{path}: [superlink] must be a table")

    connection: dict[str, Any] = {}
    if address is None:
        connection["address"] = LOCAL_SUPERLINK_ADDRESS
    else:
        connection["address"] = address
        connection["insecure"] = True
    connection["options"] = {
        "num-supernodes": num_supernodes,
        "backend": {"client-resources": {"num-cpus": num_cpus, "num-gpus": num_gpus}},
    }
    superlink[name] = connection
    if set_default or is_new or not isinstance(superlink.get("default"), str):
        superlink["default"] = name

    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(tomli_w.dumps(_default_first(config)), encoding="utf-8")
    os.replace(tmp, path)
    return path


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


def _cuda_device_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    try:
        return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
    except Exception:  # a broken CUDA install means "no GPU" here
        return 0


def detect_defaults(num_supernodes: int | None = None) -> dict[str, Any]:
    """Sensible simulation resources for this machine.

    ``num_supernodes`` defaults to 2. The CPUs are split evenly between the SuperNodes
    (at least one each) so that all ClientApps of a round can train in parallel; Ray sets
    ``OMP_NUM_THREADS`` of each ClientApp actor to its ``num-cpus``. With CUDA, the GPUs
    are split the same way (at most one whole GPU per ClientApp).
    """
    if num_supernodes is None:
        num_supernodes = 2
    if num_supernodes < 1:
        raise ValueError(f"num_supernodes must be >= 1, got {num_supernodes}")
    cpus = os.cpu_count() or 1
    gpus = _cuda_device_count()
    return {
        "num_supernodes": num_supernodes,
        "num_cpus_per_client": max(1, cpus // num_supernodes),
        "num_gpus_per_client": min(1.0, gpus / num_supernodes) if gpus else 0.0,
        "cpu_count": cpus,
        "gpu_count": gpus,
    }


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m flower_app.flwr_home",
        description="Create or update the Flower CLI home (config.toml) for this project.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    setup = sub.add_parser("setup", help="write a local-simulation connection")
    setup.add_argument(
        "--flwr-home",
        type=Path,
        default=None,
        help="Flower home directory (default: $FLWR_HOME if set, else <repo>/.flwr_home)",
    )
    setup.add_argument("--name", default=DEFAULT_CONNECTION_NAME, help="connection name")
    setup.add_argument("--num-supernodes", type=int, default=None, help="default: 2")
    setup.add_argument("--num-cpus", type=int, default=None, help="CPUs per ClientApp")
    setup.add_argument("--num-gpus", type=float, default=None, help="GPUs per ClientApp")
    setup.add_argument(
        "--address",
        default=None,
        help='SuperLink "host:port" you run yourself (default: ":local:", started by flwr)',
    )
    setup.add_argument(
        "--no-default",
        action="store_true",
        help="do not make this connection [superlink].default",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    if args.command != "setup":  # pragma: no cover - argparse enforces the choice
        return 2
    if args.flwr_home is not None:
        flwr_home = args.flwr_home
    elif os.environ.get("FLWR_HOME"):
        flwr_home = Path(os.environ["FLWR_HOME"])
    else:
        flwr_home = default_flwr_home()
    flwr_home = flwr_home.expanduser().resolve()
    detected = detect_defaults(args.num_supernodes)
    try:
        path = write_local_simulation_connection(
            flwr_home,
            args.name,
            num_supernodes=detected["num_supernodes"],
            num_cpus_per_client=(
                args.num_cpus if args.num_cpus is not None else detected["num_cpus_per_client"]
            ),
            num_gpus_per_client=(
                args.num_gpus if args.num_gpus is not None else detected["num_gpus_per_client"]
            ),
            address=args.address,
            set_default=not args.no_default,
        )
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    conn = read_flower_config(flwr_home)["superlink"][args.name]
    print(
        f"# wrote connection '{args.name}' to {path} "
        f"({detected['cpu_count']} CPUs, {detected['gpu_count']} CUDA devices): {conn}",
        file=sys.stderr,
    )
    print(f"export FLWR_HOME={flwr_home}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
