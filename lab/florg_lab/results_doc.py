"""Write, or check, every generated block of the result pages from the published evidence.

    python -m florg_lab.results_doc            # rewrite every block and figure
    python -m florg_lab.results_doc --check    # exit 1 naming each stale block

The pages (README.md, docs/results.md, docs/results-v1.md) mark each generated block as
``<!-- NAME -->`` ... ``<!-- /NAME -->``. The text between the two markers is this
module's: a first line, an HTML comment, names this command and the files the block is
computed from, and the rest is a table or a figure link. The prose around the blocks is by
hand and quotes no number that a block holds. Sources, all published under ``lab/evidence/``
by the commands that ran the grids (``florg experiments evidence ... --publish``,
``lab/scripts/publish_evidence_v2.sh``):

- each grid's ``summary.json`` (per task and method: the chosen learning rate, the seeds,
  the final-round and last-three-rounds test scores, the final test loss; for protocol v2
  also the learning rates tuning tried): every score, interval and verdict;
- each published run's own ``summary.json`` (``total-params`` over ``rounds``): the
  parameters a method sends per round, as exact counts;
- a grid's ``*-tuning.json``: validation scores of the learning rates tried;
- the chosen runs' ``metrics.jsonl`` (per round: the test score, the parameters sent):
  the parameters each method sends to reach a target score, and the figures of test
  score against them, through :mod:`florg_lab.comm_to_target`;
- the privacy grid's runs (``summary.json``'s ``dp-epsilon`` and test score;
  ``metrics.jsonl`` for what the mechanism did), through
  :mod:`florg_lab.privacy`, which also draws the privacy figure;
- the privacy regimes' runs and tuning files (``lab/evidence/privacy-regimes/``: cross-silo
  DP-SGD and cross-device central DP with Poisson sampling), through
  :mod:`florg_lab.privacy_regimes`, which also draws their figures once a
  private run is published (until then the block says what is queued);
- the published evidence reports (``README.md`` beside a ``summary.json``) for the
  tables a summary does not hold: protocol v1's page copies its report's verdict, test,
  learning, tuning and server-step tables, and the per-rank traffic of clients of
  different rank comes from the ``hetero`` report.

``--check`` rewrites nothing: it prints ``PAGE: block NAME ...`` for every block that
differs from what this command would write (or whose markers are missing) and exits 1;
the unit tests run it on the committed pages. Figures are written, not compared byte for
byte (their pixels depend on the installed matplotlib); the check requires that each one
exists.

Paired differences (FLoRG − method, over the seeds both finished), their 95% t intervals
and verdicts are :mod:`florg_lab.stats`'s: *holds* when the interval lies
above 0, *does not hold* below 0, *inconclusive* otherwise.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from florg_lab.stats import Interval, mean_interval, paired_difference, verdict

__all__ = [
    "BLOCKS",
    "COMMAND",
    "FIGURES",
    "Block",
    "check",
    "fill",
    "main",
    "render",
    "report_parts",
    "write",
]

COMMAND = "python -m florg_lab.results_doc"
ROOT = Path(__file__).resolve().parents[2]  # the repository

# Published evidence, relative to the repository
V1 = "lab/evidence/evidence/summary.json"
V2 = "lab/evidence/evidence-v2/summary.json"
HETERO = "lab/evidence/hetero/summary.json"
HETERO_DIAGNOSTICS = "lab/evidence/hetero-diagnostics/summary.json"
SFT = "lab/evidence/sft-cpu/summary.json"
SFT_TUNING = "lab/evidence/sft-cpu/sft-cpu-tuning.json"
V1_REPORT = "lab/evidence/evidence/README.md"
HETERO_REPORT = "lab/evidence/hetero/README.md"
PRIVACY_RUNS = ("lab/evidence/privacy/runs", "lab/evidence/evidence-v2/runs/evidence-v2")
PRIVACY_FIGURE = "lab/evidence/privacy/privacy-utility.png"
LONG = "lab/evidence/long-snli"  # the long-budget SNLI grid's published runs and tuning.json
LONG_FIGURE = "lab/evidence/long-snli/curve.png"
LONG_RUNS = 21  # lab/grids/evidence-long-snli.yaml: 3 methods x 5 seeds, 6 more tuning runs
LONG_METHODS = ("florg", "fedit", "federa")  # the long-budget grid's methods
# Protocol v2's exact-aggregation methods (lab/grids/evidence-v2-exact*.yaml), published
# by `PUBLISH_ONLY=1 bash lab/scripts/evidence_exact.sh` beside evidence-v2's runs
EXACT = "lab/evidence/evidence-v2-exact/summary.json"
EXACT_METHODS = ("rolora", "fedsvd", "flora", "fed-sb")
# Communication to a target: the targets (fractions of FedIT's final seed-mean test score)
# and each task's figure
COMM_FRACTIONS = (1.0, 0.9)
COMM_FIGURE = "lab/evidence/evidence-v2/plots/comm-to-target-{task}.png"
# The privacy grid's seeds (lab/grids/privacy.yaml); its ε = ∞ arm reuses evidence-v2's runs
PRIVACY_SEEDS = (0, 1, 2)
# Where each grid's published runs lie, per (summary, method label): the runs' own
# summary.json files give the exact parameter counts
RUN_FOLDERS = {
    V1: ("lab/evidence/evidence/runs/evidence", "lab/evidence/evidence/runs/evidence-snli",
         "lab/evidence/evidence/runs/evidence-fedsa"),
    V2: ("lab/evidence/evidence-v2/runs/evidence-v2",
         "lab/evidence/evidence-v2/runs/evidence-v2-snli"),
    EXACT: ("lab/evidence/evidence-v2-exact/runs/evidence-v2-exact",
            "lab/evidence/evidence-v2-exact/runs/evidence-v2-exact-snli"),
    HETERO: ("lab/evidence/hetero/runs/hetero",),
    SFT: ("lab/evidence/sft-cpu/runs/sft-cpu",),
}  # fmt: skip
HETERO_REFERENCE_RUNS = "lab/evidence/hetero/runs/hetero-references"

REFERENCE = "florg"
BASELINES = ("fedit", "federa", "fedex-lora", "ffa-lora", "fedsa-lora")
NAMES = {
    "florg": "FLoRG",
    "fedit": "FedIT",
    "federa": "FeDeRA",
    "fedex-lora": "FedEx-LoRA",
    "ffa-lora": "FFA-LoRA",
    "fedsa-lora": "FedSA-LoRA",
    "hetlora": "HetLoRA",
    "flexlora": "FlexLoRA",
    "florg-signed": "`florg-signed`",
    "florg-no-procrustes": "FLoRG without Procrustes",
    "rolora": "RoLoRA",
    "fedsvd": "FedSVD",
    "flora": "FLoRA",
    "fed-sb": "Fed-SB",
}
TASKS = {"movie-sentiment": "movie sentiment", "snli": "SNLI"}


# --- numbers as text -------------------------------------------------------------------


def signed(value: float) -> str:
    """``+0.052`` / ``−0.078`` (a true minus sign); a value that three decimals would show
    as zero gets a fourth, so that its sign stays visible."""
    digits = 4 if value != 0 and round(value, 3) == 0 else 3
    return f"{value:+.{digits}f}".replace("-", "−")


def plain(value: float) -> str:
    return f"{value:.3f}"


def interval(found: Interval, sign: bool = False) -> str:
    """``mean [low, high]``; the mean alone when there are too few values."""
    text = signed if sign else plain
    if math.isnan(found.low):
        return f"{text(found.mean)} (one seed)"
    return f"{text(found.mean)} [{text(found.low)}, {text(found.high)}]"


def rate(value: float) -> str:
    """A learning rate as the pages write it: ``5e-4``, ``2.5e-4``, ``4e-3``."""
    mantissa, exponent = f"{value:e}".split("e")
    return f"{float(mantissa):g}e{int(exponent)}"


def task_name(task: str) -> str:
    return TASKS.get(task, task)


def method_name(label: str) -> str:
    """``fedit`` -> FedIT; ``florg subtract-init=True projection-init=svd`` ->
    ``subtract-init=true`` + ``projection-init=svd``; ``florg (homogeneous r = 4)`` ->
    FLoRG (homogeneous r = 4)."""
    head, paren, tail = label.partition(" (")
    if paren:
        return f"{method_name(head)} ({tail}"
    if label.startswith(f"{REFERENCE} "):
        settings = label.split()[1:]
        return " + ".join(f"`{s.replace('=True', '=true')}`" for s in settings)
    return NAMES.get(label, label)


# --- reading the evidence ----------------------------------------------------------------


@cache
def _json(path: Path) -> Any:
    return json.loads(path.read_text())


@dataclass(frozen=True)
class Evidence:
    """The published evidence under ``root`` (the repository)."""

    root: Path

    def summary(self, name: str) -> dict[str, Any]:
        return _json(self.root / name)

    def entries(self, name: str, task: str) -> dict[str, dict[str, Any]]:
        """Method label -> its summary entry, methods then (protocol v2) variants."""
        found = self.summary(name)["tasks"][task]
        return {**found["methods"], **found.get("variants", {})}

    def params_per_round(self, folders: Sequence[str], task: str, method: str) -> float | None:
        """Parameters sent per round (up and down, all clients) by ``method``'s finished
        runs of ``task`` under ``folders``: summary.json's total-params over its rounds,
        the mean over runs (the count is exact, so they agree)."""
        counts = []
        for folder in folders:
            for run in sorted((self.root / folder).iterdir()):
                summary, config = run / "summary.json", run / "config.json"
                if not (summary.is_file() and config.is_file()):
                    continue
                done, settings = _json(summary), _json(config)
                if done.get("status") != "finished" or not done.get("rounds"):
                    continue
                if settings.get("task") == task and settings.get("method") == method:
                    counts.append(float(done["total-params"]) / int(done["rounds"]))
        return statistics.fmean(counts) if counts else None


@dataclass(frozen=True)
class Paired:
    """One entry minus another (usually FLoRG − method) over the seeds both finished."""

    difference: Interval
    ahead: int  # seeds where the first of the two scored higher
    behind: int  # seeds where the second did
    seeds: int

    @property
    def verdict(self) -> str:
        return verdict(self.difference)

    def text(self) -> str:
        return f"{interval(self.difference, sign=True)} {self.verdict}"


def shared_seeds(ref: dict[str, Any], other: dict[str, Any]) -> list[int]:
    """The seeds both entries hold, in ``ref``'s order (what a paired difference pairs)."""
    return [s for s in ref["seeds"] if s in other["seeds"]]


