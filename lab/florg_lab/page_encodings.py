"""Accuracy per byte: protocol v2 with encoded messages against the published fp32 runs.

The grids ``lab/grids/encodings-v2.yaml`` (movie sentiment) and ``encodings-v2-snli.yaml``
run FLoRG, FedIT and RoLoRA at their published protocol v2 rates with both directions
encoded (``uplink-encoding`` = ``downlink-encoding``, flower_app/wire/encoding.py) at bf16 and
int8, five seeds, and one fp32 run a method at seed 0 (the *check*: the grids' commit
reproduces the published fp32 run). ``bash lab/scripts/evidence_encodings.sh`` runs them
and publishes their runs under :data:`PUBLISHED`; this module reads them and writes, per
task:

- **the table** (``table``): each method's fp32 row (the reference) and its encoded
  rows: the final held-out test score's seed mean with its 95% interval, the paired
  difference to fp32 over the seeds both have, whether it meets the goal (mean within
  ±:data:`GOAL_MEAN`, its interval inside ±:data:`GOAL_INTERVAL`; judged once the arm has
  every seed its grid file plans, so a grid published part-way says how far it is), and
  the bytes per
  client per round with their ratio to fp32's. Bytes are what travelled (the messages'
  serialised content, ``uplink-bytes`` + ``downlink-bytes``). The published fp32 runs
  predate the byte count, so fp32's bytes are the check run's; bytes do not depend on the
  seed beyond a few varint-coded metrics (the encoded runs show how little: their seeds'
  spread is printed);
- **the reference**: the published fp32 runs, unless the grid runs fp32 itself at every
  seed it runs an encoding at (SNLI's grid does, since its check found the published runs,
  made on another CPU, off by rounding drift as large as the goal): then the grid's own
  fp32 runs, so a paired difference is the encoding's effect alone, and the drift (fp32 at
  the grid's commit − published fp32, paired) is printed beside the table;
- **bytes to a target** (``bytes_to_target``, ``figure``): :mod:`florg_lab.comm_to_target`
  counting bytes instead of parameters, each method and encoding one curve, the target
  FedIT-fp32's final seed-mean score and 90% of it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

from florg_lab import comm_to_target as ctt
from florg_lab.long_budget import Run, runs_in
from florg_lab.page_text import Evidence, interval, method_name, task_name
from florg_lab.page_text import table as render_table
from florg_lab.page_v2 import EXACT, V2, exact_methods, task_folders
from florg_lab.stats import Interval, Paired, mean_interval, paired_difference

__all__ = [
    "ENCODINGS",
    "FIGURE",
    "GRIDS",
    "METHODS",
    "PUBLISHED",
    "Arms",
    "Judged",
    "arms",
    "bytes_to_target",
    "figure",
    "judge",
    "published",
    "table",
    "verdict",
]

PUBLISHED = "lab/evidence/encodings"  # runs/<grid>/<run>: config, metrics, summary
GRIDS = {"movie-sentiment": "encodings-v2", "snli": "encodings-v2-snli"}
METHODS = ("florg", "fedit", "rolora")
ENCODINGS = ("bf16", "int8")
REFERENCE = "fp32"  # today's messages, bit for bit: the published runs
CHECK_SEED = 0
GOAL_MEAN, GOAL_INTERVAL = 0.01, 0.02  # |mean difference|; the interval inside ± this
GOAL_ENCODING, GOAL_BYTES = "int8", 0.25  # the goal's encoding, its bytes / fp32's at most
FRACTIONS = (1.0, 0.9)  # of FedIT-fp32's final seed-mean test score
FIGURE = PUBLISHED + "/plots/bytes-to-target-{task}.png"
COMMAND = "bash lab/scripts/evidence_encodings.sh"


# --- reading the runs --------------------------------------------------------------------


def encoding_of(config: Mapping[str, object]) -> str:
    """A run's encoding: its uplink's, which the grids set equal to its downlink's (a run
    whose directions differ is named ``up/down``)."""
    up = str(config.get("uplink-encoding", REFERENCE))
    down = str(config.get("downlink-encoding", REFERENCE))
    return up if up == down else f"{up}/{down}"


def encoded_runs(folder: Path, task: str) -> dict[tuple[str, str], dict[int, Run]]:
    """(method, encoding) -> seed -> its finished run of ``task`` in ``folder`` (a published
    grid's runs), read with its config's encodings."""
    found: dict[tuple[str, str], dict[int, Run]] = {}
    if not folder.is_dir():
        return found
    for run in runs_in(folder):
        if run.task == task:
            found.setdefault((run.method, encoding_of(run.config)), {})[run.seed] = run
    return found


def planned(root: Path, task: str) -> dict[tuple[str, str], int]:
    """(method, encoding) -> how many runs ``task``'s grid file plans for it (the fp32 check
    included, as (method, fp32)): the file under ``root``, else this checkout's."""
    from florg_lab.grid import load_grid

    path = root / "lab" / "grids" / f"{GRIDS[task]}.yaml"
    grid = load_grid(path if path.is_file() else GRIDS[task])
    counts: dict[tuple[str, str], int] = {}
    for run in grid.runs:
        key = (str(run.overrides["method"]), encoding_of(run.overrides))
        counts[key] = counts.get(key, 0) + 1
    return counts


