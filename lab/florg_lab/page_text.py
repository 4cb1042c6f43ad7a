"""The result pages' shared vocabulary: the published evidence as read, and its numbers,
names and paired differences as the pages write them.

Every page renderer (beside its grid's report code: :mod:`florg_lab.long_budget`,
:mod:`florg_lab.page_v2`, ...) reads the evidence through :class:`Evidence` (the
repository's ``lab/evidence/``, or a copy in a test) and writes with these helpers, so that
a number reads the same on every page: ``+0.052 [−0.010, +0.114]`` for a paired difference,
``5e-4`` for a learning rate, FedIT for ``fedit``. Paired differences (one entry minus
another over the seeds both finished), their 95% t intervals and verdicts are
:mod:`florg_lab.stats`'s: *holds* when the interval lies above 0, *does not hold* below 0,
*inconclusive* otherwise.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from florg_lab.stats import Interval, mean_interval, paired_difference, verdict

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
def read_json(path: Path) -> Any:
    """A published JSON file, read once per process (the pages read each many times)."""
    return json.loads(path.read_text())


@dataclass(frozen=True)
class Evidence:
    """The published evidence under ``root`` (the repository)."""

    root: Path

    def summary(self, name: str) -> dict[str, Any]:
        return read_json(self.root / name)

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
                done, settings = read_json(summary), read_json(config)
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


def paired_text(ref: dict[str, Any], other: dict[str, Any]) -> str:
    """The paired difference's cell, or what it waits for while a grid still runs and
    fewer than two seeds are shared (a method's first published run is its tuning run)."""
    common = shared_seeds(ref, other)
    if len(common) < 2:
        return f"– (seeds shared: {len(common)}; an interval needs two)"
    return paired(ref, other).text()


def table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def losses(entry: dict[str, Any]) -> list[float]:
    return [v for v in entry.get("test_loss_final") or [] if v is not None]


def tried(entry: dict[str, Any]) -> str:
    """``5e-4 (tried 2.5e-4 to 2e-3)``: the chosen adapter rate and the range tuning
    tried; the choice is interior when it is neither end."""
    values = sorted(entry.get("lr_path") or [])
    if not values:
        return rate(entry["lr"])
    return f"{rate(entry['lr'])} (tried {rate(values[0])} to {rate(values[-1])})"


# --- a grid's methods as a table -------------------------------------------------------


def setting_line(task_entry: dict[str, Any], methods: dict[str, Any]) -> str:
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


def methods_rows(
    ev: Evidence,
    task: str,
    methods: dict[str, Any],
    folders: Sequence[str],
    reference_folders: Sequence[str] = (),
) -> list[str]:
    """A grid's methods on ``task`` as one table (protocol v2, ``hetero``, ``sft-cpu``): the
    tuned rate, the test score with each seed's, FLoRG − method over the final round and
    over the last three rounds, the final test loss and the traffic relative to FLoRG's,
    counted from the runs under ``folders`` (a labelled reference's, such as ``fedit
    (homogeneous r = 4)``, under ``reference_folders``)."""
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
        final_losses = losses(entry)
        cells = [
            method_name(label),
            tried(entry),
            interval(mean_interval(entry["test_final"])),
            per_seed,
        ]
        if label == REFERENCE:
            cells += ["–", "–", "–"]
        else:
            final, last3 = paired(florg, entry), paired(florg, entry, "test_last3")
            cells += [final.text(), last3.text(), f"{final.ahead} of {final.seeds}"]
        cells += [plain(statistics.fmean(final_losses)) if final_losses else "–", traffic]
        rows.append(cells)
    head = [
        "method", "adapter lr", "test, final: mean [95% CI]",
        "test, final, seed " + " / ".join(str(s) for s in seeds),
        "FLoRG − method, final", "FLoRG − method, mean of last 3", "seeds FLoRG is ahead",
        "test loss, final (mean)", "parameters per round / FLoRG's",
    ]  # fmt: skip
    return table(head, rows)
