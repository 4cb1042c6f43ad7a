"""Privacy-utility: held-out test score against the privacy budget ε (issue 29).

Reads finished runs (folders holding ``config.json`` and ``summary.json``) from any grid
folders, keeps those that one of ``--arms`` matches (a method at its settings, e.g.
``method=florg,learning-rate=0.0005``), and groups each arm's runs by privacy level:
``dp=off`` (ε = ∞) or ``dp=central`` at one noise multiplier z (each method keeps its
own clipping norm C, read from its non-private runs: docs/privacy.md). A level's ε is
the accountant's value after the run's last round, as the run's summary recorded it
(``dp-epsilon`` at ``dp-delta``). Every run of a level must report the same ε (same z,
q, T and δ), else the runs are not one level and this says so. With Poisson client
sampling (``client-sampling=poisson``) the level is (z, q), q = ``fraction-train``.

Example-level DP-SGD (``dp=example``) is a level per target ε
(``dp-sgd-target-epsilon``; per z where the runs fix ``dp-sgd-noise-multiplier``), and its
ε is the largest over the level's runs of the summary's ``dp-sgd-epsilon-max`` (each
client has its own δ = 1 / (10 n), so the runs need not agree to the digit). Its mechanism
table shows the DP-SGD keys (``EXAMPLE_MECHANISM_KEYS``), and a grid with Poisson client
sampling adds the sampled count and the divisor to the central ones.

It prints, and with ``--out DIR`` writes as ``DIR/privacy-utility.md`` and
``DIR/privacy-utility.png``:

* per arm and level: z, C, ε, the final-round test score per seed, its mean with a 95%
  t interval, and the cost of privacy: the level minus ε = ∞, paired by seed;
* per level, paired by seed: the first arm minus each other one;
* what the mechanism did, per arm and level: medians over every training round of all
  seeds of the rows' update norms, clipped clients, sensitivity, noise std, sent
  parameters and (FLoRG) negative eigenvalues of the noised Gram (``MECHANISM_KEYS``);
* the plot: mean test score (95% interval as error bars) against ε on a log axis, with
  ε = ∞ drawn at the right end.

    python -m florg_lab.privacy results/privacy/runs \
        --arms method=florg,learning-rate=0.0005 method=fedit,learning-rate=0.004 \
        [--seeds 0 1 2] [--chance 0.49] [--out lab/evidence/privacy]

The same (arm, level, seed) found twice with different test scores is an error (runs are
deterministic, so a run reused from another grid must agree with its rerun).
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

from florg_lab.communication import load_metrics  # noqa: E402
from florg_lab.contrast import (  # noqa: E402
    Arm,
    add_arm_arguments,
    arm_runs,
    paired_by_seed_text,
    parsed_arms,
)
from florg_lab.stats import mean_interval  # noqa: E402

__all__ = ["Level", "PrivateRun", "collect", "main", "mechanism_keys", "plot", "report"]


# metrics.jsonl keys that show what the mechanism did (docs/privacy.md): the clients'
# update norms, how many were clipped, the sensitivity and the noise's standard deviation
# on the mean, the parameters all clients sent up, and (FLoRG) Q-hat's negative eigenvalues
MECHANISM_KEYS = {
    "clients": "clients",
    "update-norm-median": "update norm (median client)",
    "dp-clipped": "clipped clients",
    "dp-sensitivity": "sensitivity",
    "dp-noise-std": "noise std",
    "up-params": "params sent up (all clients)",
    "negative_eigenvalues": "negative eigenvalues / layer",
}


# dp=example's keys (strategies/server/example_dp.py): the clients' clipped fraction, the
# per-example gradient norm, the clipped mean gradient's norm against the noise on it
EXAMPLE_MECHANISM_KEYS = {
    "clients": "clients",
    "dp-sgd-clipped-fraction": "clipped fraction (mean client)",
    "dp-sgd-grad-norm-median": "example grad norm (median)",
    "dp-sgd-clipped-mean-norm": "clipped mean grad norm",
    "dp-sgd-noise-std": "noise std on the mean",
    "dp-sgd-noise-norm": "noise norm on the mean",
    "up-params": "params sent up (all clients)",
}
# dp=central with Poisson client sampling: the sampled count and the divisor q N besides
POISSON_MECHANISM_KEYS = {
    **MECHANISM_KEYS,
    "dp-sampled": "sampled clients",
    "dp-divisor": "divisor",
}


@dataclass(frozen=True)
class Level:
    """A privacy setting: ``dp`` and, for dp=central, the noise multiplier z (with Poisson
    client sampling also its rate q); for dp=example the target ε, or z where it is fixed."""

    dp: str
    noise_multiplier: float | None
    sample_rate: float | None = None
    target_epsilon: float | None = None

    @property
    def private(self) -> bool:
        return self.dp != "off"

    def label(self) -> str:
        if not self.private:
            return "off"
        if self.dp == "example":
            if self.target_epsilon is not None:
                return f"DP-SGD, target ε = {self.target_epsilon:g}"
            return f"DP-SGD, z = {self.noise_multiplier:g}"
        if self.sample_rate is not None:
            return f"{self.dp}, z = {self.noise_multiplier:g}, q = {self.sample_rate:g}"
        return f"{self.dp}, z = {self.noise_multiplier:g}"


@dataclass(frozen=True)
class PrivateRun:
    """One finished run: its arm, privacy level, clipping norm (None for dp=off), seed,
    ε (∞ for dp=off) and test score."""

    arm: str
    level: Level
    clipping_norm: float | None
    seed: int
    epsilon: float
    delta: float | None
    final: float
    folder: Path


def _level(config: dict[str, Any], folder: Path) -> tuple[Level, float | None]:
    """The run's level and clipping norm."""
    dp = str(config.get("dp", "off"))
    if dp == "off":
        return Level("off", None), None
    try:
        if dp == "example":
            return _example_level(config), float(config["dp-sgd-clipping-norm"])
        rate = None
        if config.get("client-sampling") == "poisson":  # q is fraction-train
            rate = float(config["fraction-train"])
        z = float(config["dp-noise-multiplier"])
        return Level(dp, z, rate), float(config["dp-clipping-norm"])
    except KeyError as err:
        raise ValueError(f"{folder}: dp={dp} but config.json has no {err.args[0]!r}") from err