def paired(ref: dict[str, Any], other: dict[str, Any], field: str = "test_final") -> Paired:
    common = shared_seeds(ref, other)
    if len(common) < 2:
        raise ValueError(f"fewer than two shared seeds ({common})")
    a = [ref[field][ref["seeds"].index(s)] for s in common]
    b = [other[field][other["seeds"].index(s)] for s in common]
    found = paired_difference(a, b)
    return Paired(found.difference, found.wins, found.losses, len(common))


def _paired_text(ref: dict[str, Any], other: dict[str, Any]) -> str:
    """The paired difference's cell, or what it waits for while a grid still runs and
    fewer than two seeds are shared (a method's first published run is its tuning run)."""
    common = shared_seeds(ref, other)
    if len(common) < 2:
        return f"– (seeds shared: {len(common)}; an interval needs two)"
    return paired(ref, other).text()


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _losses(entry: dict[str, Any]) -> list[float]:
    return [v for v in entry.get("test_loss_final") or [] if v is not None]


def _tried(entry: dict[str, Any]) -> str:
    """``5e-4 (tried 2.5e-4 to 2e-3)``: the chosen adapter rate and the range tuning
    tried; the choice is interior when it is neither end."""
    tried = sorted(entry.get("lr_path") or [])
    if not tried:
        return rate(entry["lr"])
    return f"{rate(entry['lr'])} (tried {rate(tried[0])} to {rate(tried[-1])})"


