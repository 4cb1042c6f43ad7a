"""Deployment overhead: the same FLoRG run through the simulation engine and through a real
SuperLink + SuperNodes (TLS on loopback), per-round wall time side by side, in one run.

    python -m benchmarks.overhead.deployment_overhead          # MiniLM + SNLI, 2 clients, 3 rounds
    python -m benchmarks.overhead.deployment_overhead --rounds 4
    python -m benchmarks.overhead.deployment_overhead --quick  # tiny random BERT, 2 rounds (smoke)

Sizes (default): model all-MiniLM-L6-v2, task snli, 2 clients (IID), 600 training / 200
validation examples, batch 16, max length 128, 3 rounds, 1 local epoch -- the settings of
``benchmarks.overhead.simulation_overhead`` (both import them from
``benchmarks.overhead.settings``, so both pin the same values).

Modes, run one after another in this process:

1. ``simulation``: a private ``flower-superlink --simulation`` (``florg_tools.superlink``),
   one Ray actor per client with 1 CPU (Ray sets its ``OMP_NUM_THREADS=1``); an actor lives
   through the run, so it loads the model and tokenises its partition once.
2. ``deployment``: ``florg_tools.deploy.deployment.Deployment`` -- a TLS SuperLink and one
   SuperNode per client on loopback (``OMP/OPENBLAS/MKL_NUM_THREADS=1`` per node, like the
   actors), with the on-disk cache (``flower_app.cache.disk``) in a fresh folder. A SuperNode
   starts a fresh ``flwr-clientapp`` process for every message: imports, model, data again.
3. ``deployment-no-cache``: the same with ``FLORG_DISK_CACHE=0``: every ClientApp process
   rebuilds the model (FLoRG's L/R QRs included) and re-tokenises its partition.

Per-round times are the ServerApp's own clock (``elapsed-seconds`` of ``metrics.jsonl``),
so they exclude submission and start-up; the headline is the mean over rounds 2..R (round
1 also carries cache misses and Ray's actor start) of each deployment mode over the
simulation. The machine is shared: the load average before and after is printed. The last
line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import REPO_ROOT
from benchmarks.overhead.settings import RUN_NAME, Sizes, run_settings

MODES = ("simulation", "deployment", "deployment-no-cache")


def _rounds(run_dir: Path) -> list[float]:
    """Wall seconds of rounds 1..R from the ServerApp's metrics.jsonl."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    elapsed = [float(r["elapsed-seconds"]) for r in rows]
    return [b - a for a, b in zip(elapsed, elapsed[1:], strict=False)]


def _quick_assets(work: Path) -> dict[str, Any]:
    from florg_tools.synthetic import make_sentiment_task, make_tiny_bert

    model = make_tiny_bert(work / "tiny-model")
    task = make_sentiment_task(work / "tiny-task")
    return {"model": str(model), "task": "local", "data-path": str(task), "text-fields": "sentence"}


def run_simulation(settings: dict[str, Any], sizes: Sizes, work: Path, timeout: float) -> Any:
    from florg_tools.flwr_cli import run_flower_app
    from florg_tools.superlink import local_simulation_superlink

    with local_simulation_superlink(
        work / "superlink", num_supernodes=sizes.clients, num_cpus_per_client=1
    ) as sim:
        return run_flower_app(
            REPO_ROOT, sim.connection, settings, sim.flwr_home, timeout, stream=None
        )


def run_deployment(
    settings: dict[str, Any], sizes: Sizes, work: Path, timeout: float, cache: bool
) -> Any:
    from florg_tools.deploy.certs import generate_certificates
    from florg_tools.deploy.deployment import Deployment, thread_env
    from florg_tools.flwr_cli import run_flower_app

    env = {
        **thread_env(1),
        "FLORG_DERIVED_CACHE": str(work / "derived-cache"),
        "FLORG_DISK_CACHE": "1" if cache else "0",
        "FLORG_OUTPUT_ROOT": str(work),  # runs write under work/outputs
    }
    certs = generate_certificates(work / "certs")
    with Deployment(work / "deployment", certs=certs, extra_env=env) as dep:
        dep.start_superlink()
        for i in range(sizes.clients):
            dep.start_supernode(i, sizes.clients, wait=False)
        dep.wait_registered()
        return run_flower_app(
            REPO_ROOT, dep.connection, settings, dep.flwr_home, timeout, stream=None
        )


_STARTUP_PROBE = """
import json, resource, sys, time
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
t0 = time.perf_counter()
import client_app.client_app, peft, transformers.models.bert.modeling_bert
from flower_app.settings.config import resolve_config
from flower_app.cache.per_process import cached_adapted_model
from flower_app.task_data import load_task_data, tokenized_split
c0 = cpu()
config = resolve_config({}, json.loads(sys.argv[1]))
data = load_task_data(config)
c1 = cpu()
cached_adapted_model(config, data.num_labels, data.spec.kind)
c2 = cpu()
tokenized_split(config, "train", 0, int(sys.argv[2]))
c3 = cpu()
print(json.dumps({"imports": c0, "task-data": c1 - c0, "model": c2 - c1,
                  "tokenised-partition": c3 - c2, "wall": time.perf_counter() - t0}))
"""