def final_score(run: Run) -> float:
    """The held-out test score at the run's last test round."""
    series = run.series(run.test_key)
    if not series:
        raise ValueError(f"{run.method} seed {run.seed}: no test score")
    return series[max(series)]


def bytes_per_round(run: Run) -> float:
    """Bytes per client per round, uplink + downlink, over the whole run."""
    cumulative = ctt.cumulative_params(run.rows, ctt.BYTES)
    last = max(cumulative)
    return cumulative[last] / max(last, 1)


@dataclass(frozen=True)
class Arms:
    """One task's runs: each method's fp32 reference (method -> seed -> run: the grid's own
    fp32 runs for the methods in ``same_commit``, else the published ones), the published
    fp32 runs, the encoded runs and the fp32 checks ((method, encoding) -> seed -> run), and
    the methods whose fp32 runs are not published."""

    task: str
    reference: dict[str, dict[int, Run]]
    published_fp32: dict[str, dict[int, Run]]
    same_commit: tuple[str, ...]
    encoded: dict[tuple[str, str], dict[int, Run]]
    missing: tuple[str, ...]
    # (method, encoding) -> the runs the grid plans for it: a goal is judged on a whole arm
    planned: dict[tuple[str, str], int]

    def check(self, method: str) -> Run | None:
        return self.encoded.get((method, REFERENCE), {}).get(CHECK_SEED)

    def arm(self, method: str, encoding: str) -> dict[int, Run]:
        return self.encoded.get((method, encoding), {})


def arms(root: Path, task: str) -> Arms:
    """``task``'s arms from the evidence under ``root``. An encoded run at another learning
    rate than its method's published one is an error: the encoding is the only change."""
    v2, exact = task_folders(task)
    sources = (ctt.Source(V2, (v2,)), ctt.Source(EXACT, (exact,), exact_methods()))
    chosen, missing = ctt.chosen_runs(root, sources, task)
    published_fp32 = {m: chosen[m] for m in METHODS if m in chosen}
    encoded = encoded_runs(root / PUBLISHED / "runs" / GRIDS[task], task)
    for (method, encoding), by_seed in encoded.items():
        rates = {run.learning_rate for run in by_seed.values()}
        published_rates = {run.learning_rate for run in published_fp32.get(method, {}).values()}
        if published_rates and rates != published_rates:
            raise ValueError(
                f"{task}, {method} at {encoding}: learning rate {sorted(rates)}, but the "
                f"published fp32 runs' is {sorted(published_rates)}"
            )
    plan = planned(root, task)
    reference, same_commit = dict(published_fp32), []
    for method in METHODS:
        # fp32 planned at more seeds than the check, and every one of them run: the
        # reference at the grid's own commit (the module docstring says why)
        own, due = encoded.get((method, REFERENCE), {}), plan.get((method, REFERENCE), 0)
        if due > 1 and len(own) >= due:
            reference[method] = own
            same_commit.append(method)
    missing_methods = tuple(m for m in METHODS if m in missing)
    return Arms(task, reference, published_fp32, tuple(same_commit), encoded, missing_methods,
                plan)  # fmt: skip


