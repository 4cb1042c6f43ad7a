"""Bit-for-bit behaviour check for refactors: a 2-round run of every method, compared.

    python -m ci.behaviour_snapshot run OUT [--assets DIR] [--only NAME ...]
    python -m ci.behaviour_snapshot compare BEFORE AFTER

``run`` runs each case below through the Flower simulation (``florg launch
--ephemeral-superlink``: a private SuperLink, Ray, 3 SuperNodes) on the tiny random BERT and
the synthetic sentiment task, and keeps each run's ``metrics.jsonl`` and
``adapter.safetensors`` in ``OUT/<case>/``. Central DP's noise, drawn from OS entropy by the
app, is seeded in these runs only (``ci/seeded_noise/sitecustomize.py``). The assets are built
once into ``--assets`` (default ``OUT/assets``) and should be shared between the two
snapshots compared, so that both read the very same files: build them at one commit, pass
the folder to the other.

``compare`` holds every case of AFTER to BEFORE: the metrics rows must be equal once the
wall-clock keys (and the keys given to ``--ignore``: those a change means to alter) are
dropped, and every array of the adapter equal bit for bit. It prints
one line per case and exits 1 on any difference (a case BEFORE's commit did not have yet
is listed as new).

Run it before a refactor (at the old commit, e.g. in a ``git worktree``) and after it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
NUM_NODES = 3
SEEDED_NOISE = Path(__file__).resolve().parent / "seeded_noise"  # its sitecustomize.py

# Every registered method (tests/tooling/test_behaviour_snapshot.py holds this list to the
# registry), plus clients of mixed rank, central DP (user level) for one mean-mechanism
# method and for FLoRG, DP-SGD on the clients (dp=example, its sampling and noise drawn
# from the round's seed), Poisson client sampling, asynchronous rounds and the lossy encodings.
CASES: dict[str, dict[str, object]] = {
    "florg": {"method": "florg"},
    "florg-no-procrustes": {"method": "florg-no-procrustes"},
    "florg-signed": {"method": "florg-signed"},
    "fedit": {"method": "fedit"},
    "federa": {"method": "federa"},
    "ffa-lora": {"method": "ffa-lora"},
    "fedsa-lora": {"method": "fedsa-lora"},
    "fedex-lora": {"method": "fedex-lora"},
    "hetlora": {"method": "hetlora", "client-ranks": "1,2,2"},
    "flexlora": {"method": "flexlora", "client-ranks": "1,2,2"},
    "rolora": {"method": "rolora"},
    "fedsvd": {"method": "fedsvd"},
    "flora": {"method": "flora"},  # its folds' resend and fresh LoRA by round
    "fed-sb": {"method": "fed-sb"},
    "fedrot-lora": {"method": "fedrot-lora"},
    "florg-ranks": {"method": "florg", "client-ranks": "1,2,2"},
    "fedit-dp": {"method": "fedit", "dp": "central", "dp-noise-multiplier": 0.5},
    "florg-dp": {"method": "florg", "dp": "central", "dp-noise-multiplier": 0.5},
    "florg-dp-sgd": {"method": "florg", "dp": "example", "dp-sgd-seeded-noise": "true"},
    "fedit-dp-sgd": {"method": "fedit", "dp": "example", "dp-sgd-seeded-noise": "true"},
    "fed-sb-dp-sgd": {"method": "fed-sb", "dp": "example", "dp-sgd-seeded-noise": "true"},
    # q = 1: the Poisson path (its sampler, q N as dp=central's divisor, its metrics) with
    # every node in. At q < 1 the sample is drawn over the simulation's node ids, which are
    # random per run, so which partitions train would differ between two runs of one commit.
    "florg-poisson": {"method": "florg", "client-sampling": "poisson", "fraction-train": 1.0},
    "fedit-poisson-dp": {"method": "fedit", "client-sampling": "poisson",
                         "fraction-train": 1.0, "dp": "central", "dp-noise-multiplier": 0.5},
    # The asynchronous loop with every node in flight and in the buffer: each update is the
    # synchronous round, so its rows do not depend on which reply arrives first.
    "florg-async": {"method": "florg", "round-mode": "async", "async-concurrency": NUM_NODES,
                    "async-buffer-size": NUM_NODES},
    "fedit-async": {"method": "fedit", "round-mode": "async", "async-concurrency": NUM_NODES,
                    "async-buffer-size": NUM_NODES},
    # The lossy message encodings, both directions (their rounding drawn from the run's seed).
    "florg-int8": {"method": "florg", "uplink-encoding": "int8", "downlink-encoding": "int8"},
    "fedit-int8": {"method": "fedit", "uplink-encoding": "int8", "downlink-encoding": "int8"},
    "rolora-bf16-fp16": {"method": "rolora", "uplink-encoding": "bf16",
                         "downlink-encoding": "fp16"},
    "florg-int4g-int8g": {"method": "florg", "uplink-encoding": "int4-g",
                          "downlink-encoding": "int8-g"},
    "fedit-int8g-int4g": {"method": "fedit", "uplink-encoding": "int8-g",
                          "downlink-encoding": "int4-g"},
}  # fmt: skip
# Keys of a metrics row that measure time or the machine, not the computation.
WALL_CLOCK_KEYS = ("time", "seconds", "wall", "duration", "elapsed", "-s", "timestamp")


def build_assets(folder: Path) -> tuple[Path, Path]:
    """The tiny BERT and the sentiment task, made once in ``folder``."""
    from florg_tools.synthetic import make_sentiment_task, make_tiny_bert

    model, task = folder / "model", folder / "task"
    if not (model / "config.json").exists():
        make_tiny_bert(model)
    if not (task / "train.jsonl").exists():
        make_sentiment_task(task)
    return model, task


def run_case(name: str, settings: dict[str, object], model: Path, task: Path, out: Path) -> None:
    config = {
        "model": str(model),
        "task": "local",
        "data-path": str(task),
        "text-fields": "sentence",
        "rank": 2,
        "num-server-rounds": 2,
        "min-available-nodes": NUM_NODES,
        "min-train-nodes": NUM_NODES,
        "batch-size": 16,
        "learning-rate": 0.005,
        "max-test-examples": 40,
        "output-dir": str(out / "runs"),
        "run-name": name,
        "tensorboard": "off",
        **settings,
    }
    sets = [arg for key, value in config.items() for arg in ("--set", f"{key}={value}")]
    env = {**os.environ, "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1"}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", FLORG_OUTPUT_ROOT=str(out))
    # dp=central draws its noise from OS entropy: seed it, in this check only
    env["PYTHONPATH"] = os.pathsep.join([str(SEEDED_NOISE), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "florg_tools.launch", "--app", str(ROOT),
           "--flwr-home", str(out / "flwr-home"), "--ephemeral-superlink", "--quiet",
           "--timeout", "900", *sets]  # fmt: skip
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{name}: the run failed ({result.returncode})\n{result.stderr[-3000:]}")
    run_dir = out / "runs" / name
    case = out / name
    case.mkdir(parents=True, exist_ok=True)
    for file in ("metrics.jsonl", "adapter.safetensors"):
        (case / file).write_bytes((run_dir / file).read_bytes())
    print(f"{name}: done", flush=True)


def is_wall_clock(key: str) -> bool:
    return any(part in key for part in WALL_CLOCK_KEYS)


def comparable_rows(path: Path, ignored: tuple[str, ...] = ()) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [
        {k: v for k, v in row.items() if not is_wall_clock(k) and k not in ignored} for row in rows
    ]


def compare_case(before: Path, after: Path, ignored: tuple[str, ...] = ()) -> list[str]:
    from safetensors.numpy import load_file

    problems = []
    rows_before, rows_after = (
        comparable_rows(p / "metrics.jsonl", ignored) for p in (before, after)
    )
    if rows_before != rows_after:
        for i, (a, b) in enumerate(zip(rows_before, rows_after, strict=False)):
            keys = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
            if keys:
                problems.append(f"metrics row {i} differs in {keys[:8]}")
        if len(rows_before) != len(rows_after):
            problems.append(f"{len(rows_before)} rows before, {len(rows_after)} after")
    arrays_before = load_file(str(before / "adapter.safetensors"))
    arrays_after = load_file(str(after / "adapter.safetensors"))
    if arrays_before.keys() != arrays_after.keys():
        problems.append("the adapter's array names differ")
    for key in sorted(arrays_before.keys() & arrays_after.keys()):
        a, b = arrays_before[key], arrays_after[key]
        if a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes():
            diff = np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))
            problems.append(f"adapter array {key} differs (max |diff| {diff:.3g})")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run")
    run.add_argument("out", type=Path)
    run.add_argument("--assets", type=Path, default=None)
    run.add_argument("--only", nargs="*", default=None)
    compare = sub.add_parser("compare")
    compare.add_argument("before", type=Path)
    compare.add_argument("after", type=Path)
    compare.add_argument(
        "--ignore", nargs="*", default=[], help="metrics keys a change meant to alter"
    )
    compare.add_argument("--only", nargs="*", default=None, help="compare these cases only")
    args = parser.parse_args(argv)
    if args.command == "run":
        out = args.out.resolve()
        model, task = build_assets((args.assets or out / "assets").resolve())
        # a Flower home whose simulation connection has NUM_NODES SuperNodes, one CPU each
        subprocess.run(
            [sys.executable, "-m", "florg_tools.flwr_home", "setup", "--flwr-home",
             str(out / "flwr-home"), "--num-supernodes", str(NUM_NODES), "--num-cpus", "1"],
            cwd=ROOT, check=True, capture_output=True,
        )  # fmt: skip
        for name, settings in CASES.items():
            if args.only is None or name in args.only:
                run_case(name, settings, model, task, out)
        return 0
    failed = 0
    for name in CASES if args.only is None else args.only:
        before, after = args.before / name, args.after / name
        if not (after / "metrics.jsonl").exists():
            print(f"{name}: MISSING in after")
            failed += 1
            continue
        if not (before / "metrics.jsonl").exists():  # a case newer than BEFORE's commit
            print(f"{name}: new, not in before (nothing to compare)")
            continue
        problems = compare_case(before, after, tuple(args.ignore))
        print(f"{name}: {'identical' if not problems else 'DIFFERS: ' + '; '.join(problems)}")
        failed += bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
