"""Simulation overhead: R rounds of FLoRG through the real Flower simulation engine versus the
same local training + aggregation + server evaluation in a plain Python loop, in one run.

    python -m benchmarks.overhead.simulation_overhead            # 4 rounds, 2 clients
    python -m benchmarks.overhead.simulation_overhead --rounds 6 --clients 2
    python -m benchmarks.overhead.simulation_overhead --quick    # 2 rounds, tiny sizes (smoke)

(a) Simulation.  A private ``flower-superlink --simulation`` on a free port
    (``florg_tools.superlink.local_simulation_superlink``: N supernodes, 1 CPU each, stopped
    by PID with every process it spawned), and one FLoRG run submitted with
    ``florg_tools.flwr_cli.run_flower_app`` (model all-MiniLM-L6-v2, task snli, IID partitions,
    600 training / 200 validation examples, batch 16, progress bar off, outputs in a temp
    dir).  Per-round times come from the run's ``metrics.jsonl`` (``elapsed-seconds``, taken
    by the ServerApp's RunRecorder, whose clock starts after the ServerApp has loaded the
    data and the model; row 0 is the initial evaluation).  A monitor thread in this process
    polls the run folder every 50 ms, so the ServerApp's start (``config.json`` appears)
    and every row are also placed on this process's clock, relative to the launch; it also
    samples the CPU time (utime + stime, ``benchmarks.overhead.monitor``) of every process
    of the simulation (SuperLink, SuperExec, ``flwr-simulation`` = ServerApp + Ray driver,
    Ray services, the ClientApp actors) and of the ``flwr`` CLI children of the launcher,
    at every row.
(b) Loop.  The same work in this process with the app's own modules: ``load_task_data``,
    ``cached_adapted_model``, per client the ClientApp's round
    (``flower_app.client.round.train_round``: its partition, seeds and training settings),
    the ServerApp's strategy (``Method.build_strategy`` from the same settings) aggregating
    the checked replies (``AdapterStrategy.aggregate_replies``: screening, the method's rule,
    FedAvg of the head), and the ServerApp's evaluation of the global model on the
    validation split.

Parallelism.  The simulation trains the clients IN PARALLEL, one Ray actor per client with
1 CPU; Ray sets ``OMP_NUM_THREADS`` to the actor's CPUs (1) inside each actor when it
starts (``ray._private.utils.set_omp_num_threads_if_unset``), so every actor's torch uses
1 thread, while the ServerApp (the ``flwr-simulation`` process, Ray's driver) evaluates
with torch's default thread count.  The loop trains its clients ONE AFTER ANOTHER, each
with ``--loop-threads`` torch threads (default 1, what an actor gets), and evaluates with
the default thread count like the ServerApp.  On 2 cores the simulation therefore has up
to 2x the loop's training throughput; the report also gives the round time of an ideal,
overhead-free parallel run (per round: slowest client of the loop + aggregation +
evaluation) and the simulation's time over it.  A calibration step trains client 0 once
more with the other thread count (torch's default), to show what intra-op threads are
worth here: on a 2-core machine shared with other work, 2 OpenMP threads per process can
be several times SLOWER than 1 (threads wait for each other at every barrier while one of
them is descheduled).

Headline: overhead ratio = mean simulation round time / mean loop round time over rounds
2..R (round 1 carries the actors' start-up: imports, model load, tokenisation), target
<= 1.3; first-round start-up = (launch -> end of round 1 in the simulation) - loop round 1.
The machine is shared, so wall times move with foreign load; CPU times (this process's
``time.process_time`` for the loop, the sum over the simulation's processes for (a)) are
printed next to them, and so is the other work on the machine during every round (the
machine's busy CPU time from ``/proc/stat`` minus ours, in cores).  The last printed line
is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.overhead.loop import LoopResult, run_loop
from benchmarks.overhead.report import report
from benchmarks.overhead.settings import Sizes
from benchmarks.overhead.sim import SimResult, run_simulation


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=None, help="rounds R (default 4; quick 2)")
    parser.add_argument("--clients", type=int, default=2, help="supernodes N (default 2)")
    parser.add_argument("--quick", action="store_true", help="2 rounds, tiny sizes")
    parser.add_argument("--max-train-examples", type=int, default=None)
    parser.add_argument("--max-eval-examples", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=1800.0, help="simulation run timeout")
    parser.add_argument("--loop-first", action="store_true", help="run the loop before the sim")
    parser.add_argument(
        "--loop-threads",
        type=int,
        default=1,
        help="torch threads per client in the loop (default 1 = a Ray actor's; 0 = torch's "
        "default)",
    )
    parser.add_argument(
        "--no-calibration",
        action="store_true",
        help="skip training client 0 with the other thread count",
    )
    parser.add_argument(
        "--workdir", type=Path, default=None, help="keep run outputs and logs here (default: temp)"
    )
    args = parser.parse_args(argv)
    if args.rounds is None:
        args.rounds = 2 if args.quick else 4
    if args.rounds < 2:
        parser.error("--rounds must be >= 2 (rounds 2..R are the after-warm-up rounds)")
    if args.clients < 1:
        parser.error("--clients must be >= 1")
    if args.loop_threads < 0:
        parser.error("--loop-threads must be >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    # Models and data come from the fetched offline assets (as in scripts/test.sh).
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    sizes = Sizes(
        rounds=args.rounds,
        clients=args.clients,
        max_train=args.max_train_examples or (64 if args.quick else 600),
        max_eval=args.max_eval_examples or (32 if args.quick else 200),
        batch_size=args.batch_size,
        max_seq_length=64 if args.quick else 128,
    )
    with contextlib.ExitStack() as stack:
        if args.workdir is not None:
            work = args.workdir.expanduser().resolve()
            work.mkdir(parents=True, exist_ok=True)
        else:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="sim-overhead-")))
        print(f"[bench] {sizes}; work dir {work}", flush=True)

        def do_sim() -> SimResult:
            print("[bench] simulation ...", flush=True)
            t = time.perf_counter()
            sim = run_simulation(sizes, work / "sim", args.timeout)
            print(f"[bench] simulation done in {time.perf_counter() - t:.1f}s", flush=True)
            return sim

        def do_loop() -> LoopResult:
            print("[bench] plain loop ...", flush=True)
            return run_loop(
                sizes, work / "loop", args.loop_threads, calibrate=not args.no_calibration
            )

        if args.loop_first:
            loop = do_loop()
            sim = do_sim()
        else:
            sim = do_sim()
            loop = do_loop()

    ignore = {"output-dir", "run-name"}
    differ = sorted(
        k for k in loop.config if k not in ignore and sim.config.get(k) != loop.config[k]
    )
    if differ:
        print(f"[bench] WARNING: the two sides' settings differ: {differ}", flush=True)
    result = report(sim, loop, sizes)
    result["settings_identical"] = not differ
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
