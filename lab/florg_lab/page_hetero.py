"""The verdict page's blocks of clients of different rank (docs/results.md): the methods of
``hetero`` (lab/grids/hetero.yaml) with protocol v2's homogeneous r = 4 FLoRG and FedIT as
references (``hetero-references``), their traffic per client per round by client rank, and
the two-seed diagnostic grid of FLoRG's server steps (``hetero-diagnostics``).

Read from the grids' published ``summary.json`` files and runs; the traffic by rank from
the runs' ``metrics.jsonl`` through :mod:`florg_lab.evidence` (the same table its report
prints), since ``summary.json`` does not hold it.
"""

from __future__ import annotations

from functools import cache

from florg_lab.evidence import _rank_communication_lines, collect_published
from florg_lab.page_text import (
    REFERENCE,
    Evidence,
    method_name,
    methods_rows,
    paired,
    plain,
    setting_line,
    table,
)

HETERO = "lab/evidence/hetero/summary.json"
HETERO_DIAGNOSTICS = "lab/evidence/hetero-diagnostics/summary.json"
PUBLISHED = "lab/evidence/hetero"
# The report's grids in its order (`florg experiments evidence hetero --with
# hetero-references=...`, lab/scripts/evidence_hetero.sh), each published under
# runs/<grid>/ with <grid>-tuning.json
GRIDS = ("hetero", "hetero-references")
HETERO_RUNS = f"{PUBLISHED}/runs/hetero"
REFERENCE_RUNS = f"{PUBLISHED}/runs/hetero-references"
TASK = "movie-sentiment"


def hetero_table(ev: Evidence) -> str:
    """Clients of different rank: the methods, with protocol v2's homogeneous r = 4 FLoRG
    and FedIT as references."""
    task_entry = ev.summary(HETERO)["tasks"][TASK]
    rows = methods_rows(
        ev, TASK, task_entry["methods"], (HETERO_RUNS,), reference_folders=(REFERENCE_RUNS,)
    )
    return "\n".join([setting_line(task_entry, task_entry["methods"]), "", *rows])


@cache
def _traffic_lines(ev: Evidence) -> tuple[str, ...]:
    methods = collect_published(ev.root / PUBLISHED, GRIDS)
    return tuple(
        line for task, by in methods.items() for line in _rank_communication_lines(task, by)
    )


def hetero_traffic(ev: Evidence) -> str:
    """Parameters per client per round, by client rank (counted by the server from the
    arrays that travelled; the runs' metrics.jsonl holds them, summary.json does not)."""
    return "\n".join(line for line in _traffic_lines(ev) if line.startswith("|"))


def hetero_diagnostics(ev: Evidence) -> str:
    """The two-seed diagnostic grid: each server step / frame, per seed, and its paired
    difference to the paper's FLoRG."""
    entries = ev.summary(HETERO_DIAGNOSTICS)["tasks"][TASK]["methods"]
    florg = entries[REFERENCE]
    seeds = florg["seeds"]
    rows = []
    for label, entry in entries.items():
        name = "the paper's FLoRG" if label == REFERENCE else method_name(label)
        cells = [name, *(plain(entry["test_final"][entry["seeds"].index(s)]) for s in seeds)]
        cells.append("–" if label == REFERENCE else paired(entry, florg).text())
        rows.append(cells)
    head = ["server step / frame", *(f"seed {s}" for s in seeds), "variant − FLoRG"]
    return "\n".join(table(head, rows))
