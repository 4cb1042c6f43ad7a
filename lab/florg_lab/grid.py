"""Experiment grids: a YAML file in lab/grids/ describing many runs of the app.

A grid file looks like this (every key but ``base`` and one of ``grid``/``blocks`` is
optional)::

    name: main                     # results go to results/<name>/ unless --out says otherwise
    description: six methods x three tasks x two seeds
    simulation:                    # the simulated federation every run uses
      num-supernodes: 20
      num-cpus-per-client: 2       # CPUs per ClientApp actor (an int in Flower 1.41)
      num-gpus-per-client: 0.0
      ray-num-cpus: 20             # optional: Ray's logical CPUs, so 20 one-CPU actors on a
                                   # smaller machine (stragglers that wait hold no core)
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
      label: "(r = 4)"             # evidence reports: appended to this grid's method labels
    tuning:                        # optional: choose one setting per (task, method) first
      key: learning-rate           # the setting tuned; `grid` must not vary it
      values: [0.0005, 0.001, 0.002]
      seed: 0                      # the one seed the tuning runs use
      per: [task, method]          # `grid` axes the choice depends on
      extend: 2.0                  # optional (protocol v2): a choice at an end of the
      max-extensions: 4            #   values tried adds that end x/÷ extend, until interior

A run's id names its axis values except those equal to ``base`` (``method=fedit,seed=1``),
so the same setting reached from two blocks is one run, run once.

With ``tuning``, the block ``tuning`` runs every value of ``key`` for each combination
of the ``per`` axes at ``seed``; the choice is the value with the best validation
``score`` (mean over the last three rounds; ties go to the earlier value), written to
``<out>/tuning.json`` by ``choose_tuned``. The ``grid`` runs of a combination exist once
its choice does (``load_grid(path, choices)``), with ``key`` set to it, so the tuning
run at the chosen value is also the grid's run for ``seed``. With ``extend``, a
combination whose best value sits at an end of the values it has tried gets one more
value past that end (``choose_tuned`` computes them, ``load_grid(path, choices,
candidates)`` adds their runs), at most ``max-extensions`` times, so a choice is interior
unless the record says the cap was reached. Runs are ordered by the
first ``per`` axis, each value's tuning runs before its grid runs.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import strategies.registry  # noqa: F401  (every method registers: resolve_config reads them)
from flower_app.settings.config import ConfigError, defaults, resolve_config

__all__ = ["Grid", "GridError", "GridRun", "Tuning", "load_grid"]

GRIDS_DIR = Path(__file__).resolve().parents[1] / "grids"  # lab/grids/<name>.yaml
MAIN_BLOCK = "main"
_TOP_KEYS = {
    "name", "description", "simulation", "run-timeout", "base", "grid", "blocks", "report",
    "tuning",
}  # fmt: skip
_TUNING_KEYS = {"key", "values", "seed", "per", "extend", "max-extensions"}
_TUNING_REQUIRED = {"key", "values", "seed", "per"}
TUNING_BLOCK = "tuning"
TUNING_FILE = "tuning.json"
_SIMULATION_KEYS = {"num-supernodes", "num-cpus-per-client", "num-gpus-per-client", "ray-num-cpus"}
_REPORT_KEYS = {"metric", "targets", "compare", "label"}
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
        return self.overrides.get(key, defaults()[key])


@dataclass(frozen=True)
class Tuning:
    """One setting chosen per combination of the ``per`` axes (the paper's protocol:
    the same candidate values for every method, chosen on validation with one seed)."""

    key: str
    values: tuple[Any, ...]
    seed: int
    per: tuple[str, ...]
    extend: float = 0.0  # > 1: a choice at an end of the values tried extends them
    max_extensions: int = 0

    def combo(self, assignment: Mapping[str, Any]) -> str:
        """The id of the combination an assignment belongs to (``method=fedit,task=snli``)."""
        return ",".join(f"{k}={_format_value(assignment[k])}" for k in sorted(self.per))


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
    ray_num_cpus: int | None
    run_timeout: float | None
    metric: str = "accuracy"
    targets: dict[str, float] = field(default_factory=dict)
    compare: tuple[str, ...] = ()
    label: str = ""  # evidence reports: appended to the method labels of this grid's runs
    tuning: Tuning | None = None
    pending_combos: tuple[str, ...] = ()  # tuning combinations without a choice yet
    expected_runs: int = 0  # runs once every choice is made

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
        if key not in defaults() or key in _RUNNER_KEYS:
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


def _tuning(raw: Any, blocks: dict[str, dict[str, list[Any]]], base: dict, path: Path) -> Tuning:
    where = f"{path}: tuning"
    if not isinstance(raw, Mapping):
        raise GridError(f"{where}: expected a mapping with key, values, seed, per")
    _check_keys(raw, _TUNING_KEYS, where)
    missing = sorted(_TUNING_REQUIRED - set(raw))
    if missing:
        raise GridError(f"{where}: missing {', '.join(missing)}")
    key, per = str(raw["key"]), tuple(str(p) for p in raw["per"])
    values = tuple(raw["values"]) if isinstance(raw["values"], list | tuple) else ()
    if key not in defaults() or key in _RUNNER_KEYS or key == "seed":
        raise GridError(f"{where}.key: '{key}' is not a run-config key that can be tuned")
    if not values:
        raise GridError(f"{where}.values: give a non-empty list")
    main = blocks.get(MAIN_BLOCK)
    if main is None:
        raise GridError(f"{where}: needs `grid` (the runs that use the choices)")
    if key in main or key in base:
        raise GridError(f"{where}: `grid` and `base` must not set the tuned key '{key}'")
    if not set(per) <= set(main) or not set(main) <= {*per, "seed"}:
        raise GridError(f"{where}.per: must name the axes of `grid` other than seed")
    extend = float(raw.get("extend", 0.0))
    max_extensions = int(raw.get("max-extensions", 4 if extend else 0))
    if extend and (extend <= 1 or max_extensions < 1):
        raise GridError(f"{where}: extend must be > 1 and max-extensions >= 1")
    if extend and not all(isinstance(v, int | float) and v > 0 for v in values):
        raise GridError(f"{where}.extend: needs positive numeric values")
    return Tuning(key, values, int(raw["seed"]), per, extend, max_extensions)


def _tuned_blocks(
    tuning: Tuning,
    blocks: dict[str, dict[str, list[Any]]],
    choices: Mapping[str, Any],
    candidates: Mapping[str, list[Any]],
) -> tuple[dict[str, dict[str, list[Any]]], list[str], int]:
    """One tuning block per combination (its candidate values: ``candidates[combo]`` or
    the grid's), and the `grid` block split into one block per combination that has a
    choice; also the combinations still waiting and the run count once all are made."""
    main = blocks.pop(MAIN_BLOCK)
    per_axes = {k: main[k] for k in tuning.per}
    seeds = main.get("seed", [defaults()["seed"]])
    tuned: dict[str, dict[str, list[Any]]] = {}
    pending, expected = [], 0
    shared = 1 if tuning.seed in seeds else 0
    for values in itertools.product(*per_axes.values()):
        assignment = dict(zip(per_axes, values, strict=True))
        combo = tuning.combo(assignment)
        chosen = {k: [v] for k, v in assignment.items()}
        tried = list(candidates.get(combo) or tuning.values)
        tuned[f"{TUNING_BLOCK}:{combo}"] = {**chosen, tuning.key: tried, "seed": [tuning.seed]}
        expected += len(tried) + len(seeds) - shared
        if combo not in choices:
            pending.append(combo)
            continue
        tuned[f"{MAIN_BLOCK}:{combo}"] = {**chosen, tuning.key: [choices[combo]], "seed": seeds}
    return {**tuned, **blocks}, pending, expected


def _ordered(runs: list[GridRun], tuning: Tuning, first_axis: list[Any]) -> list[GridRun]:
    """Each value of the first ``per`` axis: its tuning runs, then its grid runs."""
    axis = tuning.per[0]

    def rank(run: GridRun) -> tuple[int, int]:
        value = run.axes.get(axis)
        position = first_axis.index(value) if value in first_axis else len(first_axis)
        in_tuning = any(_main_name(b) == TUNING_BLOCK for b in run.blocks)
        return position, 0 if in_tuning else 1

    return sorted(runs, key=rank)


def _merged(blocks: list[dict[str, list[Any]]]) -> dict[str, list[Any]]:
    """The axes of several blocks as one: each key's values in first-seen order."""
    merged: dict[str, list[Any]] = {}
    for block in blocks:
        for key, values in block.items():
            merged.setdefault(key, [])
            merged[key] += [v for v in values if v not in merged[key]]
    return merged


def _main_name(name: str) -> str:
    """A per-combination block's name without its combination (``main``, ``tuning``)."""
    for block in (MAIN_BLOCK, TUNING_BLOCK):
        if name.startswith(f"{block}:"):
            return block
    return name


def load_grid(
    path: str | Path,
    choices: Mapping[str, Any] | None = None,
    candidates: Mapping[str, list[Any]] | None = None,
) -> Grid:
    """Read and check a grid file (a path, or a name in lab/grids/); every run's settings
    are validated with the app's schema before anything runs. ``choices`` maps a tuning
    combination (``Tuning.combo``) to its chosen value, ``candidates`` to the values it
    tries when tuning extended them (both from ``<out>/tuning.json``)."""
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
        if key not in defaults() or key in _RUNNER_KEYS:
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
    label = str(report.get("label") or "").strip()
    if "|" in label or "\n" in label:
        raise GridError(f"{path}: report.label: no '|' or line breaks (it goes into tables)")

    tuning = None
    pending: list[str] = []
    expected = 0
    if raw.get("tuning") is not None:
        tuning = _tuning(raw["tuning"], blocks, base, path)
        main_axes = dict(blocks[MAIN_BLOCK])
        first_axis = list(main_axes[tuning.per[0]])
        blocks, pending, expected = _tuned_blocks(
            tuning, blocks, dict(choices or {}), dict(candidates or {})
        )

    num_supernodes = int(simulation.get("num-supernodes", 2))
    num_cpus = simulation.get("num-cpus-per-client", 1)
    if not isinstance(num_cpus, int) or num_cpus < 1:
        raise GridError(f"{path}: simulation.num-cpus-per-client must be a positive integer")
    num_gpus = float(simulation.get("num-gpus-per-client", 0.0))
    if num_supernodes < 1 or num_gpus < 0:
        raise GridError(f"{path}: simulation: num-supernodes >= 1, num-gpus-per-client >= 0")
    ray_cpus = simulation.get("ray-num-cpus")
    if ray_cpus is not None and (not isinstance(ray_cpus, int) or ray_cpus < num_cpus):
        raise GridError(
            f"{path}: simulation.ray-num-cpus must be an integer >= num-cpus-per-client"
        )
    runs = _expand(base, blocks, path)
    if tuning is not None:
        runs = _ordered(runs, tuning, first_axis)
        runs = [
            GridRun(r.run_id, r.overrides, r.axes, tuple(dict.fromkeys(map(_main_name, r.blocks))))
            for r in runs
        ]
        blocks = {
            MAIN_BLOCK: main_axes,
            TUNING_BLOCK: _merged([v for k, v in blocks.items() if _main_name(k) == TUNING_BLOCK]),
            **{k: v for k, v in blocks.items() if _main_name(k) == k},
        }
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
        ray_num_cpus=ray_cpus,
        run_timeout=None if timeout is None else float(timeout),
        metric=str(report.get("metric", "accuracy")),
        targets={str(k): float(v) for k, v in (report.get("targets") or {}).items()},
        compare=compare,
        label=label,
        tuning=tuning,
        pending_combos=tuple(pending),
        expected_runs=expected or len(runs),
    )