# --- the blocks --------------------------------------------------------------------------


def headline(ev: Evidence) -> str:
    """README: per grid and task, the baselines FLoRG is ahead of, behind and level with."""
    sources = [
        ("protocol v1", V1),
        ("protocol v2", V2),
        ("causal LM (`sft-cpu`)", SFT),
        ("clients of different rank (`hetero`)", HETERO),
    ]
    rows = []
    for what, name in sources:
        for task in ev.summary(name)["tasks"]:
            entries = ev.summary(name)["tasks"][task]["methods"]
            verdicts = [
                (method_name(label), paired(entries[REFERENCE], entry).verdict)
                for label, entry in entries.items()
                if not (label.startswith(REFERENCE) or " (" in label)  # FLoRG's own, references
            ]
            rows.append([what, task_name(task), *_verdict_cells(verdicts)])
        if name == V2:
            rows += _exact_headline(ev)
    rows.append(["long budget (`evidence-long-snli`, round 160)", task_name("snli"),
                 *_long_budget_headline(ev, 160)])  # fmt: skip
    head = ["evidence", "task", "FLoRG ahead", "FLoRG behind", "neither (inconclusive)"]
    return "\n".join(_table(head, rows))


def _exact_headline(ev: Evidence) -> list[list[str]]:
    """The exact methods' rows: per task whose grid is complete (every method run on every
    seed of protocol v2's FLoRG), FLoRG − method paired by seed, as in its exact table; a
    task whose grid still runs has no row yet."""
    if not (ev.root / EXACT).is_file():
        return []
    rows = []
    for task in TASKS:
        florg = ev.summary(V2)["tasks"][task]["methods"][REFERENCE]
        found = ev.summary(EXACT)["tasks"].get(task, {}).get("methods", {})
        if not all(m in found and set(florg["seeds"]) <= set(found[m]["seeds"])
                   for m in EXACT_METHODS):  # fmt: skip
            continue
        verdicts = [(method_name(m), paired(florg, found[m]).verdict) for m in EXACT_METHODS]
        rows.append(["exact methods (`evidence-v2-exact`), protocol v2", task_name(task),
                     *_verdict_cells(verdicts)])  # fmt: skip
    return rows


def _long_budget_headline(ev: Evidence, round_: int) -> list[str]:
    """The long-budget grid's baselines FLoRG is ahead of, behind and level with at
    ``round_`` (FLoRG − baseline paired by seed, as on the verdict page's curve)."""
    from florg_lab import long_budget as lb

    baselines = [m for m in LONG_METHODS if m != REFERENCE]
    (entry,) = lb.curve(lb.chosen_runs(ev.root / LONG), (round_,), baselines)
    return _verdict_cells(
        [(method_name(b), verdict(entry["differences"][b].difference)) for b in baselines]
    )


def _verdict_cells(verdicts: Sequence[tuple[str, str]]) -> list[str]:
    """The headline's three cells from (baseline name, verdict) pairs: the baselines FLoRG
    is ahead of, behind and level with, each "–" when empty."""
    found: dict[str, list[str]] = {"holds": [], "does not hold": [], "inconclusive": []}
    for name, outcome in verdicts:
        found[outcome].append(name)
    return [", ".join(found[k]) or "–" for k in found]


def verdict_table(ev: Evidence) -> str:
    """docs/results.md: FLoRG − baseline, final-round test, v1 and v2, both tasks."""
    columns = [(p, name, task) for p, name in (("v1", V1), ("v2", V2))
               for task in ("movie-sentiment", "snli")]  # fmt: skip
    rows = []
    for baseline in BASELINES:
        cells = [method_name(baseline)]
        for _, name, task in columns:
            entries = ev.entries(name, task)
            cells.append(paired(entries[REFERENCE], entries[baseline]).text())
        rows.append(cells)
    head = ["baseline", *[f"{task_name(t)}, {p}" for p, _, t in columns]]
    return "\n".join(_table(head, rows))


def variants_table(task: str) -> Callable[[Evidence], str]:
    """Protocol v2's FLoRG variants on ``task``: each variant's score, variant − FLoRG and
    variant − FedIT (paired), FLoRG and FedIT as the reference rows."""

    def make(ev: Evidence) -> str:
        task_entry = ev.summary(V2)["tasks"][task]
        methods, variants = task_entry["methods"], task_entry["variants"]
        florg, fedit = methods[REFERENCE], methods["fedit"]
        rows = [
            [f"{method_name(label)} ({rate(entry['lr'])})",
             interval(mean_interval(entry["test_final"])), "–", "–", "–"]
            for label, entry in ((REFERENCE, florg), ("fedit", fedit))
        ]  # fmt: skip
        by_score = sorted(variants.items(), key=lambda kv: -statistics.fmean(kv[1]["test_final"]))
        for label, entry in by_score:
            to_florg, to_fedit = paired(entry, florg), paired(entry, fedit)
            rows.append([
                f"{method_name(label)} ({rate(entry['lr'])})",
                interval(mean_interval(entry["test_final"])),
                to_florg.text(),
                f"{to_florg.behind} of {to_florg.seeds}",
                to_fedit.text(),
            ])  # fmt: skip
        head = ["variant (adapter lr)", "test, mean [95% CI]", "variant − FLoRG",
                "seeds FLoRG is ahead", "variant − FedIT"]  # fmt: skip
        return "\n".join(_table(head, rows))

    return make


