"""Is a homogeneous run unchanged? Run the same 2-round simulation (the end-to-end tests'
tiny BERT and sentiment task, 3 nodes, rank 2) from an older commit and from this
worktree, and compare their metrics.jsonl rows key for key (timings excluded; a key only one of them
records, a metric added or dropped since, is listed, not compared).

    python scripts/compare_homogeneous.py --base cf5cf7b --method florg

Used for issue 30 (clients of different rank): florg and fedit were bit-identical to
cf5cf7b. The older commit's code runs from a ``git archive`` copy (its config.json lacks
settings added since, which the script prints to show which code ran).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TIMINGS = ("wall", "seconds", "time")


def rows(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [
        {k: v for k, v in json.loads(line).items() if not any(t in k for t in TIMINGS)}
        for line in lines
    ]


def main() -> int:
    from florg_tools import synthetic
    from tests.harness.flower_harness import run_app_in_simulation

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the older commit")
    parser.add_argument("--method", default="florg")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="compare-") as tmp:
        work = Path(tmp)
        base = work / "base"
        base.mkdir()
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", args.base], check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(base)], input=archive, check=True)
        model = synthetic.make_tiny_bert(work / "model")
        task = synthetic.make_sentiment_task(work / "task")
        out = work / "outputs"  # inside the output root (the temporary folder's parent)
        results = {}
        for name, app in (("base", base), ("worktree", ROOT)):
            run_name = f"compare-{name}-{args.method}"
            config = {
                "model": str(model), "task": "local", "data-path": str(task),
                "text-fields": "sentence", "rank": 2, "num-server-rounds": 2,
                "min-available-nodes": 3, "batch-size": 16, "learning-rate": 0.005,
                "output-dir": str(out), "run-name": run_name, "max-test-examples": 40,
                "method": args.method,
            }  # fmt: skip
            outcome = run_app_in_simulation(app, config, num_supernodes=3, timeout=900)
            if not outcome.ok:
                print(outcome.log_text[-3000:])
                return 2
            settings = json.loads((out / run_name / "config.json").read_text())
            print(f"{name}: {len(settings)} settings in its config.json")
            results[name] = rows(out / run_name)
    base_rows, new_rows = results["base"], results["worktree"]
    added = sorted({k for r in new_rows for k in r} - {k for r in base_rows for k in r})
    removed = sorted({k for r in base_rows for k in r} - {k for r in new_rows for k in r})
    shared = [
        ({k: v for k, v in old.items() if k not in removed},
         {k: v for k, v in new.items() if k not in added})
        for old, new in zip(base_rows, new_rows, strict=False)
    ]  # fmt: skip
    same = len(base_rows) == len(new_rows) and all(old == new for old, new in shared)
    print(f"{args.method}: keys only the worktree records: {', '.join(added) or 'none'}")
    print(f"{args.method}: keys only the base records: {', '.join(removed) or 'none'}")
    print(f"{args.method}: metrics rows identical on every shared key (timings excluded): {same}")
    for old, new in shared:
        for key in sorted(set(old) | set(new)):
            if old.get(key) != new.get(key):
                print(f"  round {old.get('round')}: {key} {old.get(key)!r} -> {new.get(key)!r}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
