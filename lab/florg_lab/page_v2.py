"""Protocol v2's blocks on the verdict page (docs/results.md): the verdict table (beside
protocol v1's), each task's methods, FLoRG's variants, and the exact-aggregation methods
(``lab/grids/evidence-v2-exact*.yaml``) beside v2's FLoRG and FedIT.

Read from the grids' published ``summary.json`` files (written by
:mod:`florg_lab.evidence`, published by ``florg experiments evidence ... --publish``) and
their runs' own ``summary.json`` (the exact parameter counts); the exact methods' traffic
per client per round is :mod:`florg_lab.comm_to_target`'s count.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from functools import cache
from typing import Any

from florg_lab.grid import load_grid
from florg_lab.page_text import (
    REFERENCE,
    TASKS,
    Evidence,
    interval,
    method_name,
    methods_rows,
    paired,
    paired_text,
    rate,
    read_json,
    setting_line,
    table,
    task_name,
    tried,
)
from florg_lab.page_v1 import V1
from florg_lab.stats import mean_interval

V2 = "lab/evidence/evidence-v2/summary.json"
# Protocol v2's exact-aggregation methods, published by
# `PUBLISH_ONLY=1 bash lab/scripts/evidence_exact.sh` beside evidence-v2's runs
EXACT = "lab/evidence/evidence-v2-exact/summary.json"
EXACT_GRIDS = {"movie-sentiment": "evidence-v2-exact", "snli": "evidence-v2-exact-snli"}
# Each grid's published runs, one folder per task in TASKS' order: the runs' own
# summary.json files give the exact parameter counts
V2_RUNS = ("lab/evidence/evidence-v2/runs/evidence-v2",
           "lab/evidence/evidence-v2/runs/evidence-v2-snli")  # fmt: skip
EXACT_RUNS = tuple(f"lab/evidence/evidence-v2-exact/runs/{g}" for g in EXACT_GRIDS.values())
BASELINES = ("fedit", "federa", "fedex-lora", "ffa-lora", "fedsa-lora")


@cache
def exact_methods() -> tuple[str, ...]:
    """The exact methods, as their grid file lists them (every task's grid runs the same)."""
    return tuple(load_grid(EXACT_GRIDS["movie-sentiment"]).blocks["main"]["method"])


def task_folders(task: str) -> tuple[str, str]:
    """Protocol v2's and the exact methods' run folders of ``task``."""
    index = list(TASKS).index(task)
    return V2_RUNS[index], EXACT_RUNS[index]


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
    return "\n".join(table(head, rows))


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
        return "\n".join(table(head, rows))

    return make


def v2_methods_table(task: str) -> Callable[[Evidence], str]:
    """Protocol v2 on ``task``, per method: the tuned rate, the test score with each seed's,
    FLoRG − method over the final round and over the last three rounds, the final test
    loss and the traffic relative to FLoRG's."""

    def make(ev: Evidence) -> str:
        task_entry = ev.summary(V2)["tasks"][task]
        methods = task_entry["methods"]
        return "\n".join(
            [setting_line(task_entry, methods), ""] + methods_rows(ev, task, methods, V2_RUNS)
        )

    return make


def _published_runs(ev: Evidence, folder: str) -> int:
    """How many finished runs ``folder`` (a grid's published runs) holds."""
    root = ev.root / folder
    if not root.is_dir():
        return 0
    return sum(
        read_json(run / "summary.json").get("status") == "finished"
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
        from florg_lab.comm_to_target import v2_curves  # it reads these constants

        v2 = ev.summary(V2)["tasks"][task]["methods"]
        exact: dict[str, dict[str, Any]] = {}
        if (ev.root / EXACT).is_file():
            found = ev.summary(EXACT)["tasks"].get(task, {}).get("methods", {})
            exact = {m: found[m] for m in exact_methods() if m in found}
        lines: list[str] = []
        if exact:
            florg, fedit = v2[REFERENCE], v2["fedit"]
            curves = v2_curves(ev, task)[0]
            rows = []
            for label, entry in ((REFERENCE, florg), ("fedit", fedit), *exact.items()):
                to_florg = "–" if label == REFERENCE else paired_text(florg, entry)
                to_fedit = "–" if label == "fedit" else paired_text(entry, fedit)
                sent = curves[label].per_round if label in curves else None
                rows.append([
                    method_name(label), tried(entry), str(len(entry["seeds"])),
                    interval(mean_interval(entry["test_final"])), to_florg, to_fedit,
                    "–" if sent is None else f"{sent:,.0f}",
                ])  # fmt: skip
            head = ["method", "adapter lr", "seeds", "test, final: mean [95% CI]",
                    "FLoRG − method, final", "method − FedIT, final",
                    "parameters per client per round"]  # fmt: skip
            lines += table(head, rows)
        missing = [m for m in exact_methods() if m not in exact]
        if missing:
            grid = EXACT_GRIDS[task]
            done = _published_runs(ev, task_folders(task)[1])
            names = ", ".join(method_name(m) for m in missing)
            queued = f"`lab/grids/{grid}.yaml`, queued in `bash lab/scripts/evidence_queue.sh`"
            lines += [
                "",
                f"{names}: not published yet ({queued}; {done} of the grid's runs published).",
            ]
        return "\n".join(lines).strip()

    return make


def exact_headline(ev: Evidence) -> list[tuple[str, str, list[tuple[str, str]]]]:
    """The exact methods' headline rows, as (evidence, task, [(method name, verdict)]): per
    task whose grid is complete (every method run on every seed of protocol v2's FLoRG),
    FLoRG − method paired by seed, as in its exact table; a task whose grid still runs has
    no row yet."""
    if not (ev.root / EXACT).is_file():
        return []
    rows = []
    for task in TASKS:
        florg = ev.summary(V2)["tasks"][task]["methods"][REFERENCE]
        found = ev.summary(EXACT)["tasks"].get(task, {}).get("methods", {})
        if not all(m in found and set(florg["seeds"]) <= set(found[m]["seeds"])
                   for m in exact_methods()):  # fmt: skip
            continue
        verdicts = [(method_name(m), paired(florg, found[m]).verdict) for m in exact_methods()]
        rows.append(("exact methods (`evidence-v2-exact`), protocol v2", task, verdicts))
    return rows
