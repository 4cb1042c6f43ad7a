"""docs/secure-aggregation.md's evidence block: each method in the clear and under SecAgg+.

The grid (lab/grids/secure-aggregation.yaml, run by lab/scripts/evidence_secure.sh) runs
FedIT, RoLoRA and FLoRG, and FedIT under dp=central, each twice per seed: in the clear and
with ``secure-aggregation=secaggplus``, everything else equal. Read from the published
runs (``config.json``, ``summary.json``, ``metrics.jsonl``): per pair the held-out test
score of each arm (mean, 95% t interval), the paired difference secure − plain over the
seeds both finished and each seed's, the goal (mean within ±0.01, interval inside ±0.02),
the first round whose validation score differs between a seed's two arms (where the
secure sum's rounding first shows), each arm's bytes a client sends per round (uplink, as
a deployment sends them) and the secure rounds that failed. A pair not yet run says how
many seeds each arm holds.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from dataclasses import dataclass, field

from florg_lab.page_text import Evidence, interval, method_name, read_json, signed, table
from florg_lab.stats import mean_interval

PUBLISHED = "lab/evidence/secure-aggregation/runs/secure-aggregation"
PAIRS = (("fedit", "off"), ("rolora", "off"), ("florg", "off"), ("fedit", "central"))
GOAL_MEAN, GOAL_INTERVAL = 0.01, 0.02  # the grid's goal, on the held-out test score


@dataclass
class Arm:
    """One arm's finished runs: seed -> final test score, validation score by round,
    uplink bytes per client per round (each run's mean over its rounds), and failed
    secure rounds in all."""

    scores: dict[int, float] = field(default_factory=dict)
    curves: dict[int, dict[int, float]] = field(default_factory=dict)
    uplink: dict[int, float] = field(default_factory=dict)
    secure_failed: int = 0


def arms(ev: Evidence) -> dict[tuple[str, str, bool], Arm]:
    """(method, dp, secure) -> its arm, from every finished run published."""
    found: dict[tuple[str, str, bool], Arm] = defaultdict(Arm)
    folder = ev.root / PUBLISHED
    for run in sorted(folder.iterdir()) if folder.is_dir() else ():
        summary = read_json(run / "summary.json")
        if summary.get("status") != "finished":
            continue
        config = read_json(run / "config.json")
        key = (config["method"], config.get("dp", "off"),
               config.get("secure-aggregation", "off") != "off")  # fmt: skip
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        rounds = [r for r in rows if r["round"] >= 1]
        arm, seed = found[key], int(config["seed"])
        arm.scores[seed] = float(summary["final-test-score"])
        arm.curves[seed] = {int(r["round"]): float(r["score"]) for r in rows if "score" in r}
        arm.uplink[seed] = statistics.fmean(r["uplink-bytes-per-client"] for r in rounds)
        arm.secure_failed += sum(int(r.get("secure-failed", 0)) for r in rounds)
    return dict(found)


def _goal(differences: list[float]) -> str:
    """'met' when the mean is within ±0.01 and the interval inside ±0.02, 'missed' when
    either is out, '–' without an interval."""
    if len(differences) < 2:
        return "–"
    found = mean_interval(differences)
    met = (
        abs(found.mean) <= GOAL_MEAN and -GOAL_INTERVAL <= found.low <= found.high <= GOAL_INTERVAL
    )
    return "met" if met else "missed"


def parting_round(plain: dict[int, float], secure: dict[int, float]) -> int | None:
    """The first round both arms scored whose validation scores differ (None: equal at
    every round): how long the secure sum's rounding (a few 10⁻⁶) stays below what the
    score can show."""
    return next((t for t in sorted(plain.keys() & secure.keys()) if plain[t] != secure[t]), None)


def _pair_row(method: str, dp: str, plain: Arm | None, secure: Arm | None) -> list[str]:
    name = method_name(method) + (" + dp=central" if dp == "central" else "")
    plain, secure = plain or Arm(), secure or Arm()
    seeds = sorted(set(plain.scores) & set(secure.scores))
    if len(seeds) < 2:
        waiting = f"– (seeds finished: {len(plain.scores)} plain, {len(secure.scores)} secure)"
        return [name, waiting, "–", "–", "–", "–", "–", "–", "–"]
    differences = [secure.scores[s] - plain.scores[s] for s in seeds]
    upload = statistics.fmean(secure.uplink[s] / plain.uplink[s] for s in seeds)
    return [
        name,
        interval(mean_interval([plain.scores[s] for s in seeds])),
        interval(mean_interval([secure.scores[s] for s in seeds])),
        interval(mean_interval(differences), sign=True),
        " / ".join(f"{s}: {signed(d)}" for s, d in zip(seeds, differences, strict=True)),
        _goal(differences),
        " / ".join(
            f"{s}: {parting_round(plain.curves[s], secure.curves[s]) or '–'}" for s in seeds
        ),
        f"{statistics.fmean(plain.uplink[s] for s in seeds):,.0f} → "
        f"{statistics.fmean(secure.uplink[s] for s in seeds):,.0f} ({upload:.2f}x)",
        str(secure.secure_failed),
    ]


def secure_table(ev: Evidence) -> str:
    """The pairs as one table, and how many of the grid's runs it is read from."""
    found = arms(ev)
    rows = [_pair_row(m, dp, found.get((m, dp, False)), found.get((m, dp, True)))
            for m, dp in PAIRS]  # fmt: skip
    runs = sum(len(arm.scores) for arm in found.values())
    head = [
        "method", "plain: test, final [95% CI]", "secure: test, final [95% CI]",
        "secure − plain [95% CI]", "secure − plain by seed", "goal (±0.01, CI in ±0.02)",
        "arms part at round (by seed; –: never)",
        "uplink bytes per client per round: plain → secure", "secure rounds failed",
    ]  # fmt: skip
    lead = (
        f"{runs} finished runs of the grid's {2 * 5 * len(PAIRS)}, read from "
        f"`{PUBLISHED}`; five seeds an arm when complete. A seed's arms part at the first "
        "round whose validation score differs."
    )
    return "\n".join([lead, "", *table(head, rows)])
