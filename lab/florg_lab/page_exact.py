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


# Fed-SB at its authors' scale (s = 1, round 0 pooled; lab/scripts/evidence_fed_sb.sh): its
# protocol v2 rows, which replace the runs at s = 4 (those stay in the table, labelled)
FED_SB = "fed-sb"
FED_SB_S1 = "lab/evidence/fed-sb-s1/summary.json"
FED_SB_S4_LABEL = "Fed-SB at s = 4 (before the fix)"


def fed_sb_at_scale_one(ev: Evidence, task: str) -> dict[str, Any] | None:
    """Fed-SB's protocol v2 entry on ``task`` at s = 1, once its summary is published."""
    if not (ev.root / FED_SB_S1).is_file():
        return None
    return ev.summary(FED_SB_S1)["tasks"].get(task, {}).get("methods", {}).get(FED_SB)


def exact_entries(ev: Evidence, task: str) -> dict[str, dict[str, Any]]:
    """The exact methods' published entries on ``task`` (Fed-SB's at s = 1 where
    published)."""
    if not (ev.root / EXACT).is_file():
        return {}
    found = ev.summary(EXACT)["tasks"].get(task, {}).get("methods", {})
    exact = {m: found[m] for m in exact_methods() if m in found}
    at_one = fed_sb_at_scale_one(ev, task)
    if at_one is not None:
        exact[FED_SB] = at_one
    return exact


def exact_table(task: str) -> Callable[[Evidence], str]:
    """The exact-aggregation methods on ``task`` beside protocol v2's FLoRG and FedIT,
    paired by seed (runs are deterministic, so v2's runs are their own reruns): each
    method's tuned rate and test score, FLoRG − method and method − FedIT over the final
    round, and the parameters it sends per client per round (uplink + downlink, round 0
    included: the communication-to-target table's count). Methods not yet in
    lab/evidence/evidence-v2-exact/summary.json are named, with how many runs are published.
    Fed-SB's row is its run at s = 1 once published; the runs at s = 4 follow it, labelled."""

    def make(ev: Evidence) -> str:
        v2 = ev.summary(V2)["tasks"][task]["methods"]
        exact = exact_entries(ev, task)
        lines: list[str] = []
        if exact:
            florg, fedit = v2[REFERENCE], v2["fedit"]
            curves = v2_curves(ev, task)[0]
            named = [(method_name(m), m, e) for m, e in
                     ((REFERENCE, florg), ("fedit", fedit), *exact.items())]  # fmt: skip
            if fed_sb_at_scale_one(ev, task) is not None:
                s4 = ev.summary(EXACT)["tasks"][task]["methods"].get(FED_SB)
                if s4 is not None:
                    named.append((FED_SB_S4_LABEL, FED_SB, s4))
            rows = []
            for name, label, entry in named:
                to_florg = "–" if label == REFERENCE else paired_text(florg, entry)
                to_fedit = "–" if label == "fedit" else paired_text(entry, fedit)
                sent = curves[label].per_round if label in curves else None
                rows.append([
                    name, tried(entry), str(len(entry["seeds"])),
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
    FLoRG − method paired by seed, as in its exact table (Fed-SB's at s = 1 where
    published); a task whose grid still runs has no row yet."""
    if not (ev.root / EXACT).is_file():
        return []
    rows = []
    for task in TASKS:
        florg = ev.summary(V2)["tasks"][task]["methods"][REFERENCE]
        found = exact_entries(ev, task)
        if not all(m in found and set(florg["seeds"]) <= set(found[m]["seeds"])
                   for m in exact_methods()):  # fmt: skip
            continue
        verdicts = [(method_name(m), paired(florg, found[m]).verdict) for m in exact_methods()]
        rows.append(("exact methods (`evidence-v2-exact`), protocol v2", task, verdicts))
    return rows
