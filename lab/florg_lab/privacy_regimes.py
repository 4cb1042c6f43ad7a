"""Privacy-utility in the two deployed regimes (docs/privacy.md), for the verdict page.

The grids (``bash lab/scripts/evidence_privacy.sh``, published with ``PUBLISH_ONLY=1`` under
``lab/evidence/privacy-regimes/``: ``runs/<grid>/<run>/`` holding config.json, metrics.jsonl
and summary.json, and ``<grid>-tuning.json``):

* **cross-silo** (lab/grids/privacy-cross-silo.yaml, then ``privacy-cross-silo-eps3``):
  example-level DP-SGD on each of 6 clients (``dp=example``) at a target ε, FLoRG, FedIT
  and Fed-SB on movie sentiment, each method's adapter rate tuned at ε = 8 on seed 0
  (the tuning file's choice), seeds 0-2. ε = ∞ is protocol v2's published non-private
  runs of the same setting at each method's v2-chosen rate (evidence-v2's runs; Fed-SB's
  are the exact-aggregation grid's, evidence-v2-exact, once published);
* **cross-device** (``privacy-cross-device`` and ``privacy-cross-device-fed-sb``, written
  from the pilot): user-level central DP with Poisson client sampling over 1,000 SuperNodes
  on SNLI, each method's ε = ∞ arm in its grid; a tuning file, where published, fixes each
  method's rate.

Each regime's runs are grouped into levels and reported by
:mod:`florg_lab.privacy` (score against ε, paired by seed with ε = ∞, the
mechanism's medians). While a regime has no published private run its block says so, with
how many runs are published and the command that runs them, instead of failing.

The verdict page's privacy blocks and figures live here too (``privacy_table``,
``privacy_mechanism``, ``privacy_regime`` and their figures): the privacy grid's
(lab/grids/privacy.yaml, FLoRG against FedIT at ε in {∞, ~8, ~2}) and each regime's.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from florg_lab import page_v2
from florg_lab.contrast import Arm
from florg_lab.grid import load_grid
from florg_lab.page_text import NAMES, REFERENCE, Evidence, rate
from florg_lab.privacy import (
    PrivateRun,
    _epsilon,
    _level,
    collect,
    plot,
    report,
)
from florg_lab.runs import finished_runs_under

__all__ = [
    "ArmSource",
    "Regime",
    "REGIMES",
    "collect_regime",
    "markdown",
    "published_runs",
    "regime_plot",
]

PUBLISHED = "lab/evidence/privacy-regimes"
QUEUE = "bash lab/scripts/evidence_queue.sh"


@dataclass(frozen=True)
class Baseline:
    """Where a method's ε = ∞ runs lie: a grid summary (its chosen rate) and run folders."""

    summary: str
    folders: tuple[str, ...]


@dataclass(frozen=True)
class ArmSource:
    """Where one arm of a regime lies when not (only) in the regime's own grids: a method's
    runs at a changed setting published under another folder (``published``: ``runs/<grid>/``
    and ``<first grid>-tuning.json``, which chooses its rate), or its earlier runs kept
    beside them under a label of their own. ``baseline``: its ε = ∞ runs outside those grids;
    ``how``: the command that runs the grids, said while none of its runs is published."""

    method: str
    label: str  # the arm's name on the page ("" : the method's own name)
    published: str
    grids: tuple[str, ...]
    baseline: Baseline | None = None
    how: str = ""

    def name(self, names: Mapping[str, str]) -> str:
        return self.label or names[self.method]

    def tuning(self, root: Path) -> Path:
        return root / self.published / f"{self.grids[0]}-tuning.json"

    def run_folders(self, root: Path) -> list[Path]:
        return [root / self.published / "runs" / grid for grid in self.grids]


