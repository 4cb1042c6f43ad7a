"""The evidence report of a tuned, seeded grid (lab/grids/evidence.yaml).

From the finished runs under ``<out>`` (and, optionally, an ablation grid's runs and a
centralised reference) it writes:

- ``evidence/summary.json`` (under ``<out>``): per task the chance level (the test split's
  majority-class share; null for a task that is not classification), the centralised
  reference's test score, the test-set size and, per method, the chosen learning rate, the
  seeds and, in the same seed order, the final-round test score and the mean test score of
  the last three rounds, and the final round's test loss (``test_loss_final``, null where
  not recorded);
- ``evidence.md``: the tuning table, per task a table of every method's test score (mean
  and 95% t interval over seeds) with the paired difference FLoRG − method (95% t interval
  over the shared seeds, win count), the mean test score over seeds at every tested round,
  the final round's held-out test loss likewise (for causal-LM the response loss), and a
  verdict table, one row per claim of the paper;
- in ``evidence.md`` also FLoRG's server step per variant (the main grid's FLoRG and the
  ablations: no Procrustes, ``rank-mismatch=truncate``): each run's Gram error and drift
  averaged over its rounds, then mean and 95% interval over seeds, and the paired
  difference FLoRG − variant;
- ``plots/evidence_test_per_round.png`` (test score per round, mean over seeds with the
  95% band) and ``plots/evidence_forest.png`` (the paired differences with their intervals).

Paired differences use only the seeds both methods finished. Nothing is tuned here: the
numbers are what the runs produced.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from florg_lab.aggregate import run_machines
from florg_lab.communication import load_metrics
from florg_lab.grid import MAIN_BLOCK, TUNING_FILE, Grid, GridRun, load_grid
from florg_lab.runs import is_finished, run_dir
from florg_lab.stats import mean_interval, paired_difference, verdict
from florg_lab.tuning import tuning_markdown
from flower_app.settings.config import defaults

__all__ = [
    "REFERENCE",
    "MethodRuns",
    "collect_methods",
    "collect_published",
    "evidence_summary",
    "write_evidence",
]

REFERENCE = "florg"
# FLoRG's per-round server diagnostics (strategies/florg/rule.py): gram_rel_error =
# ||A_new^T A_new - Q||_F / ||Q||_F, Q the mean client Gram (paper, eq. (5)); drift =
# ||A_new - A_prev||_F; each the mean over the adapted layers.
SERVER_DIAGNOSTICS = {"gram_rel_error": "Gram error", "drift": "drift"}
CENTRALISED_FILE = "centralised.json"
LOSS_CAPTION = (
    "The final round's test loss (summary.json's `final-test-loss`): the label's "
    "cross-entropy for classification; for causal-LM the response loss, the mean "
    "cross-entropy of the response tokens with the prompt masked."
)
# FLoRG settings whose non-default values make a variant (its own row and label)
VARIANT_KEYS = ("rank-mismatch", "projection-sharing", "subtract-init", "projection-init")
# Protocol v2: these FLoRG variants are reported under ``variants`` and each gets the
# verdicts "closes the gap to FedIT" and "beats the paper's FLoRG"
V2_COMPARED = "fedit"


def is_v2_variant(label: str) -> bool:
    """FLoRG with a subtract-init / projection-init setting, or florg-signed."""
    return label == "florg-signed" or (
        label.startswith(f"{REFERENCE} ")
        and any(f"{k}=" in label for k in ("subtract-init", "projection-init"))
    )


# Issue 11's "done when": the centralised reference >= 0.25 above chance, FLoRG and FedIT
# >= 0.15 above chance on average (final-round test score).
CENTRALISED_BAR = 0.25
FEDERATED_BAR = 0.15
BAR_METHODS = ("florg", "fedit")


@dataclass
class MethodRuns:
    """One (task, method) of the grid: per seed, the final and last-3 test scores and the
    test score at every tested round."""

    lr: float | None
    seeds: list[int]
    test_final: list[float]
    test_last3: list[float]
    curves: dict[int, list[tuple[int, float]]]  # seed -> [(round, test score)]
    params_per_round: float | None
    # FLoRG's server step, per diagnostic (SERVER_DIAGNOSTICS): seed -> mean over rounds
    server: dict[str, dict[int, float]] = dataclasses.field(default_factory=dict)
    # protocol v2: the head's learning rate, the adapter rates tuning tried (in order) and
    # the one it chose (from the grid's tuning.json)
    head_lr: float | None = None
    lr_path: list[float] | None = None
    chosen_lr: float | None = None
    # clients of different rank (issue 30): per metrics key (``up-params-per-client``,
    # ``up-params-r<r>``, their ``down-`` twins), seed -> mean over the rounds that have it
    rank_communication: dict[str, dict[int, float]] = dataclasses.field(default_factory=dict)
    # per seed, in order: the machine its run recorded (summary.json's environment; None
    # from commits before runs recorded one)
    environments: list[dict[str, Any] | None] = dataclasses.field(default_factory=list)
    # per seed, in order: the final round's held-out test loss (summary.json's
    # final-test-loss: the label's cross-entropy, or for causal-LM the response tokens');
    # None where the run scored none
    test_loss: list[float | None] = dataclasses.field(default_factory=list)


def _tuning_document(path: Path) -> dict[str, Any]:
    """A grid's tuning.json (its choices and, under protocol v2, the rates tried); empty
    when the grid has none."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _runs_by_setting(
    grid: Grid, block: str, folder_of: Callable[[GridRun], Path], tuning: dict[str, Any]
) -> dict[tuple[str, str], MethodRuns]:
    """(task, method label) -> the finished runs of ``grid``'s ``block``; ``folder_of``
    says where a run's files lie (a grid's results folder, or a published copy)."""
    found: dict[tuple[str, str], MethodRuns] = {}
    runs = sorted(grid.runs_in(block), key=lambda r: r.setting("seed"))
    for run in runs:
        folder = folder_of(run)
        if not is_finished(folder, run):
            continue
        summary = json.loads((folder / "summary.json").read_text())
        if summary.get("final-test-score") is None or summary.get("test-last3") is None:
            continue
        label = method_label(run.overrides)
        key = (str(run.setting("task")), f"{label} {grid.label}" if grid.label else label)
        entry = found.setdefault(key, MethodRuns(None, [], [], [], {}, None))
        entry.lr = float(run.setting("learning-rate"))
        entry.head_lr = float(run.setting("head-learning-rate") or entry.lr)
        if grid.tuning is not None and tuning:
            combo = grid.tuning.combo(run.axes)
            row = tuning.get("table", {}).get(combo, {})
            entry.lr_path = [float(v) for v in row.get("path", tuning.get("values", []))]
            chosen = tuning.get("choices", {}).get(combo)
            entry.chosen_lr = None if chosen is None else float(chosen)
        seed = int(run.setting("seed"))
        entry.seeds.append(seed)
        entry.test_final.append(float(summary["final-test-score"]))
        entry.test_last3.append(float(summary["test-last3"]))
        entry.environments.append(summary.get("environment"))
        loss = summary.get("final-test-loss")
        entry.test_loss.append(None if loss is None else float(loss))
        rows = load_metrics(folder / "metrics.jsonl")
        test_key = summary.get("test-score-key", "test-score")  # FedSA: personalised models
        entry.curves[seed] = [
            (int(r["round"]), float(r[test_key])) for r in rows if r.get(test_key) is not None
        ]
        for key in SERVER_DIAGNOSTICS:
            values = [float(r[key]) for r in rows if r.get(key) is not None]
            if values:
                entry.server.setdefault(key, {})[seed] = sum(values) / len(values)
        for key in sorted({k for r in rows for k in r if _is_rank_communication(k)}):
            values = [float(r[key]) for r in rows if r.get(key) is not None]
            entry.rank_communication.setdefault(key, {})[seed] = sum(values) / len(values)
        rounds = max(1, int(summary.get("rounds") or 1))
        entry.params_per_round = float(summary.get("total-params", 0)) / rounds
    return found


