"""The run folder: resolved config, one metrics row per round, console lines, summary.

Each training round's row carries what travelled: the parameters (``up-params``,
``down-params``, and ``up-bytes`` / ``down-bytes`` = 4 per parameter, the paper's count) and
the bytes a deployment sends (flower_app/wire/deployment_bytes.py: ``uplink-bytes``,
``downlink-bytes``, per client and the largest, with their running totals
``cum-uplink-bytes`` / ``cum-downlink-bytes``). A run in a FlowerTune LLM leaderboard track
(``flowertune-track``) also records its cumulative communication in the leaderboard's MB
(``comm-mb``: the measured bytes / 1024²) against the budget (``comm-budget-mb``).

Each row also goes to TensorBoard event files in ``<run>/tensorboard/`` when the optional
``tensorboard`` package is there (setting ``tensorboard``, flower_app/run_output/tracking.py).
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from flwr.common.logger import log as flwr_log

from flower_app.environment import describe_environment
from flower_app.methods.registry import get_method
from flower_app.paths import run_folder
from flower_app.preflight.leaderboard import BUDGET_MB, BYTES_PER_MB
from flower_app.run_output.tracking import open_tracker
from flower_app.settings.config import RunConfig
from flower_app.task_kinds import TaskKind, get_kind

# The bytes a round's messages take in a deployment, counted by the strategy
# (strategies/server/ledger.py); the recorder adds their running totals, cum-<key>.
MEASURED_BYTES = ("uplink-bytes", "downlink-bytes")

INFO = 20
# dp=example: what the clients' DP-SGD did in a round (strategies/server/example_dp.py)
MECHANISM_KEYS = (
    "dp-sgd-clipped-fraction", "dp-sgd-grad-norm-median", "dp-sgd-clipped-mean-norm",
    "dp-sgd-noise-std", "dp-sgd-noise-norm",
)  # fmt: skip


def make_run_dir(config: RunConfig) -> Path:
    """The run folder inside the operator's output root (flower_app/paths.py), with the
    resolved settings in ``config.json``; with ``resume``, the existing folder it names
    (its ``config.json`` is kept)."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(config.task).stem).strip("._-") or "task"
    default = f"{datetime.now():%Y%m%d-%H%M%S}-{config.method}-{stem}"
    run_dir = run_folder(config, default)
    if config.resume:
        return run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(config.as_dict(), indent=2) + "\n")
    return run_dir