def spread(found: Arms) -> float:
    """The largest relative spread of bytes per client per round over the seeds of one
    encoded arm ((max - min) / mean)."""
    worst = 0.0
    for by_seed in found.encoded.values():
        spent = [bytes_per_round(run) for run in by_seed.values()]
        if len(spent) > 1 and statistics.fmean(spent) > 0:
            worst = max(worst, (max(spent) - min(spent)) / statistics.fmean(spent))
    return worst


@cache
def _arms(ev: Evidence, task: str) -> Arms:
    return arms(ev.root, task)


def published(ev: Evidence, task: str) -> bool:
    """Whether any encoded run of ``task`` is published."""
    return bool(_arms(ev, task).encoded)


# --- the table ---------------------------------------------------------------------------


def goal(found: tuple[float, float, float]) -> str:
    """``met`` when the mean difference is within ±GOAL_MEAN and its interval inside
    ±GOAL_INTERVAL; ``not met``; ``–`` without an interval."""
    mean, low, high = found
    if math.isnan(low):
        return "–"
    inside = abs(mean) <= GOAL_MEAN and low >= -GOAL_INTERVAL and high <= GOAL_INTERVAL
    return "met" if inside else "not met"


@dataclass(frozen=True)
class Judged:
    """One encoded arm against its method's fp32 reference: its runs and the runs its grid
    plans, its final test score, the paired difference over the seeds both have (None under
    two), the goal's accuracy part (judged on a whole arm), and its bytes per client per
    round, alone and over fp32's (None without an fp32 check run)."""

    runs: int
    due: int
    score: Interval
    paired: Paired | None
    seeds: int
    accuracy: str  # "met", "not met", "–" (not judged)
    spent: float
    byte_ratio: float | None

    @property
    def whole(self) -> bool:
        """Whether every seed the grid plans for this arm has run."""
        return self.runs >= self.due


def fp32_bytes(arms_: Arms, method: str) -> float | None:
    """fp32's bytes per client per round, read from ``method``'s check run (None without
    one); bytes hardly differ between seeds (:func:`spread`), so one run stands for all."""
    check = arms_.check(method)
    return None if check is None else bytes_per_round(check)


def judge(arms_: Arms, method: str, encoding: str) -> Judged | None:
    """``method`` at ``encoding`` judged against fp32 (module docstring); None if not run."""
    runs = arms_.arm(method, encoding)
    if not runs:
        return None
    scores = {s: final_score(r) for s, r in runs.items()}
    fp32 = {s: final_score(r) for s, r in arms_.reference.get(method, {}).items()}
    seeds = sorted(set(scores) & set(fp32))
    due = arms_.planned.get((method, encoding), len(runs))
    found = None
    if len(seeds) >= 2:
        found = paired_difference([scores[s] for s in seeds], [fp32[s] for s in seeds])
    diff = None if found is None else found.difference
    accuracy = "–" if diff is None or len(runs) < due else goal((diff.mean, diff.low, diff.high))
    spent = statistics.fmean(bytes_per_round(r) for r in runs.values())
    reference_bytes = fp32_bytes(arms_, method)
    ratio = spent / reference_bytes if reference_bytes else None
    score = mean_interval(list(scores.values()))
    return Judged(len(runs), due, score, found, len(seeds), accuracy, spent, ratio)