def _example_level(config: dict[str, Any]) -> Level:
    """dp=example's level: its target ε, or its fixed z where no target is set."""
    target = float(config.get("dp-sgd-target-epsilon") or 0.0)
    if target > 0:
        return Level("example", None, target_epsilon=target)
    return Level("example", float(config["dp-sgd-noise-multiplier"]))


def _epsilon(summary: dict[str, Any], level: Level, folder: Path) -> tuple[float, float | None]:
    if not level.private:
        return math.inf, None
    if level.dp == "example":  # the clients' largest, each at its own delta
        if summary.get("dp-sgd-epsilon-max") is None:
            raise ValueError(f"{folder}: a dp=example run whose summary.json has no "
                             "dp-sgd-epsilon-max")  # fmt: skip
        return float(summary["dp-sgd-epsilon-max"]), None
    epsilon, delta = summary.get("dp-epsilon"), summary.get("dp-delta")
    if epsilon is None or delta is None:
        raise ValueError(f"{folder}: a dp={level.dp} run whose summary.json has no dp-epsilon")
    return float(epsilon), float(delta)


def collect(
    roots: Sequence[Path], arms: Sequence[Arm], seeds: Sequence[int] | None = None
) -> list[PrivateRun]:
    """Every finished run directly under ``roots`` that one of ``arms`` matches (and whose
    seed is in ``seeds``, when given)."""
    found: dict[tuple[str, Level, int], PrivateRun] = {}
    for arm, folder, summary, config in arm_runs(roots, arms):
        seed = int(config["seed"])
        if seeds is not None and seed not in seeds:
            continue
        if summary.get("final-test-score") is None:
            raise ValueError(f"{folder}: summary.json has no final-test-score")
        level, clipping_norm = _level(config, folder)
        epsilon, delta = _epsilon(summary, level, folder)
        final = float(summary["final-test-score"])
        run = PrivateRun(arm.label, level, clipping_norm, seed, epsilon, delta, final, folder)
        seen = found.setdefault((run.arm, level, seed), run)
        if seen.final != run.final:
            raise ValueError(
                f"{seen.folder} and {folder} are the same run ({run.arm}, {level.label()}, "
                f"seed {seed}) with different test scores ({seen.final} vs {run.final})"
            )
    return list(found.values())


def _levels(runs: Sequence[PrivateRun]) -> list[Level]:
    """The levels present, least private first (ε = ∞, then ε descending)."""
    eps = {run.level: run.epsilon for run in runs}
    return sorted(eps, key=lambda level: -eps[level])