def v2_methods_table(task: str) -> Callable[[Evidence], str]:
    """Protocol v2 on ``task``, per method: the tuned rate, the test score with each seed's,
    FLoRG − method over the final round and over the last three rounds, the final test
    loss and the traffic relative to FLoRG's."""

    def make(ev: Evidence) -> str:
        task_entry = ev.summary(V2)["tasks"][task]
        methods = task_entry["methods"]
        return "\n".join(
            [_setting_line(task_entry, methods), ""]
            + _methods_rows(ev, V2, task, methods, RUN_FOLDERS[V2])
        )

    return make


def _setting_line(task_entry: dict[str, Any], methods: dict[str, Any]) -> str:
    """The head's learning rate (protocol v2 fixes it for every method) and the chance
    level, as one sentence; empty when the summary has neither."""
    heads = sorted({e["head_lr"] for e in methods.values() if e.get("head_lr") is not None})
    parts = []
    if heads:
        parts.append("Head learning rate " + ", ".join(rate(h) for h in heads))
    if task_entry.get("chance") is not None:
        parts.append(
            f"chance {plain(task_entry['chance'])} (the majority class of the "
            f"{task_entry['test_examples']} test examples)"
        )
    return "; ".join(parts) + "." if parts else ""


def _methods_rows(
    ev: Evidence,
    name: str,
    task: str,
    methods: dict[str, Any],
    folders: Sequence[str],
    reference_folders: Sequence[str] = (),
) -> list[str]:
    florg = methods[REFERENCE]
    florg_params = ev.params_per_round(folders, task, REFERENCE)
    seeds = florg["seeds"]
    rows = []
    for label, entry in methods.items():
        base, _, _ = label.partition(" (")
        where = reference_folders if " (" in label else folders
        params = ev.params_per_round(where, task, base)
        traffic = "–" if not (params and florg_params) else f"{params / florg_params:.3f}"
        per_seed = " / ".join(
            plain(entry["test_final"][entry["seeds"].index(s)]) if s in entry["seeds"] else "–"
            for s in seeds
        )
        losses = _losses(entry)
        cells = [
            method_name(label),
            _tried(entry),
            interval(mean_interval(entry["test_final"])),
            per_seed,
        ]
        if label == REFERENCE:
            cells += ["–", "–", "–"]
        else:
            final, last3 = paired(florg, entry), paired(florg, entry, "test_last3")
            cells += [final.text(), last3.text(), f"{final.ahead} of {final.seeds}"]
        cells += [plain(statistics.fmean(losses)) if losses else "–", traffic]
        rows.append(cells)
    head = [
        "method", "adapter lr", "test, final: mean [95% CI]",
        "test, final, seed " + " / ".join(str(s) for s in seeds),
        "FLoRG − method, final", "FLoRG − method, mean of last 3", "seeds FLoRG is ahead",
        "test loss, final (mean)", "parameters per round / FLoRG's",
    ]  # fmt: skip
    return _table(head, rows)


EXACT_GRIDS = {"movie-sentiment": "evidence-v2-exact", "snli": "evidence-v2-exact-snli"}


def _published_runs(ev: Evidence, folder: str) -> int:
    """How many finished runs ``folder`` (a grid's published runs) holds."""
    root = ev.root / folder
    if not root.is_dir():
        return 0
    return sum(
        _json(run / "summary.json").get("status") == "finished"
        for run in root.iterdir()
        if (run / "summary.json").is_file()
    )


def exact_table(task: str) -> Callable[[Evidence], str]:
    """The exact-aggregation methods on ``task`` beside protocol v2's FLoRG and FedIT,
    paired by seed (runs are deterministic, so v2's runs are their own reruns): each
    method's tuned rate and test score, FLoRG − method and method − FedIT over the final
    round, and the parameters it sends per client per round (uplink + downlink, round 0
    included: the communication-to-target table's count). Methods not yet in
    lab/evidence/evidence-v2-exact/summary.json are named, with how many runs are published."""

    def make(ev: Evidence) -> str:
        v2 = ev.summary(V2)["tasks"][task]["methods"]
        exact: dict[str, dict[str, Any]] = {}
        if (ev.root / EXACT).is_file():
            found = ev.summary(EXACT)["tasks"].get(task, {}).get("methods", {})
            exact = {m: found[m] for m in EXACT_METHODS if m in found}
        lines: list[str] = []
        if exact:
            florg, fedit = v2[REFERENCE], v2["fedit"]
            curves = _comm_curves(ev, task)[0]
            rows = []
            for label, entry in ((REFERENCE, florg), ("fedit", fedit), *exact.items()):
                to_florg = "–" if label == REFERENCE else _paired_text(florg, entry)
                to_fedit = "–" if label == "fedit" else _paired_text(entry, fedit)
                sent = curves[label].per_round if label in curves else None
                rows.append([
                    method_name(label), _tried(entry), str(len(entry["seeds"])),
                    interval(mean_interval(entry["test_final"])), to_florg, to_fedit,
                    "–" if sent is None else f"{sent:,.0f}",
                ])  # fmt: skip
            head = ["method", "adapter lr", "seeds", "test, final: mean [95% CI]",
                    "FLoRG − method, final", "method − FedIT, final",
                    "parameters per client per round"]  # fmt: skip
            lines += _table(head, rows)
        missing = [m for m in EXACT_METHODS if m not in exact]
        if missing:
            grid = EXACT_GRIDS[task]
            done = _published_runs(ev, RUN_FOLDERS[EXACT][list(TASKS).index(task)])
            names = ", ".join(method_name(m) for m in missing)
            queued = f"`lab/grids/{grid}.yaml`, queued in `bash lab/scripts/evidence_queue.sh`"
            lines += [
                "",
                f"{names}: not published yet ({queued}; {done} of the grid's runs published).",
            ]
        return "\n".join(lines).strip()

    return make


def hetero_table(ev: Evidence) -> str:
    """Clients of different rank: the methods, with protocol v2's homogeneous r = 4 FLoRG
    and FedIT as references."""
    task_entry = ev.summary(HETERO)["tasks"]["movie-sentiment"]
    rows = _methods_rows(
        ev, HETERO, "movie-sentiment", task_entry["methods"], RUN_FOLDERS[HETERO],
        reference_folders=(HETERO_REFERENCE_RUNS,),
    )  # fmt: skip
    return "\n".join([_setting_line(task_entry, task_entry["methods"]), "", *rows])