def startup_breakdown(settings: dict[str, Any], clients: int, work: Path) -> dict[str, Any]:
    """CPU seconds of what every fresh ClientApp process does before training, in a new
    interpreter (1 thread, as the deployment's nodes): imports, then model and tokenised
    partition -- cold (cache miss, stored), warm (cache hit) and with the cache off."""
    import subprocess

    out: dict[str, Any] = {}
    cases = (("cold", "1"), ("warm", "1"), ("no-cache", "0"))
    for name, enabled in cases:
        env = {**os.environ, "FLORG_DERIVED_CACHE": str(work / "startup-cache"),
               "FLORG_DISK_CACHE": enabled, "OMP_NUM_THREADS": "1",
               "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # fmt: skip
        keep = {k: v for k, v in settings.items() if k not in ("output-dir", "run-name")}
        proc = subprocess.run(
            [sys.executable, "-c", _STARTUP_PROBE, json.dumps(keep), str(clients)],
            cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=True,
        )  # fmt: skip
        out[name] = {k: round(v, 2) for k, v in json.loads(proc.stdout.splitlines()[-1]).items()}
        print(f"[bench] ClientApp start-up, {name}: {out[name]} (CPU s; wall s)", flush=True)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 rounds")
    parser.add_argument(
        "--modes", default=",".join(MODES), help="comma-separated subset ('' for none)"
    )
    parser.add_argument("--timeout", type=float, default=1800.0, help="per mode, seconds")
    parser.add_argument(
        "--no-startup", action="store_true", help="skip the ClientApp start-up breakdown"
    )
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if unknown := sorted(set(modes) - set(MODES)):
        parser.error(f"unknown mode(s) {unknown}; choose from {MODES}")
    rounds = 2 if args.quick else args.rounds
    if rounds < 2:
        parser.error("--rounds must be >= 2 (round 1 is reported apart)")
    sizes = Sizes(rounds, args.clients, 600, 200, 16, 128)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    print(f"[bench] sizes: {sizes}{' (quick: tiny BERT)' if args.quick else ''}", flush=True)
    print(f"[bench] load average before: {os.getloadavg()}", flush=True)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="deploy-bench-") as tmp:
        work = Path(tmp)
        extra = _quick_assets(work) if args.quick else {}
        for mode in modes:
            mwork = work / mode
            mwork.mkdir()
            settings = {**run_settings(sizes, mwork / "outputs"), **extra}
            # A fresh derived cache per mode (the SuperLinks and their apps inherit it).
            os.environ["FLORG_DERIVED_CACHE"] = str(mwork / "derived-cache")
            t0 = time.perf_counter()
            if mode == "simulation":
                outcome = run_simulation(settings, sizes, mwork, args.timeout)
            else:
                cache = mode == "deployment"
                outcome = run_deployment(settings, sizes, mwork, args.timeout, cache)
            wall = time.perf_counter() - t0
            if not outcome.ok:
                print(f"[bench] {mode} FAILED: {outcome.message}", flush=True)
                return 1
            per_round = _rounds(mwork / "outputs" / RUN_NAME)
            results[mode] = {
                "round-seconds": [round(x, 2) for x in per_round],
                "round-1": round(per_round[0], 2),
                "steady-mean": round(statistics.mean(per_round[1:]), 2),
                "total-wall": round(wall, 1),
            }
            print(f"[bench] {mode}: {results[mode]}", flush=True)
        if not args.no_startup:
            settings = {**run_settings(sizes, work / "startup"), **extra}
            results["clientapp-startup"] = startup_breakdown(settings, sizes.clients, work)
    print(f"[bench] load average after: {os.getloadavg()}", flush=True)
    startup = results.pop("clientapp-startup", None)
    base = results.get("simulation", {}).get("steady-mean")
    print("\n| mode | round 1 (s) | rounds 2..R mean (s) | / simulation | whole run (s) |")
    print("|---|---|---|---|---|")
    for mode, r in results.items():
        ratio = f"{r['steady-mean'] / base:.2f}" if base else "-"
        r["ratio-vs-simulation"] = None if not base else round(r["steady-mean"] / base, 3)
        print(f"| {mode} | {r['round-1']} | {r['steady-mean']} | {ratio} | {r['total-wall']} |")
    if startup:
        print("\n| ClientApp process start-up (CPU s) | imports | model | tokenised partition |")
        print("|---|---|---|---|")
        for name, r in startup.items():
            print(f"| {name} | {r['imports']} | {r['model']} | {r['tokenised-partition']} |")
    summary = {"sizes": sizes.__dict__, "quick": args.quick, "results": results}
    print(json.dumps({**summary, "clientapp-startup": startup}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