def _row(arms_: Arms, method: str, encoding: str) -> list[str]:
    name = f"{method_name(method)} {encoding}"
    if encoding == REFERENCE:
        runs = arms_.reference[method]
        where = "the grid's commit" if method in arms_.same_commit else "published"
        cells = [name, str(len(runs)),
                 interval(mean_interval([final_score(r) for r in runs.values()])),
                 f"(reference: {where})", "–"]  # fmt: skip
        reference_bytes = fp32_bytes(arms_, method)
        if reference_bytes is None:
            return [*cells, "– (no fp32 check run)", "–"]
        return [*cells, f"{reference_bytes:,.0f}", "1.000"]
    judged = judge(arms_, method, encoding)
    if judged is None:
        return [name, "0", "not run yet", "–", "–", "–", "–"]
    cells = [name, str(judged.runs), interval(judged.score)]
    if judged.paired is not None:
        found = judged.paired
        cells += [
            f"{interval(found.difference, sign=True)}, {found.wins} up / {found.losses} down "
            f"of {judged.seeds}",
            judged.accuracy if judged.whole
            else f"– ({judged.runs} of {judged.due} seeds run)",
        ]  # fmt: skip
    else:
        cells += [f"– (seeds shared with fp32: {judged.seeds})", "–"]
    ratio = "–" if judged.byte_ratio is None else f"{judged.byte_ratio:.3f}"
    return [*cells, f"{judged.spent:,.0f}", ratio]


def verdict(found: Arms) -> str:
    """The goal for int8 both ways, per method and in all: its accuracy part (the table's
    goal column) and its bytes part (at most :data:`GOAL_BYTES` of fp32's bytes); a method
    whose int8 arm is not whole yet is named as such, not judged."""
    parts, whole = [], []
    for method in METHODS:
        if method not in found.reference:
            continue
        judged = judge(found, method, GOAL_ENCODING)
        if judged is None:
            parts.append(f"{method_name(method)} not run yet")
            continue
        if not judged.whole:
            parts.append(f"{method_name(method)} not judged yet ({judged.runs} of "
                         f"{judged.due} seeds run)")  # fmt: skip
            continue
        if judged.accuracy == "–" or judged.byte_ratio is None:
            parts.append(f"{method_name(method)} not judged (no paired fp32 or no fp32 check)")
            continue
        small = judged.byte_ratio <= GOAL_BYTES
        bytes_part = f"{judged.byte_ratio:.3f} of fp32's ({'met' if small else 'not met'})"
        parts.append(f"{method_name(method)}: accuracy {judged.accuracy}, bytes {bytes_part}")
        whole.append((judged.accuracy == "met", small))
    head = (
        f"The goal for {GOAL_ENCODING} both ways (within ±{GOAL_MEAN} of fp32, its "
        f"interval inside ±{GOAL_INTERVAL}, at most {GOAL_BYTES} of fp32's bytes): "
    )
    if not parts:
        return head + "no arm run yet."
    total = (f" In all, methods judged {len(whole)}: accuracy met by "
             f"{sum(a for a, _ in whole)}, the bytes by {sum(b for _, b in whole)}, both by "
             f"{sum(a and b for a, b in whole)}.") if whole else ""  # fmt: skip
    return head + "; ".join(parts) + "." + total


