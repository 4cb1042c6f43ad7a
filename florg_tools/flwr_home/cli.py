"""``python -m florg_tools.flwr_home setup``: write a local-simulation connection with
resources sized for this machine (``detect_defaults``) and print ``export FLWR_HOME=...``."""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from florg_tools.flwr_home.connections import (
    DEFAULT_CONNECTION_NAME,
    default_flwr_home,
    read_flower_config,
    write_local_simulation_connection,
)
from florg_tools.flwr_home.ray_cluster import (
    RAY_ADDRESS_ENV_VAR,
    set_ray_address,
    validate_ray_address,
)


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
            f"{err} (Flower stores client-resources num-cpus as an integer)"
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
        prog="florg flwr-home",
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