def method_label(overrides: dict[str, Any]) -> str:
    """The method, plus the FLoRG variant an ablation sets (``florg rank-mismatch=truncate``,
    ``florg subtract-init=True``); a variant setting pinned at its default (the evidence
    grids pin them) adds nothing."""
    label = str(overrides.get("method", defaults()["method"]))
    for key in VARIANT_KEYS:
        if key in overrides and overrides[key] != defaults()[key]:
            label += f" {key}={overrides[key]}"
    return label


def collect_methods(
    grid: Grid, out: Path, ablations: Iterable[tuple[Grid, Path]] = ()
) -> dict[str, dict[str, MethodRuns]]:
    """task -> method label -> its runs (the grid's main block, then the ablation grids)."""
    sources = [
        (source, partial(run_dir, source_out), _tuning_document(source_out / TUNING_FILE))
        for source, source_out in [(grid, out), *ablations]
    ]
    return _collect(sources)


def collect_published(target: Path, names: Iterable[str]) -> dict[str, dict[str, MethodRuns]]:
    """:func:`collect_methods` over a published report's folder (what
    ``florg_lab.__main__.publish_evidence`` copies to ``target``): the grids ``names``, in
    the report's order, each read from lab/grids/ with its choices and the rates its tuning
    tried (``<grid>-tuning.json``), its runs under ``runs/<grid>/<run id>``."""
    sources = []
    for name in names:
        tuning = _tuning_document(target / f"{name}-{TUNING_FILE}")
        grid = load_grid(name, tuning.get("choices"), tuning.get("candidates"))
        folder = target / "runs" / grid.name
        sources.append((grid, lambda run, folder=folder: folder / run.run_id, tuning))
    return _collect(sources)