def hetero_traffic(ev: Evidence) -> str:
    """The hetero report's parameters per client per round, by client rank (counted by the
    server from the arrays that travelled; summary.json does not hold them)."""
    report = (ev.root / HETERO_REPORT).read_text()
    section = _section(report, "Communication by client rank")
    return "\n".join(line for line in section.splitlines() if line.startswith("|"))


def hetero_diagnostics(ev: Evidence) -> str:
    """The two-seed diagnostic grid: each server step / frame, per seed, and its paired
    difference to the paper's FLoRG."""
    entries = ev.summary(HETERO_DIAGNOSTICS)["tasks"]["movie-sentiment"]["methods"]
    florg = entries[REFERENCE]
    seeds = florg["seeds"]
    rows = []
    for label, entry in entries.items():
        name = "the paper's FLoRG" if label == REFERENCE else method_name(label)
        cells = [name, *(plain(entry["test_final"][entry["seeds"].index(s)]) for s in seeds)]
        cells.append("–" if label == REFERENCE else paired(entry, florg).text())
        rows.append(cells)
    head = ["server step / frame", *(f"seed {s}" for s in seeds), "variant − FLoRG"]
    return "\n".join(_table(head, rows))


def sft_table(ev: Evidence) -> str:
    """Causal-LM instruction tuning on this CPU: validation per learning rate tried at seed
    0, the held-out test gen-F1 (fraction) with the centralised reference, FLoRG − FedIT,
    the response loss and the traffic."""
    task = "squad-gen"
    task_entry = ev.summary(SFT)["tasks"][task]
    methods = task_entry["methods"]
    tuning = _json(ev.root / SFT_TUNING)
    values = sorted({float(v) for row in tuning["table"].values() for v in row["scores"]})
    lines = [
        f"Validation gen-F1 at seed 0, mean of the last 3 rounds ({SFT_TUNING}):",
        "",
        *_table(
            ["method", *(f"lr {rate(v)}" for v in values), "chosen"],
            [
                [
                    method_name(combo.partition("=")[2]),
                    *(
                        plain(row["scores"][str(v)]) if str(v) in row["scores"] else "–"
                        for v in values
                    ),
                    rate(row["chosen"]),
                ]
                for combo, row in tuning["table"].items()
            ],
        ),  # fmt: skip
        "",
        "Held-out test gen-F1, final round; the centralised reference is LoRA trained on "
        f"all the data in one process ({task_entry['centralised_label']}): "
        f"{_centralised(task_entry)}.",
        "",
        *_methods_rows(ev, SFT, task, methods, RUN_FOLDERS[SFT]),
    ]
    florg, fedit = methods[REFERENCE], methods["fedit"]
    if _losses(florg) and _losses(fedit):
        loss = paired(
            {"seeds": florg["seeds"], "test_final": florg["test_loss_final"]},
            {"seeds": fedit["seeds"], "test_final": fedit["test_loss_final"]},
        )
        lines += [
            "",
            "Response loss, final round, FLoRG − FedIT (lower is better): "
            f"{interval(loss.difference, sign=True)} over {loss.seeds} seeds.",
        ]
    return "\n".join(lines)


def _centralised(task_entry: dict[str, Any]) -> str:
    low_high = task_entry.get("centralised_interval")
    if task_entry.get("centralised") is None:
        return "not measured"
    if not low_high:
        return plain(task_entry["centralised"])
    return f"{plain(task_entry['centralised'])} [{plain(low_high[0])}, {plain(low_high[1])}]"


def _privacy(ev: Evidence):  # -> tuple[list[PrivateRun], list[str], float]
    """The privacy grid's runs of FLoRG and FedIT at protocol v2's movie-sentiment rates
    (the arms), with that task's chance level."""
    from florg_lab.contrast import Arm
    from florg_lab.privacy import collect

    task_entry = ev.summary(V2)["tasks"]["movie-sentiment"]
    arms = []
    for method in (REFERENCE, "fedit"):
        lr = task_entry["methods"][method]["lr"]
        label = f"{NAMES[method]} (adapter {rate(lr)})"
        arms.append(Arm(label, (("method", method), ("learning-rate", f"{lr:g}"))))
    runs = collect([ev.root / p for p in PRIVACY_RUNS], arms, PRIVACY_SEEDS)
    return runs, [arm.label for arm in arms], float(task_entry["chance"])


def _privacy_parts(ev: Evidence) -> tuple[str, str]:
    from florg_lab.privacy import report

    runs, labels, chance = _privacy(ev)
    text = report(runs, labels, chance)
    scores, _, mechanism = text.partition("\nThe mechanism, per arm and level")
    mechanism = "\n".join(line for line in mechanism.splitlines() if line.startswith("|"))
    return scores.strip(), mechanism


def privacy_table(ev: Evidence) -> str:
    return _privacy_parts(ev)[0]


def privacy_mechanism(ev: Evidence) -> str:
    return _privacy_parts(ev)[1]


def privacy_figure(ev: Evidence, path: Path) -> None:
    from florg_lab.privacy import plot

    runs, labels, chance = _privacy(ev)
    plot(runs, labels, path, chance)


# The privacy regimes (lab/florg_lab/privacy_regimes.py): one block and figure each
REGIMES_FIGURE = "lab/evidence/privacy-regimes/{regime}.png"
REGIMES_SOURCES = (
    "the runs' summary.json and metrics.jsonl under lab/evidence/privacy-regimes/runs",
    "lab/evidence/privacy-regimes/*-tuning.json",
    V2,
    EXACT,
    "the ε = ∞ runs under " + ", ".join(RUN_FOLDERS[V2][:1] + RUN_FOLDERS[EXACT][:1]),
)


