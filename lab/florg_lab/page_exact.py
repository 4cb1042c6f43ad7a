"""The exact-aggregation methods on the verdict page (docs/results.md): each task's table
beside protocol v2's FLoRG and FedIT (``lab/grids/evidence-v2-exact*.yaml``) and their
headline rows.

Read from the grids' published ``summary.json`` files and their runs' own
``summary.json``; the traffic per client per round is :mod:`florg_lab.comm_to_target`'s
count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from florg_lab.comm_to_target import v2_curves
from florg_lab.page_text import (
    REFERENCE,
    TASKS,
    Evidence,
    interval,
    method_name,
    paired,
    paired_text,
    read_json,
    table,
    tried,
)
from florg_lab.page_v2 import EXACT, EXACT_GRIDS, V2, exact_methods, task_folders
from florg_lab.stats import mean_interval


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
