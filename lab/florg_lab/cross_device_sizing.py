"""The cross-device private grid's numbers, read from its non-private pilot (docs/privacy.md,
client sampling; lab/grids/privacy-cross-device-pilot.yaml).

    python -m florg_lab.cross_device_sizing PILOT_RUNS [--target 0.48]
        [--reference fedit [florg ...]] [--delta 1e-4] [--epsilons 8 2] [--runs-per-method 9]
        [--write-grid lab/grids/privacy-cross-device.yaml [--methods fedit florg]
         [--name privacy-cross-device]]

It prints, from the pilot's finished runs (the folder holding one run folder per run):

* **T, the rounds**: each reference method's test curve, each test round's score with its
  95% Wilson interval over the test examples, and its first test round whose interval lies
  wholly at or above the target (the pilot's "chance + 0.15 with a margin of one test
  interval"); T is the latest of these, so that every reference method's ε = ∞ arm has
  learned by then. A run that never gets there is named with its last round: continue it
  from its checkpoint rather than rerun it.
* **C per method**: the clipping norm, the median over rounds of the round's median client
  update norm (:mod:`florg_lab.clipping`, the same rule as the q = 1 grid).
* **z per method and target ε**: the noise multiplier whose releases of the
  Poisson-subsampled Gaussian mechanism at the pilot's q end at ε, δ
  (``noise_multiplier_for``, the accountant the app records ``dp-epsilon`` with): T, plus
  the method's releases before round 1 (``Method.dp_initial_releases``: Fed-SB's round 0),
  which its accountant composes too; and the noise std per coordinate of the released mean,
  z C / (q N) (docs/privacy.md, client sampling's divisor).
* **The cost**: each method's seconds per round in the pilot (its ``wall-seconds`` over its
  rounds, evaluation included), times T, times the grid's runs per method.

With ``--write-grid PATH`` it also writes the private grid itself (:func:`private_grid`),
named ``--name``: the pilot grid's setting (``--pilot-grid``) at T rounds, every method of
``--methods`` (default: the pilot's) without DP (ε = ∞) and with ``dp=central`` at each ε
with its C and z, over ``--seeds``; the file's header names the command and the numbers, so
the grid is regenerated, never edited by hand. A method whose runs must run at another
commit than the rest gets a grid of its own this way.
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

import strategies.registry  # noqa: F401  (every method registers: resolve_config reads them)
from florg_lab.clipping import RunNorms, clipping_norms, run_norms
from florg_lab.communication import load_metrics
from florg_lab.runs import finished_run
from flower_app.methods.registry import get_method
from flower_app.privacy.accounting import noise_multiplier_for

__all__ = [
    "PilotRun",
    "ScoredRound",
    "first_round_above",
    "load_pilot",
    "noise_multipliers",
    "private_grid",
    "releases",
    "round_up",
    "wilson_interval",
]

Z_95 = 1.959963984540054  # the standard normal's 97.5% quantile


def wilson_interval(score: float, n: int, z: float = Z_95) -> tuple[float, float]:
    """The Wilson score interval of an accuracy ``score`` over ``n`` examples (95% at the
    default z): the interval a test score's sampling alone puts around it."""
    if n <= 0:
        raise ValueError(f"a test score needs at least one example, got n = {n}")
    if not 0.0 <= score <= 1.0:
        raise ValueError(f"an accuracy lies in [0, 1], got {score}")
    z2 = z * z
    centre = (score + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * math.sqrt(score * (1 - score) / n + z2 / (4 * n * n))
    return centre - half, centre + half


@dataclass(frozen=True)
class ScoredRound:
    """One test round of a run: its score over ``n`` examples and the Wilson interval."""

    round: int
    score: float
    n: int

    @property
    def interval(self) -> tuple[float, float]:
        return wilson_interval(self.score, self.n)


@dataclass(frozen=True)
class PilotRun:
    """What the sizing reads from one finished pilot run."""

    name: str
    method: str
    rounds: int
    seconds_per_round: float
    sample_rate: float
    population: int
    tests: tuple[ScoredRound, ...]
    norms: RunNorms | None


def first_round_above(tests: Sequence[ScoredRound], target: float) -> ScoredRound | None:
    """The first test round whose whole interval lies at or above ``target``, or ``None``."""
    for point in sorted(tests, key=lambda p: p.round):
        if point.interval[0] >= target:
            return point
    return None


def _pilot_run(folder: Path) -> PilotRun:
    found = finished_run(folder)
    if found is None:
        raise ValueError(f"{folder}: not a finished run (summary.json, config.json)")
    summary, config = found
    rows = load_metrics(folder / "metrics.jsonl")
    trained = [r for r in rows if r.get("round", 0) >= 1]
    if not trained:
        raise ValueError(f"{folder}: no training round in metrics.jsonl")
    rates = {float(r["sample-rate"]) for r in trained if r.get("sample-rate") is not None}
    populations = {int(r["population"]) for r in trained if r.get("population") is not None}
    if len(rates) != 1 or len(populations) != 1:
        raise ValueError(
            f"{folder}: the rows must carry one sample-rate and one population "
            f"(client-sampling=poisson), found {sorted(rates)} and {sorted(populations)}"
        )
    wall = summary.get("wall-seconds")
    if wall is None:
        raise ValueError(f"{folder}: summary.json has no wall-seconds")
    rounds = max(int(r["round"]) for r in trained)
    tests = tuple(
        ScoredRound(int(r["round"]), float(r["test-score"]), int(r["test-num-examples"]))
        for r in rows
        if r.get("test-score") is not None and r.get("test-num-examples")
    )
    return PilotRun(
        name=folder.name,
        method=str(config.get("method", "?")),
        rounds=rounds,
        seconds_per_round=float(wall) / rounds,
        sample_rate=rates.pop(),
        population=populations.pop(),
        tests=tests,
        norms=run_norms(folder),
    )


def load_pilot(root: Path) -> list[PilotRun]:
    """Every finished run folder directly under ``root`` (unfinished ones are an error:
    the sizing must not read a run that is still going)."""
    if not root.is_dir():
        raise ValueError(f"{root}: no such folder")
    folders = sorted(p for p in root.iterdir() if p.is_dir())
    if not folders:
        raise ValueError(f"{root}: holds no run folder")
    return [_pilot_run(folder) for folder in folders]


# the privacy grids' runner, named in a written grid's header
RUNNER = "bash lab/scripts/evidence_privacy.sh ROOT"


def combined_pilot(pilots: Sequence[list[PilotRun]]) -> list[PilotRun]:
    """Several pilots' runs together; a method in more than one takes its runs from the
    last (a method piloted again, at a changed setting of its own, beside the reference
    methods' earlier pilot)."""
    latest: dict[str, list[PilotRun]] = {}
    for pilot in pilots:
        for method in dict.fromkeys(run.method for run in pilot):  # in the folders' order
            latest[method] = [run for run in pilot if run.method == method]
    return [run for runs in latest.values() for run in runs]


class _GridDumper(yaml.SafeDumper):
    """Mappings in block style, each list on one line (``seed: [0, 1, 2]``), and no YAML
    anchors for a list written twice, as the hand-written grid files have them."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


_GridDumper.add_representer(
    list, lambda dumper, data: dumper.represent_sequence("tag:yaml.org,2002:seq", data, True)
)


def round_up(value: float, digits: int = 4) -> float:
    """``value`` rounded up at ``digits`` significant digits. A noise multiplier written to
    a grid is rounded up, so the ε its runs reach is at most the target, never above."""
    if value <= 0 or not math.isfinite(value):
        raise ValueError(f"expected a positive finite value, got {value}")
    scale = 10.0 ** (digits - 1 - math.floor(math.log10(value)))
    return math.ceil(value * scale - 1e-9) / scale


def releases(method: str, rounds: int) -> int:
    """The Gaussian-mechanism releases a ``method``'s run of ``rounds`` rounds composes under
    dp=central: one per round, plus those before round 1 (Fed-SB's round 0)."""
    return int(rounds) + get_method(method).dp_initial_releases


def noise_multipliers(
    methods: Sequence[str],
    epsilons: Sequence[float],
    sample_rate: float,
    rounds: int,
    delta: float,
) -> dict[str, dict[float, float]]:
    """{method: {ε: z}}: the smallest z whose ``releases(method, rounds)`` releases at q end
    at ε, δ (unrounded)."""
    return {
        m: {e: noise_multiplier_for(e, sample_rate, releases(m, rounds), delta) for e in epsilons}
        for m in methods
    }  # fmt: skip


def private_grid(
    pilot_grid: Path,
    rounds: int,
    norms: dict[str, float],
    zs: dict[str, dict[float, float]],
    delta: float,
    seeds: Sequence[int],
    seconds_per_round: float,
    command: str,
    name: str = "privacy-cross-device",
    runner: str = RUNNER,
) -> str:
    """The cross-device private grid ``name``'s YAML: the pilot grid's simulation and base
    (its ``name``, ``grid`` and ``blocks`` replaced) at ``rounds`` rounds; the ``grid`` block,
    every method of ``norms`` without DP (ε = ∞), and one block per method and ε with
    ``dp=central`` at its clipping norm and its noise multiplier ``zs[method][ε]`` (rounded
    up, :func:`round_up`), each over ``seeds``. ``run-timeout`` is twice the slowest method's
    expected run, or the pilot's if that is longer."""
    from omegaconf import OmegaConf

    pilot = OmegaConf.to_container(OmegaConf.load(pilot_grid), resolve=True)
    if not isinstance(pilot, dict) or "base" not in pilot:
        raise ValueError(f"{pilot_grid}: not a grid file with a base")
    base = dict(pilot["base"]) | {"num-server-rounds": int(rounds)}
    methods = list(norms)
    seed_list = [int(s) for s in seeds]
    blocks: dict[str, dict[str, list[Any]]] = {}
    epsilons = list(next(iter(zs.values()))) if zs else []
    for method, clip in norms.items():
        for eps, z in zs[method].items():
            blocks[f"{method}-eps{eps:g}"] = {
                "method": [method],
                "seed": seed_list,
                "dp": ["central"],
                "dp-clipping-norm": [float(f"{clip:.4g}")],
                "dp-noise-multiplier": [round_up(z)],
                "dp-delta": [float(delta)],
            }
    timeout = max(int(pilot.get("run-timeout", 0)), math.ceil(2 * seconds_per_round * rounds))
    grid = {
        "name": name,
        "description": (
            f"Cross-device privacy-utility: {', '.join(methods)} on the pilot's setting "
            f"(lab/grids/{pilot_grid.name}) at {rounds} rounds, without DP and with "
            f"user-level central DP (Poisson client sampling) at epsilon in "
            f"{{{', '.join(f'{e:g}' for e in epsilons)}}}, delta = {delta:g}, seeds "
            f"{', '.join(map(str, seed_list))}, held-out test scores."
        ),
        "simulation": pilot.get("simulation", {}),
        "run-timeout": timeout,
        "base": base,
        "grid": {"method": methods, "seed": seed_list},
        "blocks": blocks,
        "report": pilot.get("report", {"metric": "test-score"}),
    }
    header = "\n".join(
        [
            "# Privacy-utility, cross-device, stage 2: the private grid. WRITTEN BY",
            f"#   {command}",
            "# from the pilot's finished runs; regenerate it with that command, do not edit.",
            f"# The pilot's setting (lab/grids/{pilot_grid.name}; read its header) at",
            f"# T = {rounds} rounds: the first test round by which each reference method's",
            "# 95% Wilson interval lies at or above the target, so that their epsilon = infinity",
            "# arms have learned. C per method: the median over the pilot's rounds of the",
            "# round's median client update norm. z per method and epsilon: the smallest whose",
            "# releases of the Poisson-subsampled Gaussian mechanism at the pilot's q end at",
            "# epsilon, delta (flower_app/dp_accounting.noise_multiplier_for): T, plus",
            "# the method's releases before round 1 (Method.dp_initial_releases: Fed-SB's",
            "# round 0); rounded up at 4 significant digits so that no run exceeds its epsilon.",
            f"# Run: {runner} (resumes); PUBLISH_ONLY=1 publishes.",
        ]
    )
    body = yaml.dump(grid, Dumper=_GridDumper, sort_keys=False, width=100)
    return header + "\n" + body


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m florg_lab.cross_device_sizing",
        description=__doc__.split("\n")[0],
    )
    parser.add_argument(
        "runs", type=Path, nargs="+",
        help="the pilot's run folders' parent; several: their runs together, a method in "
        "more than one from the last (piloted again beside the references' earlier pilot)",
    )  # fmt: skip
    parser.add_argument("--target", type=float, default=0.48, help="test score to reach")
    parser.add_argument(
        "--reference",
        nargs="+",
        default=["fedit"],
        help="the methods whose runs set T: the first test round by which each has reached "
        "the target",
    )
    parser.add_argument("--delta", type=float, default=1e-4)
    parser.add_argument("--epsilons", type=float, nargs="+", default=[8.0, 2.0])
    parser.add_argument(
        "--runs-per-method", type=int, default=9, help="the grid's runs of each method"
    )
    parser.add_argument(
        "--write-grid", type=Path, help="also write the private grid's YAML to this path"
    )
    parser.add_argument(
        "--pilot-grid",
        type=Path,
        default=Path("lab/grids/privacy-cross-device-pilot.yaml"),
        help="the pilot's grid file, whose setting the private grid keeps",
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--methods",
        nargs="+",
        default=None,
        help="the methods of the written grid (default: every method of the pilot)",
    )
    parser.add_argument("--name", default="privacy-cross-device", help="the written grid's name")
    parser.add_argument("--runner", default=RUNNER, help="the command that runs the grid")
    args = parser.parse_args(argv)
    try:
        pilot = combined_pilot([load_pilot(folder) for folder in args.runs])
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    where = ", ".join(str(folder) for folder in args.runs)
    reached_at: dict[str, int] = {}
    for method in args.reference:
        runs = [p for p in pilot if p.method == method]
        if not runs:
            print(f"error: no {method} run under {where}", file=sys.stderr)
            return 2
        ref = max(runs, key=lambda p: p.rounds)
        print(f"## {ref.name}: test score (95% Wilson interval) against the target {args.target}")
        print("| round | score | interval |")
        print("|---|---|---|")
        for p in ref.tests:
            low, high = p.interval
            print(f"| {p.round} | {p.score:.3f} | [{low:.3f}, {high:.3f}] |")
        reached = first_round_above(ref.tests, args.target)
        if reached is None:
            print(
                f"\nnot reached in {ref.rounds} rounds: continue {ref.name} from its checkpoint "
                "(python -m florg_tools.launch --resume RUN_DIR --set num-server-rounds=N)"
            )
            return 1
        reached_at[method] = reached.round
        print()
    # every reference method's epsilon = infinity arm has learned by round T
    rounds = max(reached_at.values())
    each = ", ".join(f"{m} {t}" for m, t in reached_at.items())
    print(
        f"T = {rounds} (the first test round by which every reference method's interval lies "
        f"at or above {args.target}: {each})"
    )

    q = {p.sample_rate for p in pilot}
    n = {p.population for p in pilot}
    if len(q) != 1 or len(n) != 1:
        print(f"error: the pilot's runs differ in q {sorted(q)} or N {sorted(n)}", file=sys.stderr)
        return 2
    sample_rate, population = q.pop(), n.pop()
    norms = clipping_norms([p.norms for p in pilot if p.norms is not None])
    zs = noise_multipliers(list(norms), args.epsilons, sample_rate, rounds, args.delta)
    print(f"\n## dp=central at q = {sample_rate}, N = {population}, T = {rounds}, δ = {args.delta}")
    print(
        "| method | releases | dp-clipping-norm C | "
        + " | ".join(f"ε = {e:g}" for e in args.epsilons)
        + " |"
    )
    print("|---|---|---|" + "---|" * len(args.epsilons))
    for method, c in norms.items():
        cells = [
            f"z = {z:.4g}, noise std {z * c / (sample_rate * population):.3g}"
            for z in zs[method].values()
        ]
        print(f"| {method} | {releases(method, rounds)} | {c:.3g} | " + " | ".join(cells) + " |")

    print("\n## cost at T rounds (seconds per round measured in the pilot)")
    print("| method | s / round | one run | the grid's runs |")
    print("|---|---|---|---|")
    total = 0.0
    slowest = 0.0
    for method in sorted({p.method for p in pilot}):
        per_round = float(np.median([p.seconds_per_round for p in pilot if p.method == method]))
        slowest = max(slowest, per_round)
        one = per_round * rounds
        total += one * args.runs_per_method
        print(f"| {method} | {per_round:.1f} | {one / 3600:.2f} h | "
              f"{one * args.runs_per_method / 3600:.1f} h |")  # fmt: skip
    print(f"\ntotal: {total / 3600:.1f} h")
    if args.write_grid is not None:
        command = "python -m florg_lab.cross_device_sizing " + shlex.join(
            sys.argv[1:] if argv is None else argv
        )
        chosen = list(norms) if args.methods is None else args.methods
        missing = [m for m in chosen if m not in norms]
        if missing:
            print(f"error: no pilot run of {', '.join(missing)} under {where}",
                  file=sys.stderr)  # fmt: skip
            return 2
        text = private_grid(
            args.pilot_grid,
            rounds,
            {m: norms[m] for m in chosen},
            {m: zs[m] for m in chosen},
            args.delta,
            args.seeds,
            slowest,
            command,
            args.name,
            args.runner,
        )
        args.write_grid.write_text(text)
        print(f"\nwrote {args.write_grid}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