def _regime(name: str):  # -> privacy_regimes.Regime
    from florg_lab.privacy_regimes import REGIMES

    return next(regime for regime in REGIMES if regime.name == name)


def privacy_regime(name: str) -> Callable[[Evidence], str]:
    """The regime's score and mechanism tables with its figure, or what is queued."""

    def make(ev: Evidence) -> str:
        from florg_lab.privacy_regimes import markdown

        regime = _regime(name)
        chance = float(ev.summary(V2)["tasks"][regime.task]["chance"])
        figure = REGIMES_FIGURE.format(regime=name)
        return markdown(regime, ev.root, NAMES, chance, figure)

    return make


def privacy_regime_figure(name: str) -> Callable[[Evidence, Path], bool]:
    def draw(ev: Evidence, path: Path) -> bool:
        from florg_lab.privacy_regimes import regime_plot

        regime = _regime(name)
        chance = float(ev.summary(V2)["tasks"][regime.task]["chance"])
        return regime_plot(regime, ev.root, NAMES, chance, path)

    return draw


def privacy_regime_drawn(name: str) -> Callable[[Evidence], bool]:
    """Whether the regime's figure is due: a private run of it is published."""

    def due(ev: Evidence) -> bool:
        from florg_lab.privacy_regimes import collect_regime

        runs = collect_regime(_regime(name), ev.root, NAMES)
        return any(run.level.private for run in runs)

    return due


# --- protocol v1's page: copies of its report's tables -----------------------------------

INTRO = {
    "VERDICTS": "Printed by the publish command below into `lab/evidence/evidence/README.md` "
    "(paired differences FLoRG − baseline over seeds, 95% t intervals; communication from "
    "exact parameter counts):",
    "TESTS": "From the same report (chance: the majority class of the test examples; "
    "centralised reference: LoRA trained on all the data in one process; with an interval "
    "when seeded, `centralised-reference.json`, else one run, `<grid>-centralised.json`):",
    "SERVER": "From the same report (each run's Gram error ||A_new^T A_new - Q||_F / ||Q||_F "
    "and drift ||A_new - A_prev||_F, averaged over the adapted layers and the rounds; mean "
    "and 95% t interval over seeds; paired differences over the shared seeds):",
    "LEARNING": "From the same report (final-round test score minus chance, mean and 95% t "
    "interval over seeds; the bars are issue 11's: the centralised reference at least 0.25 "
    "above chance, FLoRG and FedIT at least 0.15 on average, every other method above "
    "chance):",
    "TUNING": "From the same report (mean validation score of the last 3 rounds; for "
    "FedSA-LoRA its personalised models'; a choice marked *largest tried* or *smallest "
    "tried* sits at an end of the range, so that method's best value may lie outside it):",
}


def _section(report: str, title: str) -> str:
    found = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", report, re.S | re.M)
    if found is None:
        raise ValueError(f"the report has no section '## {title}'")
    return found.group(1).strip()


def report_parts(report: str) -> dict[str, str]:
    """The verdict table, the per-task test tables and the tuning tables of ``report``."""
    verdicts = [line for line in _section(report, "Verdicts").splitlines() if line.startswith("|")]
    kept = ("|", "### ", "Chance", "Test score per tested round")
    tests = [
        line for line in _section(report, "Test scores").splitlines()
        if not line or line.startswith(kept)
    ]  # fmt: skip
    tests_text = re.sub(r"\n{3,}", "\n\n", "\n".join(tests)).strip().replace("### ", "#### ")
    tuning = []
    pattern = r"^## Tuning of `([^`]+)` \(validation score, seed 0\)\n(.*?)(?=^## |\Z)"
    for found in re.finditer(pattern, report, re.S | re.M):
        table = [line for line in found.group(2).splitlines() if line.startswith("|")]
        tuning.append(f"`{found.group(1)}`:\n\n" + "\n".join(table))
    server = [
        line for line in _section(report, "FLoRG's server step").splitlines()
        if not line or line.startswith(("|", "### ", "No run"))
    ]  # fmt: skip
    server_text = re.sub(r"\n{3,}", "\n\n", "\n".join(server)).strip().replace("### ", "#### ")
    learning = [line for line in _section(report, "Learning").splitlines() if line.startswith("|")]
    return {
        "VERDICTS": "\n".join(verdicts),
        "LEARNING": "\n".join(learning),
        "TESTS": tests_text,
        "TUNING": "\n\n".join(tuning),
        "SERVER": server_text,
    }


def v1_part(marker: str) -> Callable[[Evidence], str]:
    def make(ev: Evidence) -> str:
        parts = report_parts((ev.root / V1_REPORT).read_text())
        return f"{INTRO[marker]}\n\n{parts[marker]}"

    return make


def long_budget(ev: Evidence) -> str:
    """docs/results.md: the long-budget SNLI grid (lab/florg_lab/long_budget.py)
    as far as it has run, beside protocol v2's round-40 verdict on 2,400 examples."""
    from florg_lab import long_budget as lb

    entries = ev.entries(V2, "snli")
    v2 = {b: paired(entries[REFERENCE], entries[b]).text() for b in ("fedit", "federa")}
    return "\n".join(
        [
            lb.progress_markdown(
                ev.root / LONG, LONG_RUNS, (20, 40, 80, 160), ("fedit", "federa"), 40
            ),  # fmt: skip
            "",
            f"Protocol v2 at round 40 on 2,400 examples (SNLI), for comparison: FLoRG − FedIT "
            f"{v2['fedit']}, FLoRG − FeDeRA {v2['federa']}.",
        ]
    )