def _human(n: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


class RunRecorder:
    """Writes metrics.jsonl (one JSON row per round, round 0 = before training).

    Every row has ``score``, the task's headline metric as a fraction in [0, 1], and
    ``score-metric`` naming it (the task kind's, flower_app/task_kinds/): ``accuracy`` for
    classification (``score`` = accuracy), ``f1`` for extractive QA (``score`` = F1 / 100;
    the row's ``f1`` and ``exact-match`` are percentages as in the official SQuAD script,
    and its ``accuracy`` is null). The kind's ``metric_names`` are kept in every row and
    the summary (``final-<name>``); the console line is the kind's ``console``.

    The reported scores are the global model's (``test-score``; ``score`` on validation),
    except for a method with personal parts evaluated on its clients: its
    global model has B = 0 and is no method output, so its reported scores are its
    clients' personalised models on the same splits, averaged over clients
    (``personalized-test-score``, ``personalized-val-score``). The summary names the keys
    it reports (``test-score-key``, ``val-score-key``) so tuning and reports read the same.
    """

    def __init__(
        self,
        run_dir: Path,
        config: RunConfig,
        kind: TaskKind | None = None,
        resumed: dict[str, Any] | None = None,
    ) -> None:
        """``resumed`` (a checkpoint's ``state()``) continues a run: its rows are written
        back to metrics.jsonl (dropping any row of a round after the checkpoint), totals and
        elapsed seconds go on from there. ``kind``: the task's kind (None: classification)."""
        self.run_dir = run_dir
        self.config = config
        self.kind = kind if kind is not None else get_kind("classification")
        self.score_metric = self.kind.score_metric
        self.path = run_dir / "metrics.jsonl"
        resumed = resumed or {}
        self.rows: list[dict[str, Any]] = list(resumed.get("rows", []))
        self.totals = dict(resumed.get("totals", {"up-params": 0, "down-params": 0}))
        self.t0 = time.perf_counter() - float(resumed.get("elapsed-seconds", 0.0))
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text("".join(json.dumps(r, default=_json_default) + "\n" for r in self.rows))
        os.replace(tmp, self.path)
        # A resumed run's events start after the checkpoint; purge_step hides what the
        # interrupted run had written for those rounds.
        purge = int(self.rows[-1]["round"]) + 1 if self.rows else None
        self.tracker = open_tracker(config.tensorboard, run_dir, purge_step=purge)
        method = get_method(config.method)
        personal = method.evaluates_on_clients(config) and method.personal
        self.test_key = "personalized-test-score" if personal else "test-score"
        self.val_key = "personalized-val-score" if personal else "score"

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the recorder."""
        return {
            "rows": self.rows,
            "totals": self.totals,
            "elapsed-seconds": time.perf_counter() - self.t0,
        }

    def record(
        self, server_round: int, evaluation: dict[str, float], round_metrics: dict[str, float]
    ) -> dict[str, Any]:
        up = int(round_metrics.get("up-params", 0))
        down = int(round_metrics.get("down-params", 0))
        self.totals["up-params"] += up
        self.totals["down-params"] += down
        row: dict[str, Any] = {
            "round": server_round,
            "accuracy": evaluation.get("accuracy"),
            "loss": evaluation.get("loss"),
            "score": evaluation.get("score"),
            "score-metric": self.score_metric,
            "up-params": up,
            "down-params": down,
            "up-bytes": 4 * up,
            "down-bytes": 4 * down,
            "cum-up-params": self.totals["up-params"],
            "cum-down-params": self.totals["down-params"],
            "cum-up-bytes": 4 * self.totals["up-params"],
            "cum-down-bytes": 4 * self.totals["down-params"],
            "elapsed-seconds": time.perf_counter() - self.t0,
        }
        for key, value in evaluation.items():
            if key in self.kind.metric_names or key.startswith("test-") or key == "eval-seconds":
                row[key] = value
        for key, value in round_metrics.items():
            if key not in ("up-params", "down-params"):
                row[key] = value
        for key in MEASURED_BYTES:  # the bytes the messages take on the wire, summed
            if key in round_metrics:
                self.totals[key] = self.totals.get(key, 0) + int(round_metrics[key])
                row[f"cum-{key}"] = self.totals[key]
        if self.config.flowertune_track:  # the leaderboard's budget, in its MB
            measured = all(key in self.totals for key in MEASURED_BYTES)
            total = (
                sum(self.totals[key] for key in MEASURED_BYTES)
                if measured  # what travelled; a run resumed from before the bytes: 4 / param
                else 4 * (self.totals["up-params"] + self.totals["down-params"])
            )
            row["comm-mb"] = total / BYTES_PER_MB
            row["comm-budget-mb"] = BUDGET_MB
        if server_round == 0 and self.test_key != "test-score":
            # Before training every client's personal parts are at their zero initialisation:
            # each personalised model is the global model, scored on the same test split.
            for key in ("test-score", "test-accuracy", "test-loss"):
                if key in row:
                    row[f"personalized-{key}"] = row[key]
        self.rows.append(row)
        with self.path.open("a") as f:
            f.write(json.dumps(row, default=_json_default) + "\n")
        if self.tracker is not None:
            self.tracker.log_row(row)
        self._print(row)
        return row

    def _print(self, row: dict[str, Any]) -> None:
        rounds = self.config.num_server_rounds
        parts = [f"[{self.config.method}] round {row['round']}/{rounds}"]
        words = self.kind.console(row)
        if words is not None:
            parts.append(words)
        if row.get("test-score") is not None:
            parts.append(f"test {self.score_metric} {row['test-score']:.4f}")
        if row.get("personalized-test-score") is not None:
            parts.append(f"personal test score {row['personalized-test-score']:.4f}")
        personal = self.kind.console(row, prefix="personalized-")
        if personal is not None:
            parts.append(personal)
        if "train-loss" in row:
            parts.append(f"train loss {row['train-loss']:.4f}")
        total = row["cum-up-params"] + row["cum-down-params"]
        parts.append(f"comm {_human(total)} params ({_human(4 * total)}B)")
        if "comm-mb" in row:
            parts.append(f"{row['comm-mb']:,.1f} of {row['comm-budget-mb']:,.0f} MB budget")
        if "agg-seconds" in row:
            parts.append(f"agg {row['agg-seconds'] * 1e3:.1f} ms")
        if row.get("rejected") or row.get("failures") or row.get("screened"):
            parts.append(
                f"dropped {row.get('failures', 0)} failed, {row.get('rejected', 0)} rejected, "
                f"{row.get('screened', 0)} screened"
            )
        if row.get("clipped"):
            parts.append(f"{row['clipped']} example claims clipped")
        if row.get("dp-epsilon") is not None:  # dp=central (docs/privacy.md)
            parts.append(f"dp epsilon {row['dp-epsilon']:.4g} (delta {self.config.dp_delta:g})")
        if row.get("dp-sgd-epsilon-max") is not None:  # dp=example: the clients' largest
            over = int(row.get("dp-sgd-over-target", 0))
            parts.append(f"dp-sgd epsilon max {row['dp-sgd-epsilon-max']:.4g}, {over} over target")
        parts.append(f"{row['elapsed-seconds']:.0f}s")
        if "virtual-seconds" in row:  # virtual-clock: the modelled time beside the wall clock
            parts.append(f"virtual {row['virtual-seconds']:.1f}s")
        flwr_log(INFO, " | ".join(parts))

    def _test_summary(self, key: str) -> dict[str, Any]:
        """The held-out test score ``key`` of the final round and its mean over the last
        three rounds (less round-to-round noise); absent when the run scored no test split."""
        tested = [r for r in self.rows if r.get(key) is not None]
        if not tested:
            return {}
        last_round = self.config.num_server_rounds
        last3 = [r[key] for r in tested if r["round"] > last_round - 3]
        final = tested[-1] if tested[-1]["round"] == last_round else {}
        loss_key = key.removesuffix("score") + "loss"
        return {
            "final-test-score": final.get(key),
            "final-test-loss": final.get(loss_key),
            "test-last3": _mean(last3) if len(last3) == 3 else None,
            "test-examples": tested[-1].get("test-num-examples"),
        }

    def _reported_scores(self) -> dict[str, Any]:
        """The reported test scores, the keys they come from, and (for a personal method)
        its global model's scores beside them."""
        summary = {
            **self._test_summary(self.test_key),
            "test-score-key": self.test_key,
            "val-score-key": self.val_key,
        }
        if self.test_key != "test-score":
            glob = self._test_summary("test-score")
            summary["global-final-test-score"] = glob.get("final-test-score")
            summary["global-test-last3"] = glob.get("test-last3")
        return summary

    def _privacy(self, last: dict[str, Any]) -> dict[str, Any]:
        """dp=central: the run's (epsilon, delta) after its last round; dp=example: the
        clients' largest epsilon, how many are over the target, and the last round's
        mechanism keys (docs/privacy.md)."""
        if self.config.dp == "example":
            keys = ("dp-sgd-epsilon-max", "dp-sgd-over-target", "dp-sgd-clients")
            # and what the last round's DP-SGD did, where its row has it (example_dp.py)
            mechanism = {key: last[key] for key in MECHANISM_KEYS if key in last}
            return {**{key: last.get(key) for key in keys}, **mechanism}
        if self.config.dp == "off":
            return {}
        return {"dp-epsilon": last.get("dp-epsilon"), "dp-delta": self.config.dp_delta}

    def write_summary(self, extra: dict[str, Any]) -> dict[str, Any]:
        last = self.rows[-1] if self.rows else {}
        first = self.rows[0] if self.rows else {}
        summary = {
            "method": self.config.method,
            "task": self.config.task,
            "model": self.config.model,
            "rounds": self.config.num_server_rounds,
            "final-accuracy": last.get("accuracy"),
            "final-loss": last.get("loss"),
            "initial-accuracy": first.get("accuracy"),
            "score-metric": self.score_metric,
            "final-score": last.get("score"),
            "initial-score": first.get("score"),
            **{f"final-{k}": last[k] for k in self.kind.metric_names if k in last},
            **self._reported_scores(),
            **self._privacy(last),
            "total-up-params": self.totals["up-params"],
            "total-down-params": self.totals["down-params"],
            "total-params": self.totals["up-params"] + self.totals["down-params"],
            "wall-seconds": time.perf_counter() - self.t0,
            "status": "finished",
            "environment": describe_environment(),
            **extra,
        }
        (self.run_dir / "summary.json").write_text(
            json.dumps(summary, indent=2, default=_json_default) + "\n"
        )
        self.close()
        return summary

    def close(self) -> None:
        """Flush and close the TensorBoard writer (if any)."""
        if self.tracker is not None:
            self.tracker.close()
            self.tracker = None


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, float) and math.isnan(value):
        return None
    raise TypeError(f"not JSON serialisable: {type(value)}")