def _collect(
    sources: Iterable[tuple[Grid, Callable[[GridRun], Path], dict[str, Any]]],
) -> dict[str, dict[str, MethodRuns]]:
    """task -> method label -> its runs, the sources in order (a label's first wins)."""
    by_task: dict[str, dict[str, MethodRuns]] = defaultdict(dict)
    for grid, folder_of, tuning in sources:
        for block in grid.blocks:
            if grid.tuning is not None and block != MAIN_BLOCK:
                continue
            for (task, label), runs in _runs_by_setting(grid, block, folder_of, tuning).items():
                by_task[task].setdefault(label, runs)
    return by_task


def _chance(task: str, max_test: int) -> float | None:
    """The majority-class share of the task's test subset: what always guessing it scores.
    None for a task that is not classification (extractive QA, causal-LM generation): it
    has no class to guess."""
    from flower_app.data.loading import load_task_test
    from flower_app.data.tasks import resolve_task
    from flower_app.task_kinds import get_kind

    spec = resolve_task(task)
    if not get_kind(spec.kind).has_classes:
        return None
    labels = load_task_test(spec, max_test or None)[spec.label_field]
    return max(Counter(labels).values()) / len(labels)


def evidence_summary(
    grid: Grid, methods: dict[str, dict[str, MethodRuns]], centralised: dict[str, Any]
) -> dict[str, Any]:
    """The machine-readable summary (lab/evidence/evidence/summary.json's schema)."""
    max_test = int(grid.base.get("max-test-examples", 0))
    v2 = grid.tuning is not None and grid.tuning.extend > 1
    tasks = {}
    for task, by_method in methods.items():
        entries = {label: _method_entry(runs, v2) for label, runs in by_method.items()}
        tasks[task] = {
            "chance": _chance(task, max_test),
            "centralised": centralised.get(task, {}).get("test-score"),
            "centralised_interval": centralised.get(task, {}).get("test-interval"),
            "centralised_label": _centralised_label(centralised.get(task, {})),
            "test_examples": max_test,
            "methods": {k: v for k, v in entries.items() if not (v2 and is_v2_variant(k))},
        }
        if v2:
            tasks[task]["variants"] = {k: v for k, v in entries.items() if is_v2_variant(k)}
    protocol = {"protocol": "v2"} if v2 else {}
    return {"grid": grid.name, "reference": REFERENCE, **protocol, "tasks": tasks}


def _method_entry(runs: MethodRuns, v2: bool) -> dict[str, Any]:
    """One method's summary: v1's keys, plus under protocol v2 ``head_lr``, ``lr_path``
    (every adapter rate tuning tried, in order) and ``chosen_lr``."""
    entry: dict[str, Any] = {
        "lr": runs.lr,
        "seeds": runs.seeds,
        "test_final": runs.test_final,
        "test_last3": runs.test_last3,
        "test_loss_final": runs.test_loss,
    }
    if v2:
        entry |= {"head_lr": runs.head_lr, "lr_path": runs.lr_path, "chosen_lr": runs.chosen_lr}
    return entry