@dataclass(frozen=True)
class Regime:
    """One regime: its private grids (the first one's tuning file chooses the rates), task,
    methods, seeds, the runs it needs at least (``planned``) and each method's ε = ∞
    runs outside its grids (none: the grid holds its own ``dp=off`` arm). A method with
    entries in ``arm_sources`` is read from them alone, one arm each."""

    name: str
    grids: tuple[str, ...]
    task: str
    methods: tuple[str, ...]
    seeds: tuple[int, ...]
    planned: int
    baselines: Mapping[str, Baseline]
    queued: str = ""  # what runs first where the grid itself is not yet written
    tuned: bool = True  # whether a tuning file chooses the rates (else: the grid's one rate)
    arm_sources: tuple[ArmSource, ...] = ()

    @property
    def grid_file(self) -> str:
        return f"lab/grids/{self.grids[0]}.yaml"

    def tuning(self, root: Path) -> Path:
        return root / PUBLISHED / f"{self.grids[0]}-tuning.json"

    def run_folders(self, root: Path) -> list[Path]:
        return [root / PUBLISHED / "runs" / grid for grid in self.grids]

    def sources(self) -> list[ArmSource]:
        """Every arm's source, in the methods' order: a method's ``arm_sources``, or its
        runs in the regime's own grids and its ``baselines`` entry."""
        out = []
        for method in self.methods:
            own = [source for source in self.arm_sources if source.method == method]
            out += own or [ArmSource(method, "", PUBLISHED, self.grids,
                                     self.baselines.get(method))]  # fmt: skip
        return out


V2 = Baseline(
    "lab/evidence/evidence-v2/summary.json", ("lab/evidence/evidence-v2/runs/evidence-v2",)
)
EXACT = Baseline(
    "lab/evidence/evidence-v2-exact/summary.json",
    ("lab/evidence/evidence-v2-exact/runs/evidence-v2-exact",),
)
# Fed-SB at its authors' scale (s = 1, round 0 pooling the clients' gradients): its privacy
# arms rerun under lab/evidence/fed-sb-s1 (bash lab/scripts/evidence_fed_sb.sh); its arms
# at s = 4 stay beside them, labelled
FED_SB_S1 = "lab/evidence/fed-sb-s1"
FED_SB_S1_V2 = Baseline(f"{FED_SB_S1}/summary.json", (f"{FED_SB_S1}/runs/fed-sb-s1-v2-lr4x",))
FED_SB_BEFORE = "Fed-SB (s = 4, before the fix)"
FED_SB_RUNNER = "bash lab/scripts/evidence_fed_sb.sh ROOT"
REGIMES = (
    # tuning: 3 methods x at least 3 rates at seed 0, then seeds 1-2 at each chosen rate
    Regime("cross-silo", ("privacy-cross-silo", "privacy-cross-silo-eps3"), "movie-sentiment",
           ("florg", "fedit", "fed-sb"), (0, 1, 2), 15,
           {"florg": V2, "fedit": V2, "fed-sb": EXACT},
           arm_sources=(
               ArmSource("fed-sb", "", FED_SB_S1,
                         ("fed-sb-s1-privacy-cross-silo", "fed-sb-s1-privacy-cross-silo-eps3"),
                         FED_SB_S1_V2, FED_SB_RUNNER),
               ArmSource("fed-sb", FED_SB_BEFORE, PUBLISHED,
                         ("privacy-cross-silo", "privacy-cross-silo-eps3"), EXACT),
           )),
    # 3 methods x epsilon in {inf, 8, 2} x 3 seeds
    # (Fed-SB in a grid of its own, run at a later commit: its round 0 Poisson-sampled)
    Regime("cross-device", ("privacy-cross-device", "privacy-cross-device-fed-sb"), "snli",
           ("florg", "fedit", "fed-sb"), (0, 1, 2), 27, {},
           "is written from the pilot's results (lab/grids/privacy-cross-device-pilot.yaml, "
           "queued in `bash lab/scripts/evidence_queue.sh`) by `python -m "
           "florg_lab.cross_device_sizing "
           "lab/evidence/privacy-regimes/runs/privacy-cross-device-pilot --write-grid "
           "lab/grids/privacy-cross-device.yaml`", tuned=False,
           arm_sources=(
               ArmSource("fed-sb", "", FED_SB_S1, ("fed-sb-s1-privacy-cross-device",),
                         how=f"GRIDS=fed-sb-s1-privacy-cross-device {FED_SB_RUNNER}"),
               ArmSource("fed-sb", FED_SB_BEFORE, PUBLISHED, ("privacy-cross-device-fed-sb",)),
           )),
)  # fmt: skip