def table(task: str) -> Callable[[Evidence], str]:
    """``task``'s table (module docstring), or what is not published yet."""

    def make(ev: Evidence) -> str:
        found = _arms(ev, task)
        if not found.encoded:
            return (f"{task_name(task)}: not run yet (`{COMMAND}`, grid "
                    f"`lab/grids/{GRIDS[task]}.yaml`).")  # fmt: skip
        head = ["method, encoding both ways", "seeds", "final test score [95% CI]",
                "− fp32, paired [95% CI]",
                f"goal: within ±{GOAL_MEAN}, interval in ±{GOAL_INTERVAL}",
                "bytes per client per round", "/ fp32"]  # fmt: skip
        rows, checks = [], []
        for method in METHODS:
            if method not in found.reference:
                continue
            check = found.check(method)
            rows += [_row(found, method, e) for e in (REFERENCE, *ENCODINGS)]
            if check is not None:
                published_run = found.published_fp32.get(method, {}).get(CHECK_SEED)
                was = "no published seed 0" if published_run is None else (
                    f"published {final_score(published_run):.4f}")  # fmt: skip
                checks.append(f"{method_name(method)} {final_score(check):.4f} ({was})")
        done = sum(len(by_seed) for by_seed in found.encoded.values())
        due = sum(found.planned.values())
        lines = [f"{done} of the grid's {due} runs published"
                 + ("." if done >= due else f" (`{COMMAND}` runs the rest; a goal is judged "
                    "once its arm has every seed)."), ""]  # fmt: skip
        lines += render_table(head, rows)
        lines += ["", verdict(found)]
        lines += ["", f"Bytes differ between the seeds of one arm by at most {spread(found):.2e} "
                  "of the arm's mean (varint-coded metrics), so the check run's bytes stand "
                  "for fp32's at every seed."]  # fmt: skip
        lines += ["", "fp32 at the grid's commit, seed " + str(CHECK_SEED) + " (the check): "
                  + ("; ".join(checks) if checks else "not run yet") + "."]  # fmt: skip
        drift = [_drift(found, method) for method in found.same_commit
                 if method in found.published_fp32]  # fmt: skip
        if drift:
            lines += ["", "fp32 at the grid's commit − published fp32, paired (rounding drift "
                      "between the two runs' machines and commits, which the reference at the "
                      "grid's commit leaves out of the differences above): "
                      + "; ".join(drift) + "."]  # fmt: skip
        if found.missing:
            lines.append(", ".join(method_name(m) for m in found.missing)
                         + ": no published fp32 runs.")  # fmt: skip
        return "\n".join(lines)

    return make


def _drift(found: Arms, method: str) -> str:
    """``method``'s fp32 at the grid's commit − its published fp32 runs, paired by seed."""
    own = {s: final_score(r) for s, r in found.reference[method].items()}
    was = {s: final_score(r) for s, r in found.published_fp32[method].items()}
    seeds = sorted(set(own) & set(was))
    if len(seeds) < 2:
        return f"{method_name(method)}: – (seeds shared: {len(seeds)})"
    found_diff = paired_difference([own[s] for s in seeds], [was[s] for s in seeds])
    return (f"{method_name(method)} {interval(found_diff.difference, sign=True)}, "
            f"{found_diff.wins} up / {found_diff.losses} down of {len(seeds)}")  # fmt: skip


# --- bytes to a target -------------------------------------------------------------------


def curves(found: Arms) -> dict[str, ctt.Curve]:
    """``method`` (fp32: the reference runs' scores, the check run's bytes) and
    ``method@encoding`` -> its curve of seed-mean test score against bytes per client."""
    out: dict[str, ctt.Curve] = {}
    for method in METHODS:
        check = found.check(method)
        if method in found.reference and check is not None:
            fp32 = ctt.curve(method, found.reference[method])
            spent = ctt.cumulative_params(check.rows, ctt.BYTES)
            if all(t in spent for t in fp32.rounds):
                out[method] = replace(
                    fp32,
                    params=tuple(spent[t] for t in fp32.rounds),
                    per_round=bytes_per_round(check),
                )
        for encoding in ENCODINGS:
            runs = found.arm(method, encoding)
            if runs:
                out[f"{method}@{encoding}"] = ctt.curve(method, runs, ctt.BYTES)
    return out


def curve_name(key: str) -> str:
    method, _, encoding = key.partition("@")
    return f"{method_name(method)} {encoding or REFERENCE}"


def bytes_to_target(task: str) -> Callable[[Evidence], str]:
    """``task``'s bytes to FedIT-fp32's final score and to 90% of it."""

    def make(ev: Evidence) -> str:
        found = _arms(ev, task)
        if not found.encoded:
            return f"{task_name(task)}: not run yet (`{COMMAND}`)."
        return ctt.markdown(curves(found), [], FRACTIONS, curve_name, ctt.BYTES)

    return make


def figure(task: str) -> Callable[[Evidence, Path], bool]:
    def draw(ev: Evidence, path: Path) -> bool:
        found = curves(_arms(ev, task))
        if not found:
            return False
        title = f"protocol v2, {task_name(task)}: test score against bytes sent"
        ctt.plot(found, path, FRACTIONS, title, curve_name, ctt.BYTES)
        return True

    return draw