def _paired(ref: MethodRuns, other: MethodRuns, field: str):
    common = [s for s in ref.seeds if s in other.seeds]
    if len(common) < 2:
        return None, common
    a = [getattr(ref, field)[ref.seeds.index(s)] for s in common]
    b = [getattr(other, field)[other.seeds.index(s)] for s in common]
    return paired_difference(a, b), common


def _task_lines(task: str, info: dict[str, Any], by_method: dict[str, MethodRuns]) -> list[str]:
    chance = info["chance"]
    chance_text = (
        "Chance: none (not a classification task)"
        if chance is None
        else f"Chance (majority class of the {info['test_examples']} test examples): {chance:.4f}"
    )
    lines = [
        f"### {task}",
        "",
        f"{chance_text}; centralised reference: {_centralised_text(info)}",
        "",
        "| method | lr | seeds | test, final round | test, mean of last 3 | above chance, final "
        f"(mean) | {REFERENCE} − method, final [95% CI] | wins of {REFERENCE} |",
        "|---|---|---|---|---|---|---|---|",
    ]
    ref = by_method.get(REFERENCE)
    for label, runs in by_method.items():
        diff, wins = "–", "–"
        if ref is not None and label != REFERENCE:
            paired, common = _paired(ref, runs, "test_final")
            if paired is not None:
                diff = str(paired.difference)
                wins = f"{paired.wins}/{len(common)}"
        above = (
            "–"
            if chance is None
            else f"{sum(runs.test_final) / len(runs.test_final) - chance:+.4f}"
        )
        lines.append(
            f"| {label} | {runs.lr:g} | {len(runs.seeds)} | {mean_interval(runs.test_final)} | "
            f"{mean_interval(runs.test_last3)} | {above} | {diff} | {wins} |"
        )
    return lines + [""] + _curve_lines(by_method)


def _losses(runs: MethodRuns) -> dict[int, float]:
    """Seed -> the final round's held-out test loss, for the seeds that recorded one."""
    return {s: v for s, v in zip(runs.seeds, runs.test_loss, strict=True) if v is not None}


def _loss_lines(task: str, by_method: dict[str, MethodRuns]) -> list[str]:
    """The final round's held-out test loss per method (lower is better) and the paired
    difference FLoRG − method: the score's companion, and for causal-LM the response loss
    that issue 28 reports beside gen-F1. Empty when no run of the task recorded one."""
    losses = {label: _losses(runs) for label, runs in by_method.items()}
    losses = {label: by_seed for label, by_seed in losses.items() if by_seed}
    if not losses:
        return []
    lines = [
        f"### {task}",
        "",
        f"| method | seeds | test loss, final round | {REFERENCE} − method, final [95% CI] | "
        f"seeds where {REFERENCE}'s loss is lower |",
        "|---|---|---|---|---|",
    ]
    ref = losses.get(REFERENCE, {})
    for label, by_seed in losses.items():
        diff, lower = "–", "–"
        common = [s for s in ref if s in by_seed]
        if label != REFERENCE and len(common) >= 2:
            paired = paired_difference([ref[s] for s in common], [by_seed[s] for s in common])
            diff, lower = str(paired.difference), f"{paired.losses}/{len(common)}"
        lines.append(
            f"| {label} | {len(by_seed)} | {mean_interval(list(by_seed.values()))} | {diff} | "
            f"{lower} |"
        )
    return lines + [""]


def _centralised_label(entry: dict[str, Any]) -> str | None:
    """How a seeded reference (benchmarks.centralised.centralised_reference) was measured."""
    if not entry.get("seeds"):
        return None
    method = entry.get("reference-method", "?")
    info = entry.get("methods", {}).get(method, {})
    lr = info.get("learning-rate")
    rate = "" if lr is None else f", lr {lr:g} chosen on validation"
    tried = sorted(float(v) for v in info.get("tuning", {}))
    if lr is not None and len(tried) > 1 and lr in (tried[0], tried[-1]):
        # the reference's rates are not extended (unlike the grids'): say so where it shows
        end = "largest" if lr == tried[-1] else "smallest"
        rate += f" (the {end} of {', '.join(f'{v:g}' for v in tried)} tried)"
    return f"{method}'s adapter{rate}, {len(entry['seeds'])} seeds"