def _json(path: Path) -> Any:
    return json.loads(path.read_text())


def published_runs(regime: Regime, root: Path) -> int:
    """How many finished runs of the regime's grids (every arm source's) are published."""
    folders = {f for source in regime.sources() for f in source.run_folders(root) if f.is_dir()}
    folders |= {f for f in regime.run_folders(root) if f.is_dir()}
    return sum(1 for _ in finished_runs_under(sorted(folders)))


def chosen_rates(regime: Regime, root: Path, tuning: Path | None = None) -> dict[str, float]:
    """method -> the adapter rate its tuning chose (the tuning file's ``choices``, keyed by
    ``method=...[,task=...]``; ``tuning``: another file than the regime's); empty while no
    tuning file is published."""
    path = regime.tuning(root) if tuning is None else tuning
    if not path.is_file():
        return {}
    chosen = {}
    for key, value in _json(path).get("choices", {}).items():
        settings = dict(part.split("=", 1) for part in key.split(","))
        if settings.get("task", regime.task) == regime.task and "method" in settings:
            chosen[settings["method"]] = float(value)
    return chosen


def _baseline_rate(regime: Regime, root: Path, method: str, baseline: Baseline) -> float | None:
    """``method``'s v2-chosen rate in ``baseline``'s summary; None while not published."""
    path = root / baseline.summary
    if not path.is_file():
        return None
    entry = _json(path)["tasks"].get(regime.task, {}).get("methods", {}).get(method)
    return None if entry is None else float(entry["lr"])


def _run(
    label: str, folder: Path, summary: dict[str, Any], config: dict[str, Any]
) -> PrivateRun | None:
    """The run as :mod:`privacy` reads it; None without a final test score."""
    if summary.get("final-test-score") is None:
        return None
    level, clipping_norm = _level(config, folder)
    epsilon, delta = _epsilon(summary, level, folder)
    final = float(summary["final-test-score"])
    return PrivateRun(label, level, clipping_norm, int(config["seed"]), epsilon, delta, final,
                      folder)  # fmt: skip


def _add(found: dict[tuple[str, Any, int], PrivateRun], run: PrivateRun | None) -> None:
    """Keep ``run`` once per (arm, level, seed); two different scores are an error."""
    if run is None:
        return
    seen = found.setdefault((run.arm, run.level, run.seed), run)
    if seen.final != run.final:
        raise ValueError(
            f"{seen.folder} and {run.folder} are the same run ({run.arm}, "
            f"{run.level.label()}, seed {run.seed}) with different test scores"
        )


def collect_regime(regime: Regime, root: Path, names: Mapping[str, str]) -> list[PrivateRun]:
    """The regime's runs of its methods and seeds, one arm per source (``Regime.sources``),
    each labelled by it: its grids' runs (at its tuning's chosen rate where a tuning file is
    published), and its ε = ∞ runs at the v2-chosen rate from its baseline folders."""
    found: dict[tuple[str, Any, int], PrivateRun] = {}
    for source in regime.sources():
        _collect_source(regime, source, root, source.name(names), found)
    return sorted(found.values(), key=lambda r: (r.arm, r.level.label(), r.seed))


