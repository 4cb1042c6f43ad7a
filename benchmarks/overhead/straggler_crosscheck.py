"""Stragglers on real SuperNodes beside the virtual clock's prediction, in one run.

    python -m benchmarks.overhead.straggler_crosscheck           # MiniLM, movie sentiment
    python -m benchmarks.overhead.straggler_crosscheck --quick   # tiny BERT (smoke, minutes)
    python -m benchmarks.overhead.straggler_crosscheck --out lab/evidence/straggler-crosscheck

1. ``deployment``: a SuperLink and N SuperNodes on loopback (no TLS), a quarter of them
   (partitions 0, 4, ...) stragglers by their own node-config ``delay-seconds`` (a fixed
   wait before each reply, not a multiple of the measured training time); each SuperNode
   and the ClientApp processes it starts pinned to a core of its own where the machine has
   more cores than nodes (else unpinned, and said so). The same FLoRG work twice, on the
   wall clock: ``sync`` (R rounds of all N nodes) and ``async`` (buffer b, N/4 by default,
   N in flight, N R / b updates): N R client updates applied in each, after a round that fills
   the nodes' disk cache.
2. The node costs the deployment showed, from the sync run's rows: compute seconds per
   training example (``client-train-seconds`` over the task's examples) and the rest of a
   round, the per-message overhead (a ClientApp process starting, its imports and model,
   Flower's polls, the messages): a round's wall time (its evaluation and aggregation left
   out) minus the delay minus its slowest training, half of it per message as ``latency``.
3. ``virtual``: the same two runs in the simulation under ``virtual-clock`` with those
   costs (``node-seconds-per-example``, ``node-latency``, loopback bandwidth) and
   ``slow-delay`` for the same partitions: the clock's prediction.

Reported: each run's time (wall: the ServerApp's ``elapsed-seconds`` less evaluation and
aggregation; virtual: ``virtual-seconds``) and async over sync, measured beside predicted,
with the overhead apart. The load average and cores are printed: on a machine with fewer
cores than nodes the nodes share them, which the clock (each node its own hardware) does
not model. The last line is one JSON object; ``--out DIR`` keeps the four runs (config,
rows) and writes the table to DIR/report.md and the object to DIR/result.json. docs/async.md,
"The deployment cross-check".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import REPO_ROOT

RUN_NAMES = ("sync", "async")
LOOPBACK_MBPS = 10_000.0  # the clock's bandwidth for loopback: messages cost ~nothing


def run_settings(
    nodes: int, rounds: int, buffer: int, output_dir: Path, quick: bool
) -> dict[str, dict[str, Any]]:
    """The sync and async run configs: every setting that matters pinned, matched work
    (``buffer`` divides nodes x rounds)."""
    if (nodes * rounds) % buffer:
        raise ValueError(f"--buffer {buffer} must divide nodes x rounds = {nodes * rounds}")
    slow = ",".join(str(p) for p in range(0, nodes, 4))
    base = {
        "method": "florg", "model": "all-MiniLM-L6-v2", "task": "movie-sentiment",
        "target-modules": "query,value", "rank": 4, "alpha": 16.0, "seed": 0,
        "partitioner": "iid", "learning-rate": 5e-4, "head-learning-rate": 2.5e-4,
        "fraction-train": 1.0, "min-train-nodes": nodes, "min-available-nodes": nodes,
        # validation only at 0 and the last 3 rows: an evaluation holds the loop's dispatch,
        # which the clock does not model (its seconds are left out of the wall time too)
        "client-eval": "off", "eval-every": 0, "max-eval-examples": 100,
        "max-train-examples": 100 * nodes, "max-test-examples": 0, "local-steps": 15,
        "batch-size": 8,
        "max-seq-length": 64 if quick else 128, "aggregation-weights": "uniform",
        "device": "cpu", "progress-bar": False, "output-dir": str(output_dir),
        "slow-partitions": slow,
    }  # fmt: skip
    return {
        "sync": {**base, "run-name": "sync", "round-mode": "sync", "num-server-rounds": rounds},
        "async": {
            **base,
            "run-name": "async",
            "round-mode": "async",
            "async-concurrency": nodes,
            "async-buffer-size": buffer,
            "num-server-rounds": nodes * rounds // buffer,
        },  # fmt: skip
    }


def rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def training_seconds(table: Sequence[dict[str, Any]]) -> list[float]:
    """Each update's or round's wall seconds less its evaluation and aggregation (what the
    virtual clock counts: the tasks)."""
    out = []
    for before, row in zip(table, table[1:], strict=False):
        spent = row["elapsed-seconds"] - before["elapsed-seconds"]
        out.append(spent - row.get("eval-seconds", 0.0) - row.get("agg-seconds", 0.0))
    return out


def fitted_costs(sync_rows: Sequence[dict[str, Any]], delay: float, examples: int) -> dict:
    """The node costs of a deployed sync run (module docstring, step 2): seconds per
    example from the mean training time, and per-message latency from what a round took
    beyond its slowest training and the stragglers' delay (the median over the rounds)."""
    trained = sync_rows[1:]
    per_example = statistics.mean(r["client-train-seconds"] for r in trained) / examples
    overhead = [
        max(spent - delay - row["client-train-seconds-max"], 0.0)
        for spent, row in zip(training_seconds(sync_rows), trained, strict=True)
    ]
    return {"seconds-per-example": per_example, "round-overhead": statistics.median(overhead),
            "latency": statistics.median(overhead) / 2}  # fmt: skip