def _level_epsilon(runs: Sequence[PrivateRun], level: Level) -> tuple[float, float | None]:
    """The one (ε, δ) every run of ``level`` reports; an error when they differ. For
    dp=example: the largest client ε over the level's runs (no one δ)."""
    if level.dp == "example":
        return max(r.epsilon for r in runs if r.level == level), None
    values = {(round(r.epsilon, 6), r.delta) for r in runs if r.level == level}
    if len(values) != 1:
        listed = ", ".join(f"epsilon {e:g} at delta {d}" for e, d in sorted(values))
        raise ValueError(f"the runs at {level.label()} report different budgets: {listed}")
    return next(iter(values))


def _of(runs: Sequence[PrivateRun], arm: str, level: Level) -> dict[int, float]:
    return {r.seed: r.final for r in runs if r.arm == arm and r.level == level}


def _at_budget(
    runs: Sequence[PrivateRun],
    arm: str,
    levels: Sequence[Level],
    budgets: dict[Level, tuple[float, float | None]],
    eps_text: str,
) -> dict[int, float]:
    """``arm``'s scores by seed over the levels whose ε reads ``eps_text``; an error when
    two of them hold the same seed (the pairing would be ambiguous)."""
    scores: dict[int, float] = {}
    for level in levels:
        if _epsilon_text(budgets[level][0]) != eps_text:
            continue
        found = _of(runs, arm, level)
        if found.keys() & scores.keys():
            raise ValueError(f"{arm} has two levels at ε = {eps_text} with the same seed")
        scores |= found
    return scores


def _clipping_text(runs: Sequence[PrivateRun], arm: str, level: Level) -> str:
    norms = sorted({r.clipping_norm for r in runs if r.arm == arm and r.level == level} - {None})
    return ", ".join(f"{c:.3g}" for c in norms) or "–"


def _interval(values: Sequence[float]) -> str:
    interval = mean_interval(values)
    if math.isnan(interval.low):
        return f"{interval.mean:.3f} (one seed)"
    return f"{interval.mean:.3f} [{interval.low:.3f}, {interval.high:.3f}]"


def _epsilon_text(epsilon: float) -> str:
    return "∞" if math.isinf(epsilon) else f"{epsilon:.2f}"