def _centralised_text(info: dict[str, Any]) -> str:
    if info["centralised"] is None:
        return "not measured"
    low, high = info.get("centralised_interval") or (None, None)
    bounds = "" if low is None else f" [{low:.4f}, {high:.4f}]"
    label = info.get("centralised_label")
    how = f" ({label})" if label else " (one run)"
    return f"{info['centralised']:.4f}{bounds}{how}"


def _learning_lines(
    summary: dict[str, Any], methods: dict[str, dict[str, MethodRuns]]
) -> list[str]:
    """Issue 11's bar for "the methods learn": the centralised reference at least
    ``CENTRALISED_BAR`` above chance, FLoRG and FedIT at least ``FEDERATED_BAR`` above chance
    on average (final round, mean over seeds), every other method above chance (its 95%
    interval clear of the chance level)."""
    lines = [
        "| task | what | above chance, mean [95% CI] | bar | met |",
        "|---|---|---|---|---|",
    ]
    for task, by_method in methods.items():
        info = summary["tasks"][task]
        chance = info["chance"]
        if chance is None:  # no class to guess: these bars do not apply
            lines.append(f"| {task} | – | no chance level (not a classification task) | – | – |")
            continue
        if info["centralised"] is not None:
            low, high = info.get("centralised_interval") or (None, None)
            shifted = "" if low is None else f" [{low - chance:+.4f}, {high - chance:+.4f}]"
            above = info["centralised"] - chance
            lines.append(
                f"| {task} | centralised reference ({info.get('centralised_label') or 'one run'})"
                f" | {above:+.4f}{shifted} | mean ≥ {CENTRALISED_BAR} | "
                f"{'yes' if above >= CENTRALISED_BAR else 'no'} |"
            )
        for label, runs in by_method.items():
            interval = mean_interval([score - chance for score in runs.test_final])
            if label in BAR_METHODS:
                bar, met = f"mean ≥ {FEDERATED_BAR}", interval.mean >= FEDERATED_BAR
            else:
                bar, met = "interval above 0", not math.isnan(interval.low) and interval.low > 0
            outcome = "too few seeds" if interval.n < 2 else ("yes" if met else "no")
            lines.append(f"| {task} | {label} | {_signed(interval)} | {bar} | {outcome} |")
    return lines


def _signed(interval: Any) -> str:
    if math.isnan(interval.low):
        return f"{interval.mean:+.4f} (n = {interval.n})"
    return f"{interval.mean:+.4f} [{interval.low:+.4f}, {interval.high:+.4f}]"


def _scores_by_round(runs: MethodRuns) -> dict[int, list[float]]:
    """Round -> the test scores of the seeds tested at that round."""
    by_round: dict[int, list[float]] = defaultdict(list)
    for points in runs.curves.values():
        for round_, score in points:
            by_round[round_].append(score)
    return by_round


def _mean_curve(runs: MethodRuns) -> dict[int, float]:
    """Round -> the test score averaged over the seeds tested at that round."""
    return {r: sum(v) / len(v) for r, v in sorted(_scores_by_round(runs).items())}


def _curve_lines(by_method: dict[str, MethodRuns]) -> list[str]:
    """The numbers behind the per-round plot: each method's test score at every tested
    round, averaged over its seeds (when a method learns, not only how far it gets)."""
    curves = {label: _mean_curve(runs) for label, runs in by_method.items()}
    rounds = sorted({round_ for curve in curves.values() for round_ in curve})
    if not rounds:
        return []
    lines = [
        "Test score per tested round, mean over seeds:",
        "",
        "| method | " + " | ".join(f"round {r}" for r in rounds) + " |",
        "|---|" + "---|" * len(rounds),
    ]
    for label, curve in curves.items():
        cells = ["–" if r not in curve else f"{curve[r]:.3f}" for r in rounds]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines + [""]


