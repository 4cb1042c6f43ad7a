"""The FlowerTune LLM leaderboard submission folder a run in a track ends with,
``<run>/submission/`` (docs/flowertune.md):

- ``peft_<rounds>/``: the final global model as a PEFT LoRA checkpoint, what the leaderboard's
  evaluation loads with ``PeftModel.from_pretrained`` on the 4-bit base;
- ``config.json``: the run's resolved settings;
- ``communication.json``: the MB of every round, their total against the budget, and whether
  the leaderboard's checks were on;
- ``README.md``: the track, the template it follows, and its evaluation command.

A method whose clients keep personal parts, or that writes into the base weights, has no
``peft_<rounds>/``; ``communication.json`` and the README say why."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from flower_app.adapted import AdaptedModel
from flower_app.preflight.leaderboard import (
    BUDGET_MB,
    BYTES_PER_MB,
    TEMPLATE_COMMIT,
    TEMPLATE_REPO,
    Track,
    get_track,
    megabytes,
)
from flower_app.settings.config import RunConfig

FOLDER = "submission"


def no_checkpoint_reason(adapted: AdaptedModel) -> str | None:
    """Why the run's global model is no PEFT checkpoint to enter, or None."""
    method = adapted.method
    if method.personal:
        return (
            f"{method.name} keeps personal parts on its clients: the global model is not "
            "what it trains"
        )
    if method.writes_base_weights:
        return f"{method.name} writes into the base weights, which the evaluation loads unchanged"
    return None


def communication_record(config: RunConfig, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's communication in the templates' MB, per round and in total: the bytes
    that travelled (``uplink-bytes`` + ``downlink-bytes``, as a deployment sends the
    messages), or, for rows from before those were recorded, the parameters at 4 bytes."""
    per_round = [
        {"round": r["round"], "mb": _round_mb(r), "cum-mb": _round_mb(r, "cum-")}
        for r in rows if r["round"] > 0
    ]  # fmt: skip
    total = per_round[-1]["cum-mb"] if per_round else 0.0
    return {
        "track": config.flowertune_track,
        "method": config.method,
        "budget-mb": BUDGET_MB,
        "total-mb": total,
        "within-budget": total <= BUDGET_MB,
        "leaderboard-checks": config.leaderboard,
        "rounds": per_round,
    }


def _round_mb(row: dict[str, Any], prefix: str = "") -> float:
    up, down = f"{prefix}uplink-bytes", f"{prefix}downlink-bytes"
    if up in row and down in row:
        return (row[up] + row[down]) / BYTES_PER_MB
    return megabytes(row[f"{prefix}up-params"] + row[f"{prefix}down-params"])


def _readme(
    config: RunConfig, track: Track, base_model: str, peft: Path | None, reason: str | None
) -> str:
    checks = (
        "on: the track's rules held at launch"
        if config.leaderboard
        else "lifted (leaderboard=false): a rehearsal, not an entry"
    )
    lines = [
        f"# FlowerTune LLM leaderboard: {track.name} ({config.method})",
        "",
        f"Settings from `{track.template}` of {TEMPLATE_REPO} at {TEMPLATE_COMMIT}; base model "
        f"`{config.model}`, data `{config.data_path or config.task}`, "
        f"{config.num_server_rounds} rounds. Checks {checks}. Communication: `communication.json`; "
        "settings: `config.json`.",
        "",
    ]
    if peft is None:
        lines += [f"No PEFT checkpoint: {reason}.", ""]
    else:
        command = track.eval_command.format(base=base_model, peft=peft.resolve())
        lines += [
            f"Evaluate ({track.evaluation}) with the unmodified scripts of `{track.eval_dir}`:",
            "",
            "```bash",
            command,
            "```",
            "",
        ]
    return "\n".join(lines)


def write_submission(
    run_dir: Path,
    config: RunConfig,
    adapted: AdaptedModel,
    base_model: str,
    rows: list[dict[str, Any]],
) -> Path | None:
    """Write ``<run_dir>/submission/`` for a run in a track (module docstring); None for a
    run in none. ``adapted`` holds the final global model; ``base_model`` is where the
    checkpoint's base is loaded from; the run's own ``<run_dir>/peft_lora`` export (FLoRG,
    LoRA-SB: ``AdaptedModel.export_peft``), when the ServerApp wrote one, is copied instead
    of exported again."""
    track = get_track(config)
    if track is None:
        return None
    out = run_dir / FOLDER
    out.mkdir(parents=True, exist_ok=True)
    reason = no_checkpoint_reason(adapted)
    peft: Path | None = None
    if reason is None:
        peft = out / f"peft_{config.num_server_rounds}"
        if peft.exists():
            shutil.rmtree(peft)
        exported = run_dir / "peft_lora"
        if (exported / "adapter_config.json").is_file():  # the run's own export (export_peft)
            shutil.copytree(exported, peft)
        else:
            adapted.save_peft(peft, base_model)
    (out / "config.json").write_text(json.dumps(config.as_dict(), indent=2) + "\n")
    record = communication_record(config, rows)
    record["peft"] = peft.name if peft is not None else None
    record["no-peft-reason"] = reason
    (out / "communication.json").write_text(json.dumps(record, indent=2) + "\n")
    (out / "README.md").write_text(_readme(config, track, base_model, peft, reason))
    return out