def pin(process_pid: int, core: int | None) -> None:
    """Pin a SuperNode (and the ClientApp processes it starts later: they inherit it)."""
    if core is not None:
        os.sched_setaffinity(process_pid, {core})


def run_each(connection: str, flwr_home: Path, settings: dict[str, dict[str, Any]],
             side: str, timeout: float) -> None:  # fmt: skip
    """Run each config in turn on the federation ``connection``; a failed run stops it all."""
    from florg_tools.flwr_cli import run_flower_app

    for name, config in settings.items():
        outcome = run_flower_app(REPO_ROOT, connection, config, flwr_home, timeout, stream=None)
        if not outcome.ok:
            raise RuntimeError(f"{side} {name} failed: {outcome.message}\n"
                               f"{outcome.log_text[-3000:]}")  # fmt: skip
        print(f"[bench] {side} {name}: done", flush=True)


def deploy(settings: dict[str, dict[str, Any]], nodes: int, delay: float, work: Path,
           timeout: float) -> dict[str, Any]:  # fmt: skip
    """Both runs on one loopback deployment; the stragglers' delay is their node-config."""
    from florg_tools.deploy.deployment import Deployment, thread_env

    cores = sorted(os.sched_getaffinity(0))
    pinned = len(cores) > nodes  # a core each, one left for the SuperLink and ServerApp
    env = {**thread_env(1), "FLORG_DERIVED_CACHE": str(work / "derived-cache"),
           "FLORG_OUTPUT_ROOT": str(work)}  # the runs write under work  # fmt: skip
    with Deployment(work / "deployment", certs=None, extra_env=env) as dep:
        dep.start_superlink()
        for i in range(nodes):
            own = {"delay-seconds": delay} if i % 4 == 0 else None
            process = dep.start_supernode(i, nodes, wait=False, node_config=own)
            pin(process.pid, cores[1 + i] if pinned else None)
        dep.wait_registered()
        # a round first, unmeasured: it fills the nodes' disk cache (model, tokenised
        # partition), which would otherwise slow the first measured run's first round alone
        warmup = {**settings["sync"], "run-name": "warmup", "num-server-rounds": 1}
        # the deployment's stragglers are the nodes' own; the runs name none
        runs = {name: {**config, "slow-partitions": ""}
                for name, config in {"warmup": warmup, **settings}.items()}  # fmt: skip
        run_each(dep.connection, dep.flwr_home, runs, "deployed", timeout)
    return {"pinned": pinned, "cores": len(cores)}


def simulate(settings: dict[str, dict[str, Any]], nodes: int, work: Path,
             timeout: float) -> None:  # fmt: skip
    """Both runs in the simulation under the virtual clock."""
    from florg_tools.superlink import local_simulation_superlink

    with local_simulation_superlink(work / "superlink", num_supernodes=nodes,
                                    output_root=work) as sim:  # fmt: skip
        run_each(sim.connection, sim.flwr_home, settings, "virtual", timeout)


def quick_assets(work: Path) -> dict[str, Any]:
    from florg_tools.synthetic import make_sentiment_task, make_tiny_bert

    model = make_tiny_bert(work / "tiny-model")
    task = make_sentiment_task(work / "tiny-task")
    return {"model": str(model), "task": "local", "data-path": str(task),
            "text-fields": "sentence", "target-modules": "query,value"}  # fmt: skip