def _server_lines(task: str, by_method: dict[str, MethodRuns]) -> list[str]:
    """FLoRG's server step per variant: how closely the new A reproduces the mean Gram
    matrix and how far it moves from the previous round's A (the rank-mismatch policy and
    Procrustes trade these two off)."""
    variants = {label: runs for label, runs in by_method.items() if runs.server}
    if not variants:
        return []
    names = list(SERVER_DIAGNOSTICS.values())
    lines = [
        f"### {task}",
        "",
        "| variant | seeds | " + " | ".join(f"{n}, mean over rounds" for n in names) + " | "
        + " | ".join(f"{REFERENCE} − variant, {n} [95% CI]" for n in names) + " |",
        "|---|---|" + "---|" * (2 * len(names)),
    ]  # fmt: skip
    ref = variants.get(REFERENCE)
    for label, runs in variants.items():
        means, diffs = [], []
        for key in SERVER_DIAGNOSTICS:
            per_seed = runs.server.get(key, {})
            means.append(str(mean_interval(list(per_seed.values()))) if per_seed else "–")
            cell = "–"
            if ref is not None and label != REFERENCE:
                mine = ref.server.get(key, {})
                common = [s for s in mine if s in per_seed]
                if len(common) >= 2:
                    paired = paired_difference(
                        [mine[s] for s in common], [per_seed[s] for s in common]
                    )
                    cell = f"{paired.difference} ({len(common)} seeds)"
            diffs.append(cell)
        seeds = len(next(iter(runs.server.values())))
        lines.append(f"| {label} | {seeds} | " + " | ".join(means + diffs) + " |")
    return lines + [""]


def _verdict_rows(methods: dict[str, dict[str, MethodRuns]]) -> list[str]:
    rows = [
        "| claim | task | measure | interval (95%) | verdict |",
        "|---|---|---|---|---|",
    ]
    for task, by_method in methods.items():
        ref = by_method.get(REFERENCE)
        if ref is None:
            continue
        for label, runs in by_method.items():
            if label == REFERENCE:
                continue
            if is_v2_variant(label):
                rows += _variant_rows(task, label, runs, by_method)
                continue
            for field, name in (("test_final", "final"), ("test_last3", "last 3")):
                paired, common = _paired(ref, runs, field)
                if paired is None:
                    rows.append(f"| {_claim(label)} | {task} | {name} | too few seeds | – |")
                    continue
                claim = _claim(label)
                rows.append(
                    f"| {claim} | {task} | test {name}, {len(common)} seeds | "
                    f"{paired.difference} | {verdict(paired.difference)} |"
                )
        rows += _communication_rows(task, ref, by_method)
    return rows


def _variant_rows(
    task: str, label: str, runs: MethodRuns, by_method: dict[str, MethodRuns]
) -> list[str]:
    """Protocol v2's two questions for a FLoRG variant, on the final-round test score:
    does it beat the paper's FLoRG (variant − FLoRG), does it close the gap to FedIT
    (variant − FedIT; "beats" when the interval is above 0)."""
    rows = []
    for other, claim in ((REFERENCE, f"{label} beats the paper's FLoRG"),
                         (V2_COMPARED, f"{label} closes the gap to FedIT")):  # fmt: skip
        against = by_method.get(other)
        paired, common = (None, []) if against is None else _paired(runs, against, "test_final")
        if paired is None:
            rows.append(f"| {claim} | {task} | final | too few seeds | – |")
            continue
        rows.append(
            f"| {claim} | {task} | test final, {label} − {other}, {len(common)} seeds | "
            f"{paired.difference} | {verdict(paired.difference)} |"
        )
    return rows


def _claim(label: str) -> str:
    """The paper's claim a paired difference FLoRG − ``label`` decides."""
    if label == "florg-no-procrustes":
        return "Procrustes helps (FLoRG − no Procrustes)"
    if label.startswith("florg rank-mismatch="):
        policy = label.split("=", 1)[1]
        return f"rank-mismatch: the paper's Procrustes over all r' rows beats {policy}"
    return f"FLoRG beats {label}"


def _communication_rows(task: str, ref: MethodRuns, by_method: dict[str, MethodRuns]) -> list[str]:
    """The paper's communication claims from exact parameter counts (up + down, all
    clients, per round; the classification head travels for every method): FLoRG's uplink
    saves more than half against FedIT (Sec. 3), and FLoRG sends less than each baseline."""
    rows = []
    if not ref.params_per_round:
        return rows
    fedit = by_method.get("fedit")
    if fedit is not None and fedit.params_per_round:
        ratio = ref.params_per_round / fedit.params_per_round
        rows.append(
            f"| FLoRG sends less than half of FedIT | {task} | parameters per round, "
            f"FLoRG / FedIT | {ratio:.3f} (exact count) | "
            f"{'holds' if ratio <= 0.5 else 'does not hold'} |"
        )
    for label, runs in by_method.items():
        if label == REFERENCE or label.startswith(f"{REFERENCE} ") or not runs.params_per_round:
            continue
        if label.startswith(f"{REFERENCE}-"):  # FLoRG's own ablations send what FLoRG sends
            continue
        factor = runs.params_per_round / ref.params_per_round
        if runs.params_per_round == ref.params_per_round:
            outcome = "does not hold (equal)"
        else:
            outcome = "holds" if factor > 1 else "does not hold"
        rows.append(
            f"| FLoRG sends less than {label} | {task} | parameters per round, "
            f"{label} / FLoRG | {factor:.2f}x (exact count) | {outcome} |"
        )
    return rows


