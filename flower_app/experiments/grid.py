"""Experiment grids: a YAML file in conf/grids/ describing many runs of the app.

A grid file looks like this (every key but ``base`` and one of ``grid``/``blocks`` is
optional)::

    name: main                     # results go to results/<name>/ unless --out says otherwise
    description: six methods x three tasks x two seeds
    simulation:                    # the simulated federation every run uses
      num-supernodes: 20
      num-cpus-per-client: 2       # CPUs per ClientApp actor (an int in Flower 1.41)
      num-gpus-per-client: 0.0
    run-timeout: 1800              # seconds per run; a run past it is stopped and marked failed
    base:                          # run-config settings shared by every run (the app's keys)
      model: all-MiniLM-L6-v2
      partitioner: dirichlet
    grid:                          # cartesian product of these axes over `base`
      task: [snli, movie-sentiment]
      method: [florg, fedit]
      seed: [0, 1]
    blocks:                        # or/and: named products, each over `base` (ablations:
      rank: {rank: [2, 4, 8]}      # one factor at a time); `grid` is the block "main"
    report:
      metric: accuracy             # headline metric column of metrics.jsonl
      targets: {snli: 0.40}        # communication-to-target, per task
      compare: [procrustes]        # blocks whose FLoRG diagnostics are plotted

A run's id names its axis values except those equal to ``base`` (``method=fedit,seed=1``),
so the same setting reached from two blocks is one run, run once.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flower_app.config import CONF_DIR, DEFAULTS, ConfigError, resolve_config

__all__ = ["Grid", "GridError", "GridRun", "load_grid"]

GRIDS_DIR = CONF_DIR / "grids"
MAIN_BLOCK = "main"
_TOP_KEYS = {
    "name", "description", "simulation", "run-timeout", "base", "grid", "blocks", "report",
}  # fmt: skip
_SIMULATION_KEYS = {"num-supernodes", "num-cpus-per-client", "num-gpus-per-client"}
_REPORT_KEYS = {"metric", "targets", "compare"}
# Settings the runner owns: every run writes into the grid's folder under its own id.
_RUNNER_KEYS = {"output-dir", "run-name", "preset"}


class GridError(ValueError):
    """A grid file that cannot be run; the message names the file and the key."""


@dataclass(frozen=True)
class GridRun:
    """One run of a grid: its id, the run-config overrides, and the blocks it belongs to."""

    run_id: str
    overrides: dict[str, Any]
    axes: dict[str, Any]
    blocks: tuple[str, ...]

    def setting(self, key: str) -> Any:
        """The effective value of a run-config key for this run."""
        return self.overrides.get(key, DEFAULTS[key])


@dataclass(frozen=True)
class Grid:
    name: str
    path: Path
    description: str
    base: dict[str, Any]
    blocks: dict[str, dict[str, list[Any]]]
    runs: list[GridRun]
    num_supernodes: int
    num_cpus_per_client: int
    num_gpus_per_client: float
    run_timeout: float | None
    metric: str = "accuracy"
    targets: dict[str, float] = field(default_factory=dict)
    compare: tuple[str, ...] = ()

    def runs_in(self, block: str) -> list[GridRun]:
        return [run for run in self.runs if block in run.blocks]


def _format_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    return str(value).replace("/", "_").replace(",", "+")


def run_id_for(axes: Mapping[str, Any], base: Mapping[str, Any]) -> str:
    """``k=v`` for every axis value, sorted by key, except values equal to the one ``base``
    sets for that key (so a block re-visiting the base setting names the same run);
    ``base`` if nothing is left."""
    parts = [
        f"{key}={_format_value(value)}"
        for key, value in sorted(axes.items())
        if key not in base or base[key] != value
    ]
    return ",".join(parts) or "base"


def _axes(block: Any, where: str) -> dict[str, list[Any]]:
    if not isinstance(block, Mapping) or not block:
        raise GridError(f"{where}: expected a mapping of run-config key -> list of values")
    axes: dict[str, list[Any]] = {}
    for key, values in block.items():
        if key not in DEFAULTS or key in _RUNNER_KEYS:
            raise GridError(f"{where}: '{key}' is not a run-config key the grid may vary")
        values = list(values) if isinstance(values, list | tuple) else [values]
        if not values:
            raise GridError(f"{where}.{key}: empty list of values")
        axes[str(key)] = values
    return axes


def _check_keys(mapping: Mapping[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(mapping) - allowed)
    if unknown:
        raise GridError(f"{where}: unknown key(s) {', '.join(unknown)}")


def _expand(
    base: dict[str, Any], blocks: dict[str, dict[str, list[Any]]], path: Path
) -> list[GridRun]:
    by_id: dict[str, GridRun] = {}
    for block_name, axes in blocks.items():
        keys = list(axes)
        for values in itertools.product(*(axes[k] for k in keys)):
            assignment = dict(zip(keys, values, strict=True))
            overrides = {**base, **assignment}
            try:
                resolve_config({}, overrides)
            except ConfigError as err:
                raise GridError(f"{path}: block '{block_name}' {assignment}: {err}") from err
            run_id = run_id_for(assignment, base)
            if run_id in by_id:
                known = by_id[run_id]
                if known.overrides != overrides:  # same id, other settings: ids must be unique
                    raise GridError(f"{path}: run id '{run_id}' names two different settings")
                if block_name not in known.blocks:
                    by_id[run_id] = GridRun(
                        run_id, overrides, {**known.axes, **assignment},
                        (*known.blocks, block_name),
                    )  # fmt: skip
                continue
            by_id[run_id] = GridRun(run_id, overrides, assignment, (block_name,))
    return list(by_id.values())


def load_grid(path: str | Path) -> Grid:
    """Read and check a grid file (a path, or a name in conf/grids/); every run's settings
    are validated with the app's schema before anything runs."""
    from omegaconf import OmegaConf

    path = Path(path)
    if not path.exists() and (GRIDS_DIR / f"{path}.yaml").exists():
        path = GRIDS_DIR / f"{path}.yaml"
    if not path.is_file():
        raise GridError(
            f"grid file {path} not found (grids in {GRIDS_DIR}: "
            f"{', '.join(p.stem for p in sorted(GRIDS_DIR.glob('*.yaml')))})"
        )
    try:
        raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except Exception as err:  # omegaconf/yaml parse errors have no common base class
        raise GridError(f"{path}: cannot parse: {err}") from err
    if not isinstance(raw, dict):
        raise GridError(f"{path}: expected a mapping at the top level")
    _check_keys(raw, _TOP_KEYS, str(path))

    base = dict(raw.get("base") or {})
    for key in base:
        if key not in DEFAULTS or key in _RUNNER_KEYS:
            raise GridError(f"{path}: base: '{key}' is not a run-config key a grid may set")
    blocks: dict[str, dict[str, list[Any]]] = {}
    if raw.get("grid") is not None:
        blocks[MAIN_BLOCK] = _axes(raw["grid"], f"{path}: grid")
    for name, block in (raw.get("blocks") or {}).items():
        if name == MAIN_BLOCK:
            raise GridError(f"{path}: blocks: '{MAIN_BLOCK}' is reserved for `grid`")
        blocks[str(name)] = _axes(block, f"{path}: blocks.{name}")
    if not blocks:
        raise GridError(f"{path}: needs `grid` or `blocks`")

    simulation = dict(raw.get("simulation") or {})
    _check_keys(simulation, _SIMULATION_KEYS, f"{path}: simulation")
    report = dict(raw.get("report") or {})
    _check_keys(report, _REPORT_KEYS, f"{path}: report")
    compare = tuple(report.get("compare") or ())
    for name in compare:
        if name not in blocks:
            raise GridError(f"{path}: report.compare: no block named '{name}'")

    num_supernodes = int(simulation.get("num-supernodes", 2))
    num_cpus = simulation.get("num-cpus-per-client", 1)
    if not isinstance(num_cpus, int) or num_cpus < 1:
        raise GridError(f"{path}: simulation.num-cpus-per-client must be a positive integer")
    num_gpus = float(simulation.get("num-gpus-per-client", 0.0))
    if num_supernodes < 1 or num_gpus < 0:
        raise GridError(f"{path}: simulation: num-supernodes >= 1, num-gpus-per-client >= 0")
    runs = _expand(base, blocks, path)
    for run in runs:
        if run.setting("min-available-nodes") > num_supernodes:
            raise GridError(
                f"{path}: run '{run.run_id}' waits for {run.setting('min-available-nodes')} "
                f"nodes but the simulation has num-supernodes = {num_supernodes}"
            )
    timeout = raw.get("run-timeout")
    return Grid(
        name=str(raw.get("name") or path.stem),
        path=path.resolve(),
        description=str(raw.get("description") or ""),
        base=base,
        blocks=blocks,
        runs=runs,
        num_supernodes=num_supernodes,
        num_cpus_per_client=num_cpus,
        num_gpus_per_client=num_gpus,
        run_timeout=None if timeout is None else float(timeout),
        metric=str(report.get("metric", "accuracy")),
        targets={str(k): float(v) for k, v in (report.get("targets") or {}).items()},
        compare=compare,
    )