def federa_fedit(ev: Evidence) -> str:
    """docs/results.md's advice names FeDeRA and FedIT together: their paired difference,
    FeDeRA − FedIT, on protocol v2's final-round test scores per task and on the long
    budget's at round 160 (the chosen runs of lab/florg_lab/long_budget.py)."""
    from florg_lab import long_budget as lb

    rows = []
    for task, name in TASKS.items():
        entries = ev.entries(V2, task)
        found = paired(entries["federa"], entries["fedit"])
        rows.append([f"protocol v2, {name}", str(found.seeds), found.text(),
                     f"{found.ahead} / {found.behind}"])  # fmt: skip
    runs = lb.chosen_runs(ev.root / LONG)
    federa, fedit = (lb.scores_at(runs[m], 160) for m in ("federa", "fedit"))
    common = sorted(set(federa) & set(fedit))
    found = paired_difference([federa[s] for s in common], [fedit[s] for s in common])
    rows.append(["long budget, SNLI, round 160", str(len(common)),
                 f"{interval(found.difference, sign=True)} {verdict(found.difference)}",
                 f"{found.wins} / {found.losses}"])  # fmt: skip
    head = ["evidence", "seeds", "FeDeRA − FedIT (test score)", "seeds FeDeRA ahead / behind"]
    return "\n".join(_table(head, rows))


def long_budget_figure(ev: Evidence, path: Path) -> None:
    from florg_lab import long_budget as lb

    lb.progress_plot(ev.root / LONG, path)


def _task_folders(task: str) -> tuple[str, str]:
    """Protocol v2's and the exact methods' run folders of ``task`` (one per task, in
    ``TASKS``' order)."""
    index = list(TASKS).index(task)
    return RUN_FOLDERS[V2][index], RUN_FOLDERS[EXACT][index]


@cache
def _comm_curves(ev: Evidence, task: str):  # -> (method -> Curve, methods not published)
    """Protocol v2's chosen runs of ``task``, the exact methods' grid's beside them."""
    from florg_lab import comm_to_target as ctt

    v2, exact = _task_folders(task)
    sources = (ctt.Source(V2, (v2,)), ctt.Source(EXACT, (exact,), EXACT_METHODS))
    runs, missing = ctt.chosen_runs(ev.root, sources, task)
    return ctt.curves(runs), missing


def comm_to_target(task: str) -> Callable[[Evidence], str]:
    """Protocol v2 on ``task``: the parameters each method sends to reach FedIT's final
    score (lab/florg_lab/comm_to_target.py)."""

    def make(ev: Evidence) -> str:
        from florg_lab import comm_to_target as ctt

        return ctt.markdown(*_comm_curves(ev, task), COMM_FRACTIONS, method_name)

    return make


def comm_to_target_figure(task: str) -> Callable[[Evidence, Path], None]:
    def draw(ev: Evidence, path: Path) -> None:
        from florg_lab import comm_to_target as ctt

        title = f"protocol v2, {task_name(task)}: test score against parameters sent"
        ctt.plot(_comm_curves(ev, task)[0], path, COMM_FRACTIONS, title, method_name)

    return draw


def comm_to_target_long(ev: Evidence) -> str:
    """The long-budget grid's chosen runs (its own reader, by tuning.json), as far as
    they are published."""
    from florg_lab import comm_to_target as ctt

    found = ctt.from_long_budget(ev.root / LONG, LONG_METHODS)
    return ctt.markdown(*found, COMM_FRACTIONS, method_name)


