"""One setting changed: the same methods and seeds compared across two or more values.

A diagnostic grid often reruns a few methods of an evidence grid with one run-config key
changed (``dirichlet-alpha`` 0.5 -> 1, say) and everything else kept: the same seeds, so
the same data subsets and, per value, the same partitions for every method. This reads
finished runs from any grid folders, groups them by that key's value, and prints for every
**arm** (a method at its settings, e.g. ``method=florg,learning-rate=0.001``):

* per value: the final-round test score per seed, its mean with a 95% t interval, the mean
  of the last 3 rounds' test scores, and the score above ``--chance``;
* across values, paired by seed: each value minus the first (did the change move it?);
* with two or more arms, paired by seed: the first arm minus each other at every value,
  and how that gap moved between values (the per-seed difference of differences).

    python -m florg_lab.contrast \
        lab/evidence/evidence/runs/evidence-snli lab/evidence/evidence-snli-rho1/runs \
        --key dirichlet-alpha \
        --arms method=florg,learning-rate=0.001 method=fedit,learning-rate=0.002 \
        [--chance 0.361]

A run is a folder holding ``config.json`` (its resolved run config) and ``summary.json``
(``status: finished``, ``final-test-score``, ``test-last3``). A run matching two arms is an
error (make the arms narrower), and so is one (arm, value, seed) found twice with
different scores.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from florg_lab.runs import finished_runs_under
from florg_lab.stats import Paired, mean_interval, paired_difference

__all__ = [
    "Arm",
    "ArmRun",
    "add_arm_arguments",
    "arm_runs",
    "collect",
    "main",
    "parse_arm",
    "parsed_arms",
    "report",
]


@dataclass(frozen=True)
class Arm:
    """A method at its settings: the run-config values a run must have to belong to it."""

    label: str
    settings: tuple[tuple[str, str], ...]

    def matches(self, config: dict[str, Any]) -> bool:
        return all(key in config and _same(config[key], text) for key, text in self.settings)


@dataclass(frozen=True)
class ArmRun:
    """One finished run of an arm: the changed key's value, the seed and the test scores."""

    arm: str
    value: Any
    seed: int
    final: float
    last3: float
    folder: Path


def _same(config_value: Any, text: str) -> bool:
    """``config_value`` equals ``text`` read as a number where both are numbers (so 1e-3
    matches 0.001), else as text."""
    try:
        return math.isclose(float(config_value), float(text), rel_tol=1e-9, abs_tol=0.0)
    except (TypeError, ValueError):
        return str(config_value) == text


def parse_arm(text: str) -> Arm:
    """``key=value,key=value`` into an Arm; a clear error for anything else."""
    settings = []
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ValueError(f"arm {text!r}: expected key=value[,key=value...], got {part!r}")
        settings.append((key.strip(), value.strip()))
    return Arm(text, tuple(settings))


def arm_runs(
    roots: Sequence[Path], arms: Sequence[Arm]
) -> Iterator[tuple[Arm, Path, dict[str, Any], dict[str, Any]]]:
    """``(arm, folder, summary, config)`` of every finished run directly under ``roots``
    that one of ``arms`` matches; a run that two arms match is an error."""
    for folder, summary, config in finished_runs_under(roots):
        owners = [arm for arm in arms if arm.matches(config)]
        if len(owners) > 1:
            labels = " and ".join(arm.label for arm in owners)
            raise ValueError(f"{folder}: matches the arms {labels}; make them narrower")
        if owners:
            yield owners[0], folder, summary, config


def add_arm_arguments(parser: argparse.ArgumentParser) -> None:
    """The run folders and ``--arms``, as every command over arms takes them."""
    parser.add_argument("folders", nargs="+", type=Path, help="folders holding run folders")
    parser.add_argument(
        "--arms", nargs="+", required=True, help="key=value[,key=value] per method compared"
    )


def parsed_arms(parser: argparse.ArgumentParser, texts: Sequence[str]) -> list[Arm]:
    """``--arms`` as Arms; a malformed or repeated arm is the parser's usage error."""
    try:
        arms = [parse_arm(text) for text in texts]
    except ValueError as err:
        parser.error(str(err))
    if len({arm.label for arm in arms}) != len(arms):
        parser.error("--arms repeats an arm")
    return arms


def collect(roots: Sequence[Path], key: str, arms: Sequence[Arm]) -> list[ArmRun]:
    """Every finished run directly under ``roots`` that one of ``arms`` matches."""
    found: dict[tuple[str, Any, int], ArmRun] = {}
    for arm, folder, summary, config in arm_runs(roots, arms):
        if key not in config or "seed" not in config:
            raise ValueError(f"{folder}: config.json has no {key!r} or 'seed'")
        if summary.get("final-test-score") is None or summary.get("test-last3") is None:
            raise ValueError(f"{folder}: summary.json has no test scores")
        entry = ArmRun(
            arm.label,
            config[key],
            int(config["seed"]),
            float(summary["final-test-score"]),
            float(summary["test-last3"]),
            folder,
        )
        ident = (entry.arm, entry.value, entry.seed)
        seen = found.get(ident)
        if seen is not None and (seen.final, seen.last3) != (entry.final, entry.last3):
            raise ValueError(
                f"{seen.folder} and {folder} are the same run ({entry.arm}, "
                f"{key}={entry.value}, seed {entry.seed}) with different test scores "
                f"({seen.final} vs {entry.final})"
            )
        found.setdefault(ident, entry)
    return list(found.values())


