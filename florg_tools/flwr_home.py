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

    python -m florg_tools.flwr_home setup [--flwr-home DIR] [--num-supernodes N]
        [--num-cpus-per-client N] [--num-gpus-per-client F] [--ray-address HOST:PORT|auto]

Ray cluster (``--ray-address``, see ``docs/deploy-ray.md``). The simulation's Ray
backend calls ``ray.init(**init_args)``, and Flower 1.41 forwards only ``num-cpus``,
``num-gpus``, ``logging-level`` and ``log-to-driver`` of
``options.backend.init-args`` (its ``SimulationConfig`` protobuf has no address field;
other keys are dropped without a word). Ray itself reads the ``RAY_ADDRESS`` environment
variable when ``ray.init`` gets no address, and ``flwr-simulation`` inherits the
environment of the SuperLink that started it. So ``--ray-address`` records the address
in the connection (``[superlink.NAME.options.backend.init-args] address``, where Flower
would take it; ``ray_address_env`` reads it back) and prints ``export RAY_ADDRESS=...``
for the shell that starts the SuperLink.
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import os
import re
import shlex
import sys
import tomllib
from pathlib import Path
from typing import Any

import tomli_w  # a dependency of flwr itself (flwr uses it to write config.toml)

__all__ = [
    "CONFIG_FILE_NAME",
    "DEFAULT_CONNECTION_NAME",
    "LOCAL_SUPERLINK_ADDRESS",
    "RAY_ADDRESS_ENV_VAR",
    "default_flwr_home",
    "detect_defaults",
    "main",
    "ray_address_env",
    "read_flower_config",
    "set_ray_address",
    "simulation_connection",
    "validate_ray_address",
    "write_local_simulation_connection",
    "write_tls_connection",
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
) -> dict[str, Any]:
    """The ``[superlink.NAME]`` table of a simulation connection (values as given)::

        {"address": ..., "insecure": True,
         "options": {"num-supernodes": N,
                     "backend": {"client-resources": {"num-cpus": C, "num-gpus": G}}}}

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
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(tomli_w.dumps(_default_first(config)), encoding="utf-8")
    os.replace(tmp, path)
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


# --------------------------------------------------------------------------------------
# Ray cluster address
# --------------------------------------------------------------------------------------

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
    Ray's ``ray.init`` arguments; ``flwr`` 1.41 ignores that key (see the module
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
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(tomli_w.dumps(_default_first(config)), encoding="utf-8")
    os.replace(tmp, path)
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


def _positive_int_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return value


def _cpus_arg(text: str) -> int:
    try:
        return _positive_int_arg(text)
    except argparse.ArgumentTypeError as err:
        raise argparse.ArgumentTypeError(
            f"{err} (Flower 1.41 stores client-resources num-cpus as an integer)"
        ) from None


def _non_negative_float_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(
            f"must be a number >= 0, got {text!r} (a fraction such as 0.25 packs four "
            "ClientApps on one GPU)"
        )
    return value


def _ray_address_arg(text: str) -> str:
    try:
        return validate_ray_address(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err


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
        prog="python -m florg_tools.flwr_home",
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
    setup.add_argument(
        "--num-supernodes", type=_positive_int_arg, default=None, metavar="N", help="default: 2"
    )
    setup.add_argument(
        "--num-cpus-per-client",
        "--num-cpus",
        dest="num_cpus",
        type=_cpus_arg,
        metavar="N",
        default=None,
        help="CPUs Ray reserves per ClientApp, a whole number >= 1 (default: this "
        "machine's CPUs / supernodes)",
    )
    setup.add_argument(
        "--num-gpus-per-client",
        "--num-gpus",
        dest="num_gpus",
        metavar="F",
        type=_non_negative_float_arg,
        default=None,
        help="GPUs Ray reserves per ClientApp, >= 0; fractions share a GPU (default: "
        "this machine's CUDA devices / supernodes, at most 1)",
    )
    setup.add_argument(
        "--ray-address",
        type=_ray_address_arg,
        default=None,
        metavar="HOST:PORT|auto",
        help="attach the simulation to this existing Ray cluster (the head's GCS "
        "address); recorded in the connection and printed as `export RAY_ADDRESS=...`",
    )
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
    if args.ray_address is not None:
        set_ray_address(flwr_home, args.name, args.ray_address)
    conn = read_flower_config(flwr_home)["superlink"][args.name]
    print(
        f"# wrote connection '{args.name}' to {path} "
        f"({detected['cpu_count']} CPUs, {detected['gpu_count']} CUDA devices): {conn}",
        file=sys.stderr,
    )
    print(f"export FLWR_HOME={flwr_home}")
    if args.ray_address is not None:
        print(f"export {RAY_ADDRESS_ENV_VAR}={shlex.quote(args.ray_address)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