RANK_COMMUNICATION_PREFIXES = ("up-params-", "down-params-")


def _is_rank_communication(key: str) -> bool:
    """A per-client communication key of a round with mixed ranks
    (``strategies.server.strategy.LoRAStrategyBase.rank_communication``)."""
    return key.startswith(RANK_COMMUNICATION_PREFIXES)


def _rank_sort_key(key: str) -> tuple[int, int]:
    """``*-per-client`` first, then ``*-r<r>`` by r."""
    tail = key.rsplit("-", 1)[1]
    return (1, int(tail[1:])) if tail.startswith("r") and tail[1:].isdigit() else (0, 0)


def _rank_communication_lines(task: str, by_method: dict[str, MethodRuns]) -> list[str]:
    """Parameters per client per round (mean over rounds, then over seeds), overall and
    per client rank, up and down, for the methods whose runs recorded them (clients of
    different rank); nothing when none did."""
    having = {label: runs for label, runs in by_method.items() if runs.rank_communication}
    if not having:
        return []
    keys = sorted({k for r in having.values() for k in r.rank_communication}, key=_rank_sort_key)
    ranks = sorted({_rank_sort_key(k)[1] for k in keys if _rank_sort_key(k)[0]})
    columns = ["per-client"] + [f"r{r}" for r in ranks]
    header = " | ".join(f"{c} up / down" for c in columns)
    lines = [
        f"### {task}: parameters per client per round",
        "",
        "Counted by the server from the arrays each reply carried (up) and each client was "
        "sent (down), mean over rounds, then over seeds; `r<r>`: the clients of rank r (a "
        "client is sent the largest rank in its first round, its own after).",
        "",
        f"| method | {header} |",
        "|---|" + "---|" * len(columns),
    ]
    for label, runs in having.items():
        cells = []
        for column in columns:
            pair = []
            for way in ("up", "down"):
                per_seed = runs.rank_communication.get(f"{way}-params-{column}", {})
                pair.append(f"{sum(per_seed.values()) / len(per_seed):,.0f}" if per_seed else "–")
            cells.append(" / ".join(pair))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines + [""]