def _scores(runs: Sequence[ArmRun], arm: str, value: Any) -> dict[int, ArmRun]:
    return {r.seed: r for r in runs if r.arm == arm and r.value == value}


def _interval_text(values: Sequence[float], offset: float = 0.0) -> str:
    interval = mean_interval(values)
    if math.isnan(interval.low):
        return f"{interval.mean - offset:+.3f} (one seed)"
    return (
        f"{interval.mean - offset:+.3f} "
        f"[{interval.low - offset:+.3f}, {interval.high - offset:+.3f}]"
    )


def _fmt(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _paired_text(paired: Paired, n: int) -> str:
    d = paired.difference
    if math.isnan(d.low):
        return f"{d.mean:+.3f} (one seed)"
    return f"{d.mean:+.3f} [{d.low:+.3f}, {d.high:+.3f}], higher on {paired.wins} of {n}"


def _score_table(
    runs: Sequence[ArmRun], arms: Sequence[str], values: Sequence[Any], key: str, chance: float
) -> list[str]:
    seeds = sorted({r.seed for r in runs})
    head = ["arm", key, *[f"seed {s}" for s in seeds], "mean [95% CI]", "last 3, mean"]
    if not math.isnan(chance):
        head.append("above chance")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm in arms:
        for value in values:
            found = _scores(runs, arm, value)
            if not found:
                continue
            finals = [found[s].final for s in sorted(found)]
            cells = [arm, _fmt(value)]
            cells += [f"{found[s].final:.3f}" if s in found else "–" for s in seeds]
            interval = mean_interval(finals)
            cells.append(str(interval).replace(" (n = 1)", ""))
            cells.append(f"{mean_interval([found[s].last3 for s in sorted(found)]).mean:.4f}")
            if not math.isnan(chance):
                cells.append(_interval_text(finals, chance))
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def _gap(runs: Sequence[ArmRun], a: str, b: str, value: Any) -> dict[int, float]:
    """Per seed: arm a's final test score minus arm b's, at ``value``."""
    sa, sb = _scores(runs, a, value), _scores(runs, b, value)
    return {s: sa[s].final - sb[s].final for s in sorted(set(sa) & set(sb))}


def _paired(x: dict[int, float], y: dict[int, float]) -> tuple[Paired, list[int]] | None:
    shared = sorted(set(x) & set(y))
    if not shared:
        return None
    return paired_difference([x[s] for s in shared], [y[s] for s in shared]), shared


def paired_by_seed_text(x: dict[int, float], y: dict[int, float]) -> str:
    """x − y over the seeds both have, as text ("no shared seed" when none)."""
    found = _paired(x, y)
    return "no shared seed" if found is None else _paired_text(found[0], len(found[1]))


def report(runs: Sequence[ArmRun], arms: Sequence[str], key: str, chance: float) -> str:
    """The score table and the paired comparisons, as markdown and plain lines."""
    values = sorted({r.value for r in runs})
    first = values[0]
    lines = _score_table(runs, arms, values, key, chance)
    lines += ["", f"Paired by seed, final-round test: each {key} minus {_fmt(first)}"]
    for arm in arms:
        base = {s: r.final for s, r in _scores(runs, arm, first).items()}
        for value in values[1:]:
            other = {s: r.final for s, r in _scores(runs, arm, value).items()}
            found = _paired(other, base)
            text = "no shared seed" if found is None else _paired_text(found[0], len(found[1]))
            lines.append(f"  {arm}: {key} {_fmt(value)} − {_fmt(first)}: {text}")
    if len(arms) > 1:
        lead = arms[0]
        lines += ["", "Paired by seed, final-round test: the first arm minus each other one"]
        for other_arm in arms[1:]:
            gaps = {value: _gap(runs, lead, other_arm, value) for value in values}
            for value, gap in gaps.items():
                zero = {s: 0.0 for s in gap}
                found = _paired(gap, zero)
                text = "no shared seed" if found is None else _paired_text(found[0], len(gap))
                lines.append(f"  {lead} − {other_arm}, {key} {_fmt(value)}: {text}")
            for value in values[1:]:
                found = _paired(gaps[value], gaps[first])
                text = "no shared seed" if found is None else _paired_text(found[0], len(found[1]))
                lines.append(f"  the gap at {key} {_fmt(value)} − the gap at {_fmt(first)}: {text}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arm_arguments(parser)
    parser.add_argument("--key", required=True, help="the run-config key that changes")
    parser.add_argument("--chance", type=float, default=math.nan, help="print scores above it")
    args = parser.parse_args(argv)
    arms = parsed_arms(parser, args.arms)
    if any(k == args.key for arm in arms for k, _ in arm.settings):
        parser.error(f"--arms must not fix --key {args.key!r}: it is what changes")
    try:
        runs = collect(args.folders, args.key, arms)
    except (OSError, ValueError) as err:
        print(f"contrast: {err}")
        return 2
    if not runs:
        print(f"contrast: no finished run of these arms under {', '.join(map(str, args.folders))}")
        return 2
    print(report(runs, [arm.label for arm in arms], args.key, args.chance))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