def report(runs: Sequence[PrivateRun], arms: Sequence[str], chance: float = math.nan) -> str:
    """The score table and the paired comparisons, as markdown."""
    levels = _levels(runs)
    budgets = {level: _level_epsilon(runs, level) for level in levels}
    seeds = sorted({r.seed for r in runs})
    delta = next((d for _, d in budgets.values() if d is not None), None)
    head = ["arm", "dp", "ε" + (f" (δ = {delta:.3g})" if delta else ""), "C"]
    head += [f"seed {s}" for s in seeds] + ["test, mean [95% CI]", "− ε = ∞, paired"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    baseline = next((level for level in levels if not level.private), None)
    for arm in arms:
        for level in levels:
            scores = _of(runs, arm, level)
            if not scores:
                continue
            cost = "–"
            if baseline is not None and level != baseline:
                cost = paired_by_seed_text(scores, _of(runs, arm, baseline))
            cells = [
                arm,
                level.label(),
                _epsilon_text(budgets[level][0]),
                _clipping_text(runs, arm, level),
                *[f"{scores[s]:.3f}" if s in scores else "–" for s in seeds],
                _interval(list(scores.values())),
                cost,
            ]
            lines.append("| " + " | ".join(cells) + " |")
    if len(arms) > 1:
        lines += ["", f"Paired by seed, final-round test: {arms[0]} minus each other arm", ""]
        # paired at one budget, not one level: methods that release before round 1 (Fed-SB's
        # round 0) reach the same ε at a different z
        eps_texts = list(dict.fromkeys(_epsilon_text(budgets[level][0]) for level in levels))
        mine = {eps: _at_budget(runs, arms[0], levels, budgets, eps) for eps in eps_texts}
        for other in arms[1:]:
            for eps in eps_texts:
                theirs = _at_budget(runs, other, levels, budgets, eps)
                text = paired_by_seed_text(mine[eps], theirs)
                lines.append(f"- ε = {eps}: {arms[0]} − {other}: {text}")
    lines += _mechanism_lines(runs, arms, levels, budgets)
    if not math.isnan(chance):
        lines += ["", f"Chance (the majority class of the test split): {chance:.3f}"]
    return "\n".join(lines)


def _mechanism_lines(
    runs: Sequence[PrivateRun],
    arms: Sequence[str],
    levels: Sequence[Level],
    budgets: dict[Level, tuple[float, float | None]],
) -> list[str]:
    """Per arm and level, the median over every training round of every seed of the keys
    the rows carry (``mechanism_keys``; '–' where a method's rows lack one)."""
    keys = mechanism_keys(levels)
    head = ["arm", "ε", *keys.values()]
    lines = [
        "",
        "The mechanism, per arm and level: medians over the training rounds of all seeds",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for arm in arms:
        for level in levels:
            folders = [r.folder for r in runs if r.arm == arm and r.level == level]
            if not folders:
                continue
            rows = [
                row
                for folder in folders
                for row in load_metrics(folder / "metrics.jsonl")
                if row.get("round", 0) >= 1
            ]
            cells = [arm, _epsilon_text(budgets[level][0])]
            for key in keys:
                values = [float(row[key]) for row in rows if row.get(key) is not None]
                cells.append(f"{statistics.median(values):.4g}" if values else "–")
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def mechanism_keys(levels: Sequence[Level]) -> dict[str, str]:
    """The mechanism table's keys and headings: dp=example's where a level is DP-SGD, the
    central ones with the sampled count where one samples by Poisson, else the central."""
    if any(level.dp == "example" for level in levels):
        return EXAMPLE_MECHANISM_KEYS
    if any(level.sample_rate is not None for level in levels):
        return POISSON_MECHANISM_KEYS
    return MECHANISM_KEYS


def plot(runs: Sequence[PrivateRun], arms: Sequence[str], path: Path, chance: float) -> Path:
    """Mean test score with its 95% interval against ε (log axis; ∞ at the right end)."""
    levels = _levels(runs)
    budgets = {level: _level_epsilon(runs, level)[0] for level in levels}
    finite = [e for e in budgets.values() if math.isfinite(e)]
    infinity_at = 4 * max(finite) if finite else 1.0
    fig, ax = plt.subplots(figsize=(6, 4))
    for index, arm in enumerate(arms):
        nudge = 1.04 ** (index - (len(arms) - 1) / 2)  # side by side, so the bars stay apart
        xs, means, errors = [], [], []
        for level in levels:
            scores = list(_of(runs, arm, level).values())
            if not scores:
                continue
            interval = mean_interval(scores)
            eps = budgets[level]
            xs.append((infinity_at if math.isinf(eps) else eps) * nudge)
            means.append(interval.mean)
            half = 0.0 if math.isnan(interval.low) else interval.high - interval.mean
            errors.append(half)
        ax.errorbar(xs, means, yerr=errors, marker="o", capsize=4, label=arm)
    if not math.isnan(chance):
        ax.axhline(chance, color="grey", linestyle=":", label="chance")
    ax.set_xscale("log")
    ticks = sorted(set(finite)) + [infinity_at]
    ax.set_xticks(ticks, [f"{t:.3g}" for t in sorted(set(finite))] + ["∞"])
    ax.minorticks_off()
    example = any(level.dp == "example" for level in levels)
    unit = "example-level, largest client" if example else "user-level"
    ax.set_xlabel(f"ε ({unit}, after the last round)")
    ax.set_ylabel("final-round test score (mean, 95% CI)")
    ax.legend(fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m florg_lab.privacy", description=__doc__.split("\n\n")[0]
    )
    add_arm_arguments(parser)
    parser.add_argument("--seeds", nargs="+", type=int, help="only these seeds")
    parser.add_argument("--chance", type=float, default=math.nan, help="draw and print it")
    parser.add_argument("--out", type=Path, help="write privacy-utility.md and .png here")
    args = parser.parse_args(argv)
    arms = parsed_arms(parser, args.arms)
    if any(key.startswith("dp") for arm in arms for key, _ in arm.settings):
        parser.error("--arms must not fix a dp setting: the privacy level is what changes")
    try:
        runs = collect(args.folders, arms, args.seeds)
        if not runs:
            raise ValueError(
                f"no finished run of these arms under {', '.join(map(str, args.folders))}"
            )
        text = report(runs, [arm.label for arm in arms], args.chance)
    except (OSError, ValueError) as err:
        print(f"privacy: {err}")
        return 2
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "privacy-utility.md").write_text(text + "\n")
        png = plot(runs, [arm.label for arm in arms], args.out / "privacy-utility.png", args.chance)
        print(f"\nwrote {args.out / 'privacy-utility.md'} and {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