# --- pages, blocks, figures --------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    """One generated block: the page it sits in, its marker, the files it is computed from
    (named in its first line) and the function that writes its text."""

    page: str
    marker: str
    sources: tuple[str, ...]
    make: Callable[[Evidence], str]

    def text(self, ev: Evidence) -> str:
        origin = f"<!-- written by `{COMMAND}` from {', '.join(self.sources)}; do not edit -->"
        return f"{origin}\n{self.make(ev).strip()}"


RESULTS = "docs/results.md"
V1_PAGE = "docs/results-v1.md"
RUNS_OF = "the runs' summary.json under "
METRICS_OF = "the runs' metrics.jsonl under "
BLOCKS = (
    Block("README.md", "HEADLINE",
          (V1, V2, EXACT, SFT, HETERO, LONG + "/tuning.json", METRICS_OF + LONG + "/runs"),
          headline),
    Block(RESULTS, "VERDICT-TABLE", (V1, V2), verdict_table),
    Block(RESULTS, "V2-MOVIE-SENTIMENT", (V2, RUNS_OF + RUN_FOLDERS[V2][0]),
          v2_methods_table("movie-sentiment")),
    Block(RESULTS, "V2-SNLI", (V2, RUNS_OF + RUN_FOLDERS[V2][1]), v2_methods_table("snli")),
    *(Block(RESULTS, f"EXACT-{task.upper()}",
            (V2, EXACT, *(METRICS_OF + folder for folder in _task_folders(task))),
            exact_table(task)) for task in TASKS),
    *(Block(RESULTS, f"COMM-TO-TARGET-{task.upper()}",
            (V2, EXACT, *(METRICS_OF + folder for folder in _task_folders(task))),
            comm_to_target(task)) for task in TASKS),
    Block(RESULTS, "VARIANTS-MOVIE-SENTIMENT", (V2,), variants_table("movie-sentiment")),
    Block(RESULTS, "VARIANTS-SNLI", (V2,), variants_table("snli")),
    Block(RESULTS, "PRIVACY-TABLE", tuple(RUNS_OF + p for p in PRIVACY_RUNS) + (V2,),
          privacy_table),
    Block(RESULTS, "PRIVACY-MECHANISM", tuple(f"{p}/*/metrics.jsonl" for p in PRIVACY_RUNS),
          privacy_mechanism),
    *(Block(RESULTS, f"PRIVACY-{regime.upper()}", REGIMES_SOURCES, privacy_regime(regime))
      for regime in ("cross-silo", "cross-device")),
    Block(RESULTS, "LONG-BUDGET", (LONG + "/tuning.json", RUNS_OF + LONG + "/runs", V2),
          long_budget),
    Block(RESULTS, "FEDERA-FEDIT", (V2, LONG + "/tuning.json", METRICS_OF + LONG + "/runs"),
          federa_fedit),
    Block(RESULTS, "COMM-TO-TARGET-LONG-SNLI",
          (LONG + "/tuning.json", METRICS_OF + LONG + "/runs"), comm_to_target_long),
    Block(RESULTS, "HETERO-TABLE", (HETERO, RUNS_OF + "lab/evidence/hetero/runs"), hetero_table),
    Block(RESULTS, "HETERO-TRAFFIC", (HETERO_REPORT,), hetero_traffic),
    Block(RESULTS, "HETERO-DIAGNOSTICS", (HETERO_DIAGNOSTICS,), hetero_diagnostics),
    Block(RESULTS, "SFT-TABLE", (SFT, SFT_TUNING, RUNS_OF + RUN_FOLDERS[SFT][0]), sft_table),
    *(Block(V1_PAGE, marker, (V1_REPORT,), v1_part(marker))
      for marker in ("VERDICTS", "LEARNING", "TESTS", "TUNING", "SERVER")),
)  # fmt: skip
# Figures the pages show, each written from the evidence: (path, writer)
FIGURES: tuple[tuple[str, Callable[[Evidence, Path], None]], ...] = (
    (PRIVACY_FIGURE, privacy_figure),
    (LONG_FIGURE, long_budget_figure),
    *((COMM_FIGURE.format(task=task), comm_to_target_figure(task)) for task in TASKS),
)
# Figures drawn only once their evidence exists: (path, writer, whether it is due)
LATER_FIGURES: tuple[
    tuple[str, Callable[[Evidence, Path], bool], Callable[[Evidence], bool]], ...
] = tuple(
    (REGIMES_FIGURE.format(regime=r), privacy_regime_figure(r), privacy_regime_drawn(r))
    for r in ("cross-silo", "cross-device")
)


def _block_pattern(marker: str) -> str:
    """A marked block from an earlier write, or a lone opening marker (a new block)."""
    m = re.escape(marker)
    return rf"<!-- {m} -->\n.*?<!-- /{m} -->|<!-- {m} -->"


def fill(doc: str, marker: str, text: str) -> str:
    """``doc`` with its ``marker`` (or earlier marked block) replaced by ``text``."""
    pattern = _block_pattern(marker)
    if re.search(pattern, doc, re.S) is None:
        raise ValueError(f"the document has no <!-- {marker} --> marker")
    filled = f"<!-- {marker} -->\n{text}\n<!-- /{marker} -->"
    return re.sub(pattern, lambda _: filled, doc, count=1, flags=re.S)


def _current(doc: str, marker: str) -> str | None:
    """The text of ``marker``'s block in ``doc``; None without a complete block."""
    m = re.escape(marker)
    found = re.search(rf"<!-- {m} -->\n(.*?)\n<!-- /{m} -->", doc, re.S)
    return None if found is None else found.group(1)


def render(page: str, doc: str, ev: Evidence) -> str:
    """``doc`` (the text of ``page``) with each of its blocks written from ``ev``."""
    for block in BLOCKS:
        if block.page == page:
            doc = fill(doc, block.marker, block.text(ev))
    return doc


def pages() -> list[str]:
    return list(dict.fromkeys(block.page for block in BLOCKS))


def check(pages_root: Path = ROOT, evidence_root: Path = ROOT) -> list[str]:
    """One line per page block (and figure) that differs from what :func:`write` would
    write, naming the page and the block; empty when every one is up to date."""
    ev = Evidence(evidence_root)
    problems = []
    for block in BLOCKS:
        doc = (pages_root / block.page).read_text()
        found = _current(doc, block.marker)
        if found is None:
            problems.append(
                f"{block.page}: block {block.marker} is missing (no <!-- {block.marker} --> "
                f"... <!-- /{block.marker} --> pair)"
            )
        elif found != block.text(ev):
            problems.append(
                f"{block.page}: block {block.marker} differs from what `{COMMAND}` writes "
                f"(from {', '.join(block.sources)}); run it and commit the page"
            )
    for path, _ in FIGURES:
        if not (evidence_root / path).is_file():
            problems.append(f"{path}: figure missing; `{COMMAND}` draws it")
    for path, _, due in LATER_FIGURES:
        if due(ev) and not (evidence_root / path).is_file():
            problems.append(f"{path}: figure missing; `{COMMAND}` draws it")
    return problems


def write(pages_root: Path = ROOT, evidence_root: Path = ROOT, figures: bool = True) -> list[str]:
    """Rewrite every page's blocks and (unless ``figures`` is false) every figure; returns
    the paths written."""
    ev = Evidence(evidence_root)
    written = []
    for page in pages():
        path = pages_root / page
        doc = path.read_text()
        try:
            new = render(page, doc, ev)
        except ValueError as err:
            raise ValueError(f"{page}: {err}") from err
        if new != doc:
            path.write_text(new)
            written.append(page)
    for figure, draw in FIGURES if figures else ():
        draw(ev, evidence_root / figure)
        written.append(figure)
    for figure, draw_later, _ in LATER_FIGURES if figures else ():
        if draw_later(ev, evidence_root / figure):  # nothing to draw before a private run
            written.append(figure)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=COMMAND, description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument(
        "--check", action="store_true",
        help="write nothing; exit 1 naming each page block that differs",
    )  # fmt: skip
    parser.add_argument(
        "--root", type=Path, default=ROOT, help="the checkout whose pages and evidence to use"
    )
    args = parser.parse_args(argv)
    if args.check:
        problems = check(args.root, args.root)
        for line in problems:
            print(line)
        if problems:
            return 1
        print(f"results_doc: {len(BLOCKS)} blocks in {len(pages())} pages are up to date")
        return 0
    try:
        written = write(args.root, args.root)
    except ValueError as err:  # a page lost one of its markers
        print(f"results_doc: {err}")
        return 2
    for path in written:
        print(f"results_doc: wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