def _collect_source(
    regime: Regime,
    source: ArmSource,
    root: Path,
    label: str,
    found: dict[tuple[str, Any, int], PrivateRun],
) -> None:
    rates = chosen_rates(regime, root, source.tuning(root))  # empty: no tuning file
    grids = [f for f in source.run_folders(root) if f.is_dir()]
    for folder, summary, config in finished_runs_under(grids):
        if config.get("method") != source.method or config.get("task") != regime.task:
            continue
        if int(config.get("seed", -1)) not in regime.seeds:
            continue
        if rates and float(config.get("learning-rate", -1)) != rates.get(source.method):
            continue  # a tuning run at a rate not chosen
        _add(found, _run(label, folder, summary, config))
    if source.baseline is None:
        return
    lr = _baseline_rate(regime, root, source.method, source.baseline)
    if lr is None:
        return
    folders = [root / f for f in source.baseline.folders if (root / f).is_dir()]
    for folder, summary, config in finished_runs_under(folders):
        if (config.get("method"), config.get("task")) != (source.method, regime.task):
            continue
        if int(config.get("seed", -1)) not in regime.seeds or config.get("dp", "off") != "off":
            continue
        if float(config.get("learning-rate", -1)) == lr:
            _add(found, _run(label, folder, summary, config))


def _arms(regime: Regime, runs: Sequence[PrivateRun], names: Mapping[str, str]) -> list[str]:
    present = {r.arm for r in runs}
    return [s.name(names) for s in regime.sources() if s.name(names) in present]


def _unpublished(regime: Regime, root: Path, names: Mapping[str, str]) -> str:
    """A sentence per grid of an arm source with a runner that has no finished run
    published yet."""
    waiting = []
    for source in regime.sources():
        for grid, folder in zip(source.grids, source.run_folders(root), strict=True):
            if source.how and not (folder.is_dir() and any(finished_runs_under([folder]))):
                waiting.append(f"{source.name(names)}: {grid} not run yet (`{source.how}`).")
    return " ".join(waiting)


def markdown(
    regime: Regime, root: Path, names: Mapping[str, str], chance: float, figure: str
) -> str:
    """The regime's block: the score and mechanism tables and ``figure``'s link, or the
    line that says what is published so far."""
    runs = collect_regime(regime, root, names)
    published = published_runs(regime, root)
    if not any(r.level.private for r in runs):
        # a grid written from an earlier stage's results says how until it is written
        written = (root / regime.grid_file).is_file()
        queued = regime.queued if regime.queued and not written else f"is queued in `{QUEUE}`"
        return (
            f"Not yet run: {regime.grid_file} {queued}; {published} of at least "
            f"{regime.planned} runs published under {PUBLISHED}/runs/."
        )
    text = report(runs, _arms(regime, runs, names), chance)
    scores, _, mechanism = text.partition("\nThe mechanism, per arm and level")
    mechanism_table = "\n".join(line for line in mechanism.splitlines() if line.startswith("|"))
    grids = dict.fromkeys(g for source in regime.sources() for g in source.grids)
    status = f"{published} runs of {', '.join(grids)} published"
    if regime.tuned and not regime.tuning(root).is_file():
        status += "; tuning not finished (no tuning file): every published rate is shown"
    waiting = _unpublished(regime, root, names)
    return "\n".join(
        [
            f"{status}." + (f" {waiting}" if waiting else ""),
            "",
            scores.strip(),
            "",
            "What the mechanism did (medians over the training rounds of all seeds):",
            "",
            mechanism_table,
            "",
            f"![test score against ε, {regime.name}](../{figure})",
        ]
    )


def regime_plot(
    regime: Regime, root: Path, names: Mapping[str, str], chance: float, path: Path
) -> bool:
    """Draw the regime's figure at ``path``; False (nothing drawn) without a private run."""
    runs = collect_regime(regime, root, names)
    if not any(r.level.private for r in runs):
        return False
    plot(runs, _arms(regime, runs, names), path, chance)
    return True


# --- the verdict page's blocks and figures (python -m florg_lab.results_doc) -------------

