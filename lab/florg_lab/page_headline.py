"""README's headline block: per grid and task, the baselines FLoRG is ahead of, behind and
level with (the paired verdict FLoRG − baseline: holds, does not hold, inconclusive).

The rows come from each grid's published ``summary.json`` (protocol v1 and v2, the causal
LM, clients of different rank), the exact methods' grid once a task of it is complete
(:func:`florg_lab.page_exact.exact_headline`) and the long-budget grid at its last round
(:func:`florg_lab.long_budget.headline_verdicts`).
"""

from __future__ import annotations

from collections.abc import Sequence

from florg_lab import long_budget
from florg_lab.page_exact import exact_headline
from florg_lab.page_hetero import HETERO
from florg_lab.page_sft import SFT
from florg_lab.page_text import REFERENCE, Evidence, method_name, paired, table, task_name
from florg_lab.page_v1 import V1
from florg_lab.page_v2 import V2

# (what the row says, the grid's published summary), in the table's order
SOURCES = (
    ("protocol v1", V1),
    ("protocol v2", V2),
    ("causal LM (`sft-cpu`)", SFT),
    ("clients of different rank (`hetero`)", HETERO),
)


def verdict_cells(verdicts: Sequence[tuple[str, str]]) -> list[str]:
    """The headline's three cells from (baseline name, verdict) pairs: the baselines FLoRG
    is ahead of, behind and level with, each "–" when empty."""
    found: dict[str, list[str]] = {"holds": [], "does not hold": [], "inconclusive": []}
    for name, outcome in verdicts:
        found[outcome].append(name)
    return [", ".join(found[k]) or "–" for k in found]


def headline(ev: Evidence) -> str:
    """README: per grid and task, the baselines FLoRG is ahead of, behind and level with."""
    rows = []
    for what, name in SOURCES:
        for task in ev.summary(name)["tasks"]:
            entries = ev.summary(name)["tasks"][task]["methods"]
            verdicts = [
                (method_name(label), paired(entries[REFERENCE], entry).verdict)
                for label, entry in entries.items()
                if not (label.startswith(REFERENCE) or " (" in label)  # FLoRG's own, references
            ]
            rows.append([what, task_name(task), *verdict_cells(verdicts)])
        if name == V2:
            rows += [[what, task_name(task), *verdict_cells(verdicts)]
                     for what, task, verdicts in exact_headline(ev)]  # fmt: skip
    what, task, verdicts = long_budget.headline_verdicts(ev)
    rows.append([what, task_name(task), *verdict_cells(verdicts)])
    head = ["evidence", "task", "FLoRG ahead", "FLoRG behind", "neither (inconclusive)"]
    return "\n".join(table(head, rows))