def _plots(methods: dict[str, dict[str, MethodRuns]], folder: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    tasks = list(methods)
    if not tasks:
        return []
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4), squeeze=False)
    for ax, task in zip(axes[0], tasks, strict=True):
        for label, runs in methods[task].items():
            by_round = _scores_by_round(runs)
            rounds = sorted(by_round)
            stats = [mean_interval(by_round[r]) for r in rounds]
            means = [s.mean for s in stats]
            (line,) = ax.plot(rounds, means, marker="o", ms=3, label=label)
            if all(s.n > 1 for s in stats):
                ax.fill_between(
                    rounds, [s.low for s in stats], [s.high for s in stats],
                    color=line.get_color(), alpha=0.15,
                )  # fmt: skip
        ax.set_title(task)
        ax.set_xlabel("round")
        ax.set_ylabel("test score (mean over seeds, 95% band)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    curve_path = folder / "evidence_test_per_round.png"
    fig.savefig(curve_path, dpi=120)
    plt.close(fig)

    entries = []
    for task, by_method in methods.items():
        ref = by_method.get(REFERENCE)
        for label, runs in by_method.items():
            if ref is None or label == REFERENCE:
                continue
            paired, _ = _paired(ref, runs, "test_final")
            if paired is not None and paired.difference.n > 1:
                entries.append((f"{task}: vs {label}", paired.difference))
    forest_path = folder / "evidence_forest.png"
    # Wide enough for the longest variant label beside the axes; the x label on two lines.
    fig, ax = plt.subplots(figsize=(9, 0.45 * max(len(entries), 2) + 1.3))
    for y, (_name, interval) in enumerate(reversed(entries)):
        ax.errorbar(
            interval.mean, y,
            xerr=[[interval.mean - interval.low], [interval.high - interval.mean]],
            fmt="o", color="black", capsize=3,
        )  # fmt: skip
    ax.axvline(0.0, color="grey", ls="--")
    ax.set_yticks(range(len(entries)), [n for n, _ in reversed(entries)], fontsize=8)
    ax.set_xlabel(f"{REFERENCE} − method\nfinal-round test score, 95% CI over seeds")
    fig.tight_layout()
    fig.savefig(forest_path, dpi=120)
    plt.close(fig)
    return [curve_path, forest_path]


def _tasks_of(grid: Grid) -> set[str]:
    return {str(run.setting("task")) for run in grid.runs}


def _other_task_descriptions(grid: Grid, ablations: list[tuple[Grid, Path]]) -> list[str]:
    """The description of each joined grid that brings a task the main grid has not (one
    report over several tasks' grids, e.g. protocol v2's movie sentiment and SNLI), so that
    the report's header names every task's setting."""
    seen, lines = _tasks_of(grid), []
    for other, _ in ablations:
        new = _tasks_of(other) - seen
        if new and other.description:
            lines += [f"With `{other.name}` ({', '.join(sorted(new))}): {other.description}", ""]
        seen |= new
    return lines


def write_evidence(
    grid: Grid,
    out: Path,
    ablations: Iterable[tuple[Grid, Path]] = (),
    centralised_files: Iterable[Path] = (),
) -> Path:
    """Write summary.json, evidence.md and the two plots under ``out``; returns the md.
    The centralised reference of a task comes from its grid folder's centralised.json,
    unless one of ``centralised_files`` (the seeded reference of
    ``benchmarks.centralised.centralised_reference``) has the task: the last file naming it wins."""
    ablations = list(ablations)
    sources = [(grid, out), *ablations]
    centralised: dict[str, Any] = {}
    paths = [source_out / CENTRALISED_FILE for _, source_out in sources]
    for path in [*(p for p in paths if p.is_file()), *centralised_files]:
        tasks = json.loads(path.read_text()).get("tasks", {})
        centralised.update({t: e for t, e in tasks.items() if e.get("test-score") is not None})
    methods = collect_methods(grid, out, ablations)
    summary = evidence_summary(grid, methods, centralised)
    (out / "evidence").mkdir(parents=True, exist_ok=True)
    (out / "evidence" / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    lines = [f"# Evidence: {grid.name}", "", grid.description, ""]
    lines += _other_task_descriptions(grid, ablations)
    for source_grid, source_out in sources:
        tuning_path = source_out / "tuning.json"
        if source_grid.tuning is not None and tuning_path.is_file():
            lines += [f"## Tuning of `{source_grid.name}` (validation score, seed 0)", ""]
            lines += tuning_markdown(json.loads(tuning_path.read_text())) + [""]
    lines += ["## Test scores", ""]
    for task, by_method in methods.items():
        lines += _task_lines(task, summary["tasks"][task], by_method)
    loss_lines = [line for task, by in methods.items() for line in _loss_lines(task, by)]
    if loss_lines:
        lines += ["## Held-out loss (lower is better)", "", LOSS_CAPTION, ""] + loss_lines
    lines += ["## Verdicts", ""] + _verdict_rows(methods) + [""]
    rank_lines = [ln for task, by in methods.items() for ln in _rank_communication_lines(task, by)]
    if rank_lines:
        lines += ["## Communication by client rank", ""] + rank_lines
    lines += ["## Learning", ""] + _learning_lines(summary, methods) + [""]
    server = [line for task, by in methods.items() for line in _server_lines(task, by)]
    lines += ["## FLoRG's server step", ""]
    lines += server or ["No run of this report recorded FLoRG's server diagnostics.", ""]
    plots = _plots(methods, out / "plots")
    lines += [f"![{p.stem}](plots/{p.name})" for p in plots]
    done = sum(len(r.seeds) for m in methods.values() for r in m.values())
    lines += ["", f"Runs with test scores: {done}; scores are fractions in [0, 1]."]
    machines = run_machines(e for m in methods.values() for r in m.values() for e in r.environments)
    lines += ["", f"Machines the runs recorded: {machines}."]
    path = out / "evidence.md"
    path.write_text("\n".join(lines) + "\n")
    return path
