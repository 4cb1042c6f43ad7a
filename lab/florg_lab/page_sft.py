"""The verdict page's causal-LM block (docs/results.md): instruction tuning on this CPU
(``sft-cpu``, lab/grids/sft-cpu.yaml), from its published ``summary.json``, its tuning
file and its runs' own ``summary.json`` (the parameter counts).
"""

from __future__ import annotations

from typing import Any

from florg_lab.page_text import (
    REFERENCE,
    Evidence,
    interval,
    losses,
    method_name,
    methods_rows,
    paired,
    plain,
    rate,
    read_json,
    table,
)

SFT = "lab/evidence/sft-cpu/summary.json"
SFT_TUNING = "lab/evidence/sft-cpu/sft-cpu-tuning.json"
SFT_RUNS = "lab/evidence/sft-cpu/runs/sft-cpu"


def sft_table(ev: Evidence) -> str:
    """Causal-LM instruction tuning on this CPU: validation per learning rate tried at seed
    0, the held-out test gen-F1 (fraction) with the centralised reference, FLoRG − FedIT,
    the response loss and the traffic."""
    task = "squad-gen"
    task_entry = ev.summary(SFT)["tasks"][task]
    methods = task_entry["methods"]
    tuning = read_json(ev.root / SFT_TUNING)
    values = sorted({float(v) for row in tuning["table"].values() for v in row["scores"]})
    lines = [
        f"Validation gen-F1 at seed 0, mean of the last 3 rounds ({SFT_TUNING}):",
        "",
        *table(
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
        *methods_rows(ev, task, methods, (SFT_RUNS,)),
    ]
    florg, fedit = methods[REFERENCE], methods["fedit"]
    if losses(florg) and losses(fedit):
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
