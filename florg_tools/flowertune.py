"""``florg flowertune`` and the launcher's FlowerTune gate (``leaderboard_gate``): a run in a
FlowerTune LLM leaderboard track (setting ``flowertune-track``) is checked against the
track's rules before anything starts (flower_app/preflight/leaderboard.py), and its
communication is projected from the base model's config for every registered method and
printed (``projection_table``; florg_tools/comm_projection.py).

    python -m florg_tools.flowertune projection [--preset NAME ...] [--set KEY=VALUE ...]
        [--num-supernodes N]

prints each preset's projection (default: the four ``flowertune-<track>`` presets) at its
track's number of SuperNodes; ``--set`` applies to every preset. Exit status 0, or 2 for a
setting or a model config that cannot be read (docs/flowertune.md).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import strategies.registry  # noqa: F401  (every method registers: resolve_config reads them)
from flower_app.preflight.leaderboard import (
    BUDGET_MB,
    TRACKS,
    Track,
    check_budget,
    check_method,
    check_static,
    check_supernodes,
    get_track,
)
from flower_app.settings.config import ConfigError, RunConfig, resolve_config

__all__ = ["connection_supernodes", "leaderboard_gate", "main", "projection_table"]

PRESETS = tuple(f"flowertune-{name}" for name in TRACKS)


def connection_supernodes(flwr_home: Path, connection: str | None) -> tuple[str, int | None, bool]:
    """(name, its ``options.num-supernodes`` or None, whether it is a local simulation) of
    the connection a launch uses (the default one when ``connection`` is None)."""
    from florg_tools.flwr_cli import connection_names
    from florg_tools.flwr_home import DEFAULT_CONNECTION_NAME, read_flower_config

    try:
        names, default = connection_names(flwr_home)
        config = read_flower_config(flwr_home)
    except (OSError, ValueError):
        return connection or DEFAULT_CONNECTION_NAME, None, True
    name = connection or default or DEFAULT_CONNECTION_NAME
    conn = config.get("superlink", {}).get(name, {}) if name in names else {}
    options = conn.get("options", {}) if isinstance(conn, Mapping) else {}
    address = conn.get("address") if isinstance(conn, Mapping) else None
    simulated = address in (None, ":local:", ":local-in-memory:") or "num-supernodes" in options
    value = options.get("num-supernodes")
    count = value if isinstance(value, int) and not isinstance(value, bool) else None
    return name, count, simulated


def projection_table(config: RunConfig, track: Track, num_supernodes: int) -> str:
    """Every registered method's projected communication for ``config`` on ``track``, the
    run's method marked; raises ConfigError when the model's config cannot be read."""
    from florg_tools.comm_projection import adapted_layer_shapes, clients_per_round, project

    shapes = adapted_layer_shapes(config, config.task_kind or "causal-lm")
    rows = project(config, shapes, num_supernodes)
    clients = clients_per_round(config, num_supernodes)
    lines = [
        f"[leaderboard] {track.name}: projected communication of {config.model} "
        f"(r = {config.rank}, {len(shapes)} adapted modules, {clients} of {num_supernodes} "
        f"SuperNodes a round, {config.num_server_rounds} rounds, arrays up "
        f"{config.uplink_encoding} / down {config.downlink_encoding}; budget "
        f"{BUDGET_MB:,.0f} MB)",
        f"  {'method':<22}{'MB / round':>12}{'MB / run':>14}{'of budget':>11}",
    ]
    for p in rows:
        mark = "  <- this run" if p.method == config.method else ""
        lines.append(
            f"  {p.method:<22}{p.round_mb:>12,.1f}{p.total_mb:>14,.1f}"
            f"{p.total_mb / BUDGET_MB:>10.2%}{mark}"
        )
    return "\n".join(lines)


def _chosen_total_mb(config: RunConfig, num_supernodes: int) -> float:
    from florg_tools.comm_projection import adapted_layer_shapes, project

    shapes = adapted_layer_shapes(config, config.task_kind or "causal-lm")
    (chosen,) = project(config, shapes, num_supernodes, methods=(config.method,))
    return chosen.total_mb


def leaderboard_gate(
    run_config: Mapping[str, Any],
    flwr_home: Path,
    connection: str | None,
    stream: IO[str] | None = None,
) -> RunConfig | None:
    """Before a launch: nothing for a run in no track; for one in a track, its rules
    (``leaderboard`` true: static settings, method, SuperNodes, budget; a ConfigError
    naming the rule) and the projection table, printed to ``stream`` (stderr by default).
    With ``leaderboard`` false the table is printed where the model's config can be read."""
    stream = stream if stream is not None else sys.stderr
    config = resolve_config(run_config)
    track = get_track(config)
    if track is None:
        return None
    name, count, simulated = connection_supernodes(flwr_home, connection)
    if config.leaderboard:
        check_static(config, track)
        check_method(config, track)
        if simulated:
            check_supernodes(track, count, name)
        else:
            print(
                f"[leaderboard] {name!r} is a deployment: its SuperNodes cannot be counted "
                f"here; the track needs {track.num_supernodes}",
                file=stream,
            )
    nodes = count or track.num_supernodes
    try:
        print(projection_table(config, track, nodes), file=stream)
    except ConfigError as err:
        if config.leaderboard:
            raise
        print(f"[leaderboard] no projection: {err}", file=stream)
        return config
    if config.leaderboard:
        check_budget(track, config.method, _chosen_total_mb(config, nodes))
        print(f"[leaderboard] {track.name}: the track's rules hold", file=stream)
    else:
        print("[leaderboard] checks lifted (leaderboard=false): not a valid entry", file=stream)
    return config


def _build_parser() -> argparse.ArgumentParser:
    from florg_tools.run_config import add_set_argument

    parser = argparse.ArgumentParser(
        prog="florg flowertune",
        description="FlowerTune LLM leaderboard tooling (docs/flowertune.md).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    proj = sub.add_parser(
        "projection",
        help="print every method's projected communication for the track presets",
    )
    proj.add_argument(
        "--preset",
        dest="presets",
        action="append",
        default=[],
        metavar="NAME",
        help=f"a track preset (repeatable; default: {', '.join(PRESETS)})",
    )
    add_set_argument(proj, help="setting applied to every preset (repeatable)")
    proj.add_argument(
        "--num-supernodes",
        type=int,
        default=None,
        metavar="N",
        help="default: each track's own number",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    from florg_tools.run_config import ConfigValidationError, load_preset, parse_sets

    args = _build_parser().parse_args(argv)
    try:
        sets = parse_sets(args.sets)
        for preset in args.presets or PRESETS:
            config = resolve_config({**load_preset(preset), **sets})
            track = get_track(config)
            if track is None:
                raise ConfigValidationError(f"--preset {preset}: it names no flowertune-track")
            print(projection_table(config, track, args.num_supernodes or track.num_supernodes))
    except (ConfigError, ConfigValidationError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
