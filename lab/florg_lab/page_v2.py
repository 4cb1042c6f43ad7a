"""Protocol v2's blocks on the verdict page (docs/results.md): the verdict table (beside
protocol v1's), each task's methods and FLoRG's variants; where the exact-aggregation
methods' runs are (``lab/grids/evidence-v2-exact*.yaml``), read by
:mod:`florg_lab.page_exact` and :mod:`florg_lab.comm_to_target`.

Read from the grids' published ``summary.json`` files (written by
:mod:`florg_lab.evidence`, published by ``florg experiments evidence ... --publish``) and
their runs' own ``summary.json`` (the exact parameter counts).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from functools import cache

from florg_lab.grid import load_grid
from florg_lab.page_text import (
    REFERENCE,
    TASKS,
    Evidence,
    interval,
    method_name,
    methods_rows,
    paired,
    rate,
    setting_line,
    table,
    task_name,
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
