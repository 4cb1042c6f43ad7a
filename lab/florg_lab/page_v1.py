"""Protocol v1's page (docs/results-v1.md): its report's verdict, learning, test, tuning and
server-step tables, rendered again from what the report was written from.

The report (``lab/evidence/evidence/README.md``) is :func:`florg_lab.evidence.write_evidence`
over the grids ``evidence``, ``evidence-fedsa``, ``evidence-ablations`` and
``evidence-snli``; their runs (config.json, metrics.jsonl, summary.json), tuning choices
and the published ``summary.json`` (chance levels, centralised references) are all
published beside it. This module reads them back with
:func:`florg_lab.evidence.collect_published` and writes each table with the report's own
function, so the page and the report cannot disagree, and no text is cut out of the
report. The blocks' origin lines name the report, whose tables these are.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import cache

from florg_lab.evidence import (
    MethodRuns,
    _learning_lines,
    _server_lines,
    _task_lines,
    _verdict_rows,
    collect_published,
)
from florg_lab.page_text import Evidence
from florg_lab.tuning import tuning_markdown

PUBLISHED = "lab/evidence/evidence"
V1 = f"{PUBLISHED}/summary.json"
V1_REPORT = f"{PUBLISHED}/README.md"
# The report's grids in its order (`florg experiments evidence evidence --with
# evidence-fedsa=... evidence-ablations=... evidence-snli=...`, NOTES.md beside it)
GRIDS = ("evidence", "evidence-fedsa", "evidence-ablations", "evidence-snli")
MARKERS = ("VERDICTS", "LEARNING", "TESTS", "TUNING", "SERVER")

# Each block's first sentence, before its table
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


@cache
def _methods(ev: Evidence) -> dict[str, dict[str, MethodRuns]]:
    """task -> method label -> its published runs, as the report collected them."""
    return collect_published(ev.root / PUBLISHED, GRIDS)


def _subheadings(lines: list[str]) -> str:
    """The report's per-task sections one heading level down (the page nests them)."""
    return "\n".join("#" + line if line.startswith("### ") else line for line in lines).strip()


def tables(ev: Evidence) -> dict[str, str]:
    """Each marker's table, as the report prints it."""
    methods, summary = _methods(ev), ev.summary(V1)
    tests = [line for task, by in methods.items()
             for line in _task_lines(task, summary["tasks"][task], by)]  # fmt: skip
    tuning = []
    for grid in GRIDS:
        path = ev.root / PUBLISHED / f"{grid}-tuning.json"
        if path.is_file():
            document = json.loads(path.read_text())
            table = [line for line in tuning_markdown(document) if line.startswith("|")]
            tuning.append(f"`{grid}`:\n\n" + "\n".join(table))
    server = [line for task, by in methods.items() for line in _server_lines(task, by)]
    return {
        "VERDICTS": "\n".join(_verdict_rows(methods)),
        "LEARNING": "\n".join(_learning_lines(summary, methods)),
        "TESTS": _subheadings(tests),
        "TUNING": "\n\n".join(tuning),
        "SERVER": _subheadings(
            server or ["No run of this report recorded FLoRG's server diagnostics."]
        ),  # fmt: skip
    }


def v1_part(marker: str) -> Callable[[Evidence], str]:
    """The block ``marker``: its sentence, then its table."""

    def make(ev: Evidence) -> str:
        return f"{INTRO[marker]}\n\n{tables(ev)[marker]}"

    return make
