"""Simulation overhead, report: the start-up, per-round, time-breakdown and CPU tables
(markdown) and the headline numbers."""

from __future__ import annotations

import contextlib
import os
import statistics
from collections.abc import Sequence
from typing import Any

from benchmarks.overhead.loop import LoopResult
from benchmarks.overhead.monitor import CATEGORIES
from benchmarks.overhead.settings import TARGET_RATIO, Sizes
from benchmarks.overhead.sim import SimResult


def md_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(x: Any) -> str:
        if x is None:
            return "-"
        if isinstance(x, float):
            return f"{x:.2f}"
        return str(x)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _mean(xs: Sequence[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def report(sim: SimResult, loop: LoopResult, sizes: Sizes) -> dict[str, Any]:
    rows = sim.rows
    elapsed = [r["elapsed-seconds"] for r in rows]
    sim_rounds = [elapsed[i] - elapsed[i - 1] for i in range(1, len(rows))]
    loop_rounds = [r.wall for r in loop.rounds]
    after = slice(1, None)  # rounds 2..R
    sim_after, loop_after = sim_rounds[after], loop_rounds[after]
    sim_mean, loop_mean = _mean(sim_after), _mean(loop_after)
    ratio = sim_mean / loop_mean
    launch_to_r1 = sim.round_end_from_launch[1]
    startup = launch_to_r1 - loop_rounds[0]
    loop_setup = loop.import_s + loop.setup_s + loop.initial_eval_s

    sim_cpu = [sum(v or 0.0 for v in c.values()) for c in sim.cpu_by_round]
    loop_cpu = [r.cpu for r in loop.rounds]
    cpu_ratio = _mean(sim_cpu[after]) / _mean(loop_cpu[after])
    sim_foreign_known = [x for x in sim.foreign_cores_by_round[after] if x is not None]
    sim_foreign = _mean(sim_foreign_known) if sim_foreign_known else None
    loop_foreign = _mean([r.foreign_cores for r in loop.rounds[after]])

    print()
    print(
        f"## Simulation overhead: FLoRG, {sizes.clients} clients, {sizes.rounds} rounds, "
        f"all-MiniLM-L6-v2 / snli, {sizes.max_train} train / {sizes.max_eval} eval examples, "
        f"batch {sizes.batch_size}, IID"
    )
    print()
    print(
        f"Simulation: {sizes.clients} Ray actors x 1 CPU train IN PARALLEL (1 torch thread "
        f"each, set by Ray); the ServerApp evaluates with torch's default thread count. "
        f"Loop: clients ONE AFTER ANOTHER with {loop.client_threads} torch thread(s) each; "
        f"evaluation with {loop.eval_threads} (torch's default) threads."
    )
    observed = []
    for cat in (CATEGORIES[1], CATEGORIES[0]):
        counts = [c for busy in sim.busy_threads_by_round[after] for c in busy.get(cat, [])]
        if counts:
            observed.append(f"{cat}: {', '.join(str(c) for c in sorted(set(counts)))}")
    if observed:
        print(
            f"Threads doing work in a simulation process during rounds 2..{sizes.rounds} "
            f"(from /proc/PID/task): {'; '.join(observed)}."
        )
    with contextlib.suppress(OSError):
        print(f"Load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print()
    print("### Start-up (seconds; simulation times from the launch of `flwr run`)")
    print()
    row0 = rows[0]["elapsed-seconds"]
    print(
        md_table(
            ["phase", "simulation", "loop"],
            [
                ["SuperLink start (before the launch, not counted)", sim.superlink_start_s, None],
                [
                    "launch -> ServerApp main() (FAB, SuperExec, flwr-simulation)",
                    sim.launch_to_serverapp_s,
                    None,
                ],
                [
                    "ServerApp main() -> recorder clock start (imports done; data + model load)",
                    sim.serverapp_to_recorder_s,
                    loop.import_s + loop.setup_s,
                ],
                [
                    "recorder start -> round 0 row (`elapsed-seconds` of row 0: validation "
                    "tokenisation + initial evaluation)",
                    row0,
                    loop.initial_eval_s,
                ],
                [
                    "round 1 (actors start, import, load the model, tokenise; train, aggregate, "
                    "evaluate)",
                    sim_rounds[0],
                    loop_rounds[0],
                ],
                ["launch -> end of round 1", launch_to_r1, loop_setup + loop_rounds[0]],
                [
                    "**first-round start-up** = launch -> end of round 1 - loop round 1",
                    startup,
                    None,
                ],
                [
                    "launch -> launcher returns (total wall)",
                    sim.launcher_wall_s,
                    loop_setup + sum(loop_rounds),
                ],
                [
                    "after the last row -> launcher returns (final save, shutdown, status)",
                    sim.launcher_wall_s - sim.round_end_from_launch[-1],
                    None,
                ],
                [
                    "SuperLink + Ray stop (after the launcher, not counted)",
                    sim.superlink_stop_s,
                    None,
                ],
            ],
        )
    )
    print()
    print("### Per round (seconds)")
    print()
    table = []
    for i, lr in enumerate(loop.rounds):
        sr = rows[i + 1]
        table.append(
            [
                i + 1,
                sim_rounds[i],
                lr.wall,
                sim_rounds[i] / lr.wall,
                " + ".join(f"{x:.2f}" for x in lr.train_wall),
                lr.agg_wall,
                sr.get("agg-seconds"),
                lr.eval_wall,
                sim_cpu[i],
                lr.cpu,
                f"{_fmt(sim.foreign_cores_by_round[i])} / {lr.foreign_cores:.2f}",
                f"{sr['accuracy']:.4f} / {lr.accuracy:.4f}",
            ]
        )
    table.append(
        [
            f"**mean 2..{sizes.rounds}**",
            sim_mean,
            loop_mean,
            f"**{ratio:.2f}**",
            None,
            _mean([r.agg_wall for r in loop.rounds[after]]),
            _mean([r.get("agg-seconds", 0.0) for r in rows[2:]]),
            _mean([r.eval_wall for r in loop.rounds[after]]),
            _mean(sim_cpu[after]),
            _mean(loop_cpu[after]),
            f"{_fmt(sim_foreign)} / {loop_foreign:.2f}",
            None,
        ]
    )
    print(
        md_table(
            [
                "round",
                "sim wall",
                "loop wall",
                "sim / loop",
                "loop train per client",
                "loop agg",
                "sim agg",
                "loop eval",
                "sim CPU (all procs)",
                "loop CPU",
                "other work on the machine (cores) sim / loop",
                "accuracy sim / loop",
            ],
            table,
        )
    )
    print()
    print(
        f"Overhead ratio after warm-up (mean sim round / mean loop round, rounds "
        f"2..{sizes.rounds}): **{ratio:.3f}** (target <= {TARGET_RATIO}: "
        f"{'met' if ratio <= TARGET_RATIO else 'NOT met'}); CPU-time ratio {cpu_ratio:.3f}."
    )

    # Where the time goes, rounds 2..R.
    eval_mean = _mean([r.eval_wall for r in loop.rounds[after]])
    agg_mean = _mean([r.agg_wall for r in loop.rounds[after]])
    train_seq = _mean([sum(r.train_wall) for r in loop.rounds[after]])
    train_slowest = _mean([max(r.train_wall) for r in loop.rounds[after]])
    ideal_parallel = ideal_ratio = None
    if loop.client_threads == 1:  # the loop's clients ran exactly like the actors' (1 thread)
        ideal_parallel = _mean(
            [max(r.train_wall) + r.agg_wall + r.eval_wall for r in loop.rounds[after]]
        )
        ideal_ratio = sim_mean / ideal_parallel
    breakdown: list[list[Any]] = [
        [
            f"loop: {sizes.clients} clients trained one after another "
            f"({loop.client_threads} thread(s)), sum",
            train_seq,
        ],
        ["loop: slowest client", train_slowest],
        ["loop: aggregation (FLoRG Gram + Procrustes per layer, head FedAvg)", agg_mean],
        [f"loop: server evaluation ({loop.eval_threads} threads)", eval_mean],
        ["**loop: round**", loop_mean],
    ]
    if ideal_parallel is not None:
        breakdown.append(
            ["ideal parallel round = slowest client + aggregation + evaluation", ideal_parallel]
        )
    breakdown += [
        ["**sim: round**", sim_mean],
        [
            "sim: round - loop aggregation - loop evaluation (client phase incl. messaging)",
            sim_mean - agg_mean - eval_mean,
        ],
    ]
    if ideal_parallel is not None:
        breakdown.append(
            [
                "sim: round - ideal parallel round (Flower/Ray scheduling, 0.1 s polls, "
                "messaging, 2 actors sharing 2 loaded cores)",
                sim_mean - ideal_parallel,
            ]
        )
    breakdown += [
        [
            f"message (de)serialisation to protobuf, {2 * sizes.clients} messages "
            f"({loop.message_bytes_down / 1e6:.2f} MB down, {loop.message_bytes_up / 1e6:.2f} MB up"
            " each)",
            loop.serde_round_s,
        ],
    ]
    if loop.calib_other:
        breakdown.append(
            [
                f"calibration, client 0: {loop.calib_threads} threads vs "
                f"{loop.client_threads} (median of 2 each, alternating)",
                f"{statistics.median(loop.calib_other):.2f} vs "
                f"{statistics.median(loop.calib_same):.2f}",
            ]
        )
    print()
    print(f"### Where the time goes (mean over rounds 2..{sizes.rounds}, seconds)")
    print()
    print(md_table(["item", "seconds"], breakdown))
    print()
    if ideal_ratio is not None:
        print(
            f"Simulation round / ideal parallel round: {ideal_ratio:.3f} (overhead of the "
            f"engine itself, with the actors' parallelism taken out)."
        )
        print()
    cpu_rows = []
    for cat in CATEGORIES:
        per = [c[cat] for c in sim.cpu_by_round[after] if c.get(cat) is not None]
        cpu_rows.append(
            [
                cat,
                sim.cpu_before_row0.get(cat),
                sim.cpu_by_round[0].get(cat),
                _mean(per) if per else None,
                sim.cpu_total.get(cat),
            ]
        )
    cpu_rows.append(
        [
            "**all simulation processes**",
            sum(sim.cpu_before_row0.values()),
            sim_cpu[0],
            _mean(sim_cpu[after]),
            sum(sim.cpu_total.values()),
        ]
    )
    cpu_rows.append(["loop (this process)", None, loop_cpu[0], _mean(loop_cpu[after]), None])
    print(f"### CPU time by process (seconds; {os.cpu_count()} cores)")
    print()
    print(
        md_table(
            [
                "process",
                "SuperLink start -> round 0 row",
                "round 1",
                f"per round 2..{sizes.rounds}",
                "whole run",
            ],
            cpu_rows,
        )
    )
    print()

    result = {
        "overhead_ratio_after_warmup": round(ratio, 4),
        "first_round_startup_s": round(startup, 3),
        "sim_round_s": round(sim_mean, 3),
        "loop_round_s": round(loop_mean, 3),
        "rounds": sizes.rounds,
        "clients": sizes.clients,
        "target_ratio": TARGET_RATIO,
        "target_met": bool(ratio <= TARGET_RATIO),
        "sim_round_s_by_round": [round(x, 3) for x in sim_rounds],
        "loop_round_s_by_round": [round(x, 3) for x in loop_rounds],
        "cpu_ratio_after_warmup": round(cpu_ratio, 4),
        "serverapp_start_to_round0_s": round(row0, 3),
        "launch_to_serverapp_s": None
        if sim.launch_to_serverapp_s is None
        else round(sim.launch_to_serverapp_s, 3),
        "launch_to_round1_end_s": round(launch_to_r1, 3),
        "launcher_wall_s": round(sim.launcher_wall_s, 3),
        "loop_setup_s": round(loop_setup, 3),
        "ideal_parallel_round_s": None if ideal_parallel is None else round(ideal_parallel, 3),
        "sim_over_ideal_parallel": None if ideal_ratio is None else round(ideal_ratio, 4),
        "loop_client_threads": loop.client_threads,
        "foreign_load_cores_sim": None if sim_foreign is None else round(sim_foreign, 2),
        "foreign_load_cores_loop": round(loop_foreign, 2),
    }
    return result