# The privacy grid (lab/grids/privacy.yaml): FLoRG and FedIT at protocol v2's
# movie-sentiment rates; its ε = ∞ arm reuses evidence-v2's runs
PRIVACY_RUNS = ("lab/evidence/privacy/runs", page_v2.V2_RUNS[0])
PRIVACY_FIGURE = "lab/evidence/privacy/privacy-utility.png"
PRIVACY_GRID = "privacy"  # lab/grids/privacy.yaml: its private blocks' seeds are the page's
# The regimes: one block and figure each
REGIMES_FIGURE = "lab/evidence/privacy-regimes/{regime}.png"
REGIMES_SOURCES = (
    "the runs' summary.json and metrics.jsonl under lab/evidence/privacy-regimes/runs",
    "lab/evidence/privacy-regimes/*-tuning.json",
    page_v2.V2,
    page_v2.EXACT,
    f"the ε = ∞ runs under {page_v2.V2_RUNS[0]}, {page_v2.EXACT_RUNS[0]}",
    f"Fed-SB at s = 1: the runs and *-tuning.json under {FED_SB_S1}, its summary.json",
)


def private_seeds(grid_name: str) -> tuple[int, ...]:
    """The seeds a grid's private runs (``dp`` set, not ``off``) ran, read from its file."""
    grid = load_grid(grid_name)
    return tuple(sorted({int(r.setting("seed")) for r in grid.runs if r.setting("dp") != "off"}))


def _privacy(ev: Evidence) -> tuple[list[PrivateRun], list[str], float]:
    """The privacy grid's runs of FLoRG and FedIT at protocol v2's movie-sentiment rates
    (the arms), with that task's chance level."""
    task_entry = ev.summary(page_v2.V2)["tasks"]["movie-sentiment"]
    arms = []
    for method in (REFERENCE, "fedit"):
        lr = task_entry["methods"][method]["lr"]
        label = f"{NAMES[method]} (adapter {rate(lr)})"
        arms.append(Arm(label, (("method", method), ("learning-rate", f"{lr:g}"))))
    runs = collect([ev.root / p for p in PRIVACY_RUNS], arms, private_seeds(PRIVACY_GRID))
    return runs, [arm.label for arm in arms], float(task_entry["chance"])


def _privacy_parts(ev: Evidence) -> tuple[str, str]:
    """:func:`florg_lab.privacy.report`'s two parts: the score table, the mechanism's."""
    runs, labels, chance = _privacy(ev)
    scores, _, mechanism = report(runs, labels, chance).partition(
        "\nThe mechanism, per arm and level"
    )
    mechanism = "\n".join(line for line in mechanism.splitlines() if line.startswith("|"))
    return scores.strip(), mechanism


def privacy_table(ev: Evidence) -> str:
    return _privacy_parts(ev)[0]


def privacy_mechanism(ev: Evidence) -> str:
    return _privacy_parts(ev)[1]


def privacy_figure(ev: Evidence, path: Path) -> None:
    runs, labels, chance = _privacy(ev)
    plot(runs, labels, path, chance)


def _regime(name: str) -> Regime:
    return next(regime for regime in REGIMES if regime.name == name)


def _chance(ev: Evidence, regime: Regime) -> float:
    return float(ev.summary(page_v2.V2)["tasks"][regime.task]["chance"])


def privacy_regime(name: str) -> Callable[[Evidence], str]:
    """The regime's score and mechanism tables with its figure, or what is queued."""

    def make(ev: Evidence) -> str:
        regime = _regime(name)
        figure = REGIMES_FIGURE.format(regime=name)
        return markdown(regime, ev.root, NAMES, _chance(ev, regime), figure)

    return make


def privacy_regime_figure(name: str) -> Callable[[Evidence, Path], bool]:
    def draw(ev: Evidence, path: Path) -> bool:
        regime = _regime(name)
        return regime_plot(regime, ev.root, NAMES, _chance(ev, regime), path)

    return draw


def privacy_regime_drawn(name: str) -> Callable[[Evidence], bool]:
    """Whether the regime's figure is due: a private run of it is published."""

    def due(ev: Evidence) -> bool:
        return any(run.level.private for run in collect_regime(_regime(name), ev.root, NAMES))

    return due