def report(measured: dict[str, float], predicted: dict[str, float], costs: dict,
           delay: float, setup: dict) -> tuple[list[str], dict[str, Any]]:  # fmt: skip
    """The table's lines and the JSON object."""
    ratio = {kind: times["async"] / times["sync"]
             for kind, times in (("measured", measured), ("predicted", predicted))}  # fmt: skip
    lines = ["| | sync (s) | async (s) | async / sync |", "|---|---|---|---|"]
    for kind, key, times in (("deployment, wall clock", "measured", measured),
                             ("virtual clock's prediction", "predicted", predicted)):  # fmt: skip
        lines.append(f"| {kind} | {times['sync']:.1f} | {times['async']:.1f} | "
                     f"{ratio[key]:.3f} |")  # fmt: skip
    pinned = "pinned, a core each" if setup["pinned"] else "unpinned (fewer cores than nodes)"
    lines += ["", f"Fitted from the deployed sync run: a round's overhead beyond training and "
              f"the delay (ClientApp start-up, Flower's polls, the messages) "
              f"{costs['round-overhead']:.2f} s, so latency {costs['latency']:.2f} s each "
              f"way; compute {costs['seconds-per-example'] * 1000:.2f} ms a training example. "
              f"Stragglers' delay {delay:g} s; {setup['nodes']} SuperNodes on "
              f"{setup['cores']} cores, {pinned}."]  # fmt: skip
    return lines, {"measured": measured, "predicted": predicted, "ratio": ratio,
                   "costs": costs, "delay": delay, **setup}  # fmt: skip


def keep_runs(work: Path, out: Path) -> None:
    """Each run's config, rows and summary under out/runs/<deployed|virtual>/<run>."""
    for side in ("deployed", "virtual"):
        for name in RUN_NAMES:
            dest = out / "runs" / side / name
            dest.mkdir(parents=True, exist_ok=True)
            for file in ("config.json", "metrics.jsonl", "summary.json"):
                if (work / side / name / file).exists():
                    shutil.copy2(work / side / name / file, dest / file)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=4, help="SuperNodes (a quarter slow)")
    parser.add_argument("--rounds", type=int, default=4, help="sync rounds (async: 2x updates)")
    parser.add_argument("--delay", type=float, default=20.0, help="stragglers' delay, seconds")
    parser.add_argument("--buffer", type=int, help="async replies an update (default N/4)")
    parser.add_argument("--quick", action="store_true", help="tiny BERT, 2 rounds")
    parser.add_argument("--timeout", type=float, default=1800.0, help="per run, seconds")
    parser.add_argument("--out", type=Path, help="keep the runs and write the report here")
    args = parser.parse_args(argv)
    if args.nodes < 2 or args.rounds < 1 or args.delay < 0:
        parser.error("--nodes >= 2, --rounds >= 1 and --delay >= 0")
    rounds = 2 if args.quick else args.rounds
    buffer = args.buffer or max(args.nodes // 4, 1)  # the stragglers' share of the nodes
    if not 1 <= buffer <= args.nodes or (args.nodes * rounds) % buffer:
        parser.error(f"--buffer in [1, nodes] dividing nodes x rounds ({args.nodes * rounds})")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    load_before = os.getloadavg()
    print(f"[bench] load average before: {load_before}", flush=True)
    with tempfile.TemporaryDirectory(prefix="straggler-crosscheck-") as tmp:
        work = Path(tmp)
        extra = quick_assets(work) if args.quick else {}
        deployed = {name: {**config, **extra} for name, config in
                    run_settings(args.nodes, rounds, buffer, work / "deployed",
                                 args.quick).items()}  # fmt: skip
        setup = deploy(deployed, args.nodes, args.delay, work, args.timeout)
        runs = {name: rows(work / "deployed" / name) for name in RUN_NAMES}
        measured = {name: sum(training_seconds(table)) for name, table in runs.items()}
        examples = deployed["sync"]["local-steps"] * deployed["sync"]["batch-size"]
        costs = fitted_costs(runs["sync"], args.delay, examples)
        clock = {"virtual-clock": True, "node-seconds-per-example": costs["seconds-per-example"],
                 "node-latency": costs["latency"], "node-bandwidth-mbps": LOOPBACK_MBPS,
                 "slow-delay": args.delay}  # fmt: skip
        virtual = {name: {**config, **clock, "output-dir": str(work / "virtual")}
                   for name, config in deployed.items()}  # fmt: skip
        simulate(virtual, args.nodes, work, args.timeout)
        predicted = {name: rows(work / "virtual" / name)[-1]["virtual-seconds"]
                     for name in RUN_NAMES}  # fmt: skip
        if args.out is not None:
            keep_runs(work, args.out)
    load_after = os.getloadavg()
    print(f"[bench] load average after: {load_after}", flush=True)
    setup["nodes"] = args.nodes
    lines, result = report(measured, predicted, costs, args.delay, setup)
    result["load-average"] = {"before": load_before, "after": load_after}
    print("\n".join(lines))
    if args.out is not None:
        command = "python -m benchmarks.overhead.straggler_crosscheck " + " ".join(
            argv if argv is not None else sys.argv[1:]
        )
        header = [f"Printed by `{command}` (load average before "
                  f"{load_before[0]:.2f}, after {load_after[0]:.2f}).", ""]  # fmt: skip
        (args.out / "report.md").write_text("\n".join(header + lines) + "\n")
        (args.out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
