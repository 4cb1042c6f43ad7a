"""``python -m florg_tools.launch`` (``florg launch``, ``main``): run this Flower App with
``flwr run`` and fail unless the run completes.

It submits the run, streams its log and reads its final status
(``florg_tools.flwr_cli.run_flower_app``). With ``--ephemeral-superlink``, and always for a
``:local:`` connection, the run gets a private simulation SuperLink
(``florg_tools.superlink``), stopped afterwards with everything it spawned. Overrides are
layered file < ``--preset`` < ``--set`` (``florg_tools.run_config``); a FlowerTune track's
run is checked and projected first (``florg_tools.flowertune``); ``--resume RUN_DIR``
continues a run, ``--rerun RUN_DIR`` runs it again as a new run. Exit status: 0 completed;
1 failed, stopped or unknown; 2 bad usage or run config; 3 timed out; 130 interrupted.
SIGTERM and SIGHUP act as Ctrl-C (docs/usage.md, "The launcher and the florg command").
"""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tomli_w  # a dependency of flwr

from florg_tools.flowertune import leaderboard_gate
from florg_tools.flwr_cli import (
    LaunchError,
    connection_names,
    resolve_flwr_home,
    run_flower_app,
    validate_run_config,
)
from florg_tools.flwr_home import (
    CONFIG_FILE_NAME,
    DEFAULT_CONNECTION_NAME,
    LOCAL_SUPERLINK_ADDRESS,
    ray_address_env,
    read_flower_config,
)
from florg_tools.flwr_home.ray_cluster import quiet_ray_env
from florg_tools.processes import die_by_signal, signals_interrupt
from florg_tools.run_config import (
    ConfigValidationError,
    add_set_argument,
    collect_run_config,
    is_this_app,
)
from florg_tools.superlink import local_superlink

__all__ = [
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_TIMEOUT",
    "EXIT_USAGE",
    "main",
]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_TIMEOUT = 3
EXIT_INTERRUPTED = 130


def _load_validator(spec: str) -> Callable[[dict[str, Any]], None]:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigValidationError(f"--validate-with expects 'module:function', got {spec!r}")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigValidationError(f"{spec} is not callable")
    func: Callable[[dict[str, Any]], Any] = obj

    def validate(config: dict[str, Any]) -> None:
        try:
            func(config)
        except ConfigValidationError:
            raise
        except Exception as err:  # the validator's own error type, e.g. ConfigError
            raise ConfigValidationError(str(err)) from err

    return validate


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="florg launch",
        description="Run the Flower App with `flwr run` and fail unless the run completes.",
    )
    parser.add_argument(
        "--connection",
        default=None,
        help=f"SuperLink connection in $FLWR_HOME/config.toml (default: its default, "
        f"normally '{DEFAULT_CONNECTION_NAME}')",
    )
    parser.add_argument("--app", type=Path, default=Path("."), help="Flower App directory")
    parser.add_argument(
        "--run-config-file", type=Path, default=None, help="TOML file of run-config overrides"
    )
    parser.add_argument(
        "--preset",
        default=None,
        metavar="NAME",
        help="a layer between --run-config-file and --set: the app's conf/NAME.toml (or a "
        ".toml path), the file plain `flwr run --run-config` takes",
    )
    add_set_argument(parser)
    parser.add_argument(
        "--flwr-home",
        type=Path,
        default=None,
        help="Flower home (default: $FLWR_HOME if set, else <repo>/.flwr_home)",
    )
    parser.add_argument("--timeout", type=float, default=None, help="seconds; stops the run")
    parser.add_argument(
        "--validate-with",
        default=None,
        metavar="MODULE:FUNCTION",
        help="callable receiving the effective run config; raise to refuse the launch "
        "(default: flower_app.preflight.references:check_run)",
    )
    parser.add_argument(
        "--ephemeral-superlink",
        action="store_true",
        help="start a private simulation SuperLink on a free port for this run and stop "
        "it (and Ray) afterwards (always done for a ':local:' connection, whose SuperLink "
        "flwr would start detached and leave running)",
    )
    parser.add_argument(
        "--resume",
        type=Path,
        default=None,
        metavar="RUN_DIR",
        help="continue the run whose folder is RUN_DIR from its last checkpointed round: "
        "its config.json is submitted with resume=RUN_DIR (--set may change "
        "num-server-rounds; docs/faults.md)",
    )
    parser.add_argument(
        "--rerun",
        type=Path,
        default=None,
        metavar="RUN_DIR",
        help="run the run whose folder is RUN_DIR again from the start, with the settings of "
        "its config.json (a published run's too) as a new run named <its run-name>-rerun; "
        "--set overrides them",
    )
    parser.add_argument("--quiet", action="store_true", help="do not echo the run's log")
    return parser


def _ephemeral_connection(flwr_home: Path, connection: str | None) -> tuple[str, dict[str, Any]]:
    """Copy of ``connection`` (from ``flwr_home``) for a temporary Flower home."""
    names, default = connection_names(flwr_home)
    name = connection or default or DEFAULT_CONNECTION_NAME
    conn: dict[str, Any] = {}
    if name in names:
        conn = dict(read_flower_config(flwr_home)["superlink"][name])
        if conn.get("address") not in (None, LOCAL_SUPERLINK_ADDRESS, ":local-in-memory:"):
            raise ConfigValidationError(
                f"--ephemeral-superlink needs a local simulation connection; '{name}' "
                f"points at {conn.get('address')}"
            )
    return name, conn


def _is_local_simulation(flwr_home: Path, connection: str | None) -> bool:
    """Whether ``connection`` (the default one when None) of ``flwr_home`` is a local
    simulation whose SuperLink `flwr run` would start detached (address ':local:')."""
    try:
        names, default = connection_names(flwr_home)
        name = connection or default
        if name not in names:
            return False
        conn = read_flower_config(flwr_home)["superlink"][name]
    except (OSError, ValueError, KeyError, TypeError, LaunchError):
        return False  # run_flower_app reports a missing or bad connection
    return conn.get("address") == LOCAL_SUPERLINK_ADDRESS


def main(argv: list[str] | None = None) -> int:
    with signals_interrupt() as received:
        try:
            code = _main(argv)
        except KeyboardInterrupt:
            if received.signum is None:
                raise
            code = EXIT_INTERRUPTED
    if received.signum is not None:  # cleaned up: now end as SIGTERM would have
        return die_by_signal(received.signum)
    return code


def _main(argv: list[str] | None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.resume is not None and args.rerun is not None:
        parser.error("--resume continues a run and --rerun starts it again: give one")
    flwr_home = resolve_flwr_home(args.flwr_home)
    sink = None if args.quiet else sys.stdout
    try:
        run_config = collect_run_config(args)
        # this app's: the settings and the names they refer to (task, model, data, modules)
        own = "flower_app.preflight.references:check_run"
        default_validator = own if is_this_app(args.app) else None
        spec = args.validate_with or default_validator
        validate = _load_validator(spec) if spec else None
        if is_this_app(args.app):  # a FlowerTune track's rules and projection, printed
            leaderboard_gate(run_config, flwr_home, args.connection)
        # refused before anything starts (no SuperLink, no run folder)
        validate_run_config(args.app, run_config, validate)
        # A local simulation connection (':local:') makes `flwr run` start Flower's detached
        # SuperLink, which outlives the run (and every resume would add one): the launcher
        # runs its own for it instead, and stops it with everything it spawned.
        if args.ephemeral_superlink or _is_local_simulation(flwr_home, args.connection):
            with tempfile.TemporaryDirectory(prefix="flwr-home-") as tmp:
                name, conn = _ephemeral_connection(flwr_home, args.connection)
                # A Ray cluster address recorded in the connection reaches flwr-simulation
                # only through the SuperLink's environment (RAY_ADDRESS; docs/deploy-ray.md).
                ray_env = ray_address_env(flwr_home, name)
                # and Ray's settings that keep its tip about accelerator variables and
                # the actors' shutdown line off the run's log (quiet_ray_env)
                ray_env.update(quiet_ray_env(flwr_home, name))
                with local_superlink(Path(tmp), cwd=Path.cwd(), extra_env=ray_env) as superlink:
                    conn.update(address=superlink.address, insecure=True)
                    (Path(tmp) / CONFIG_FILE_NAME).write_text(
                        tomli_w.dumps({"superlink": {"default": name, name: conn}}),
                        encoding="utf-8",
                    )
                    outcome = run_flower_app(
                        args.app, name, run_config, Path(tmp), args.timeout,
                        validate=validate, stream=sink,
                    )  # fmt: skip
        else:
            outcome = run_flower_app(
                args.app, args.connection, run_config, flwr_home, args.timeout,
                validate=validate, stream=sink,
            )  # fmt: skip
    except ValueError as err:  # ConfigValidationError, or raised by --validate-with
        print(f"error: invalid run config: {err}", file=sys.stderr)
        return EXIT_USAGE
    except LaunchError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("interrupted; the run was asked to stop", file=sys.stderr)
        return EXIT_INTERRUPTED
    if outcome.ok:
        print(f"[launch] OK: {outcome.message}", file=sys.stderr)
        return EXIT_OK
    print(f"[launch] FAILED: {outcome.message}", file=sys.stderr)
    return EXIT_TIMEOUT if outcome.timed_out else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
