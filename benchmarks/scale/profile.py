"""Where a simulated client's time goes: py-spy on the scale benchmark's ClientApp actors.

    python -m benchmarks.scale.profile record --cell 1000x50 --out DIR   # run and sample
    python -m benchmarks.scale.profile tree DIR/actor-*.raw               # print the tree

``record`` runs ``benchmarks.scale.scale_benchmark`` on one cell (4 rounds), waits for its
two ``ClientAppActor`` processes, lets round 1 pass (imports and the model load), then
samples each actor with ``py-spy record --idle --format raw`` for ``--seconds`` and writes
``actor-<pid>.raw`` into ``--out`` (py-spy must be installed: ``pip install py-spy``; it
attaches by pid, which needs ptrace rights: root, or ``kernel.yama.ptrace_scope`` 0).

``tree`` reads such raw files (one line per distinct stack: ``frame;frame;... count``) and
prints, as an indented list, the share of the samples inside the ClientApp's ``train``
spent in each callee, down to ``--depth`` levels and above ``--min-share``; and the share
of the actor's main thread that ``train`` takes (the rest is the actor waiting for its next
message). The shares are of wall time, idle samples included.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

ROOT_FRAME = "train (client_app/client_app.py)"  # the ClientApp's training handler
MAIN_LOOP = "Worker.main_loop"  # Ray's actor main thread
_SITE = re.compile(r" \(\S*site-packages/")
_LINE = re.compile(r":\d+\)$")


def frame_name(frame: str) -> str:
    """``func (path:line)`` without the line number and the site-packages prefix."""
    return _LINE.sub(")", _SITE.sub(" (", frame))


def read_stacks(paths: Iterable[Path]) -> list[tuple[list[str], int]]:
    """(frames from the outermost, sample count) of every line of py-spy raw files."""
    stacks = []
    for path in paths:
        for line in path.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if stack and count.isdigit():
                stacks.append(([frame_name(f) for f in stack.split(";")], int(count)))
    return stacks


def call_tree(
    stacks: list[tuple[list[str], int]], root: str = ROOT_FRAME
) -> tuple[dict[tuple[str, ...], int], int, int]:
    """Samples per call path below ``root`` (the path starts at ``root``), the samples
    inside ``root`` and the samples of the actors' main thread."""
    counts: dict[tuple[str, ...], int] = defaultdict(int)
    inside = main = 0
    for frames, count in stacks:
        if any(MAIN_LOOP in f for f in frames):
            main += count
        starts = [i for i, f in enumerate(frames) if f.startswith(root)]
        if not starts:
            continue
        inside += count
        path = tuple(frames[starts[0] :])
        for depth in range(1, len(path) + 1):
            counts[path[:depth]] += count
    return counts, inside, main


def tree_lines(
    counts: dict[tuple[str, ...], int], total: int, depth: int, min_share: float
) -> list[str]:
    """The tree below the root as ``share% frame`` lines, children by share, indented."""
    children: dict[tuple[str, ...], list[tuple[str, ...]]] = defaultdict(list)
    for path in counts:
        if len(path) > 1:
            children[path[:-1]].append(path)
    lines: list[str] = []

    def walk(path: tuple[str, ...], level: int) -> None:
        for child in sorted(children[path], key=lambda p: -counts[p]):
            share = counts[child] / total
            if share < min_share:
                continue
            lines.append(f"{'  ' * level}{100 * share:5.1f}% {child[-1]}")
            if level + 1 < depth:
                walk(child, level + 1)

    for root in [p for p in counts if len(p) == 1]:
        walk(root, 0)
    return lines


def record(cell: str, out: Path, seconds: int, warmup: int) -> int:
    """Run the cell and sample its two actors once round 1 is over."""
    out.mkdir(parents=True, exist_ok=True)
    before = set(_actor_pids())
    bench = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.scale.scale_benchmark", "--cells", cell,
         "--rounds", "4", "--out", str(out / "benchmark")],
        stdout=(out / "benchmark.log").open("w"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    actors: list[int] = []
    while len(actors) < 2 and bench.poll() is None:
        time.sleep(2)
        actors = sorted(set(_actor_pids()) - before)
    if len(actors) < 2:
        print(f"the benchmark ended before its actors started: {out / 'benchmark.log'}")
        return 1
    print(f"actors {actors}; round 1 ({warmup} s), then {seconds} s of samples", flush=True)
    time.sleep(warmup)
    spies = [
        subprocess.Popen(["py-spy", "record", "-p", str(pid), "-r", "20", "-d", str(seconds),
                          "--idle", "--format", "raw", "-o", str(out / f"actor-{pid}.raw")],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for pid in actors
    ]  # fmt: skip
    for spy in spies:
        spy.wait()
    bench.wait()
    print(f"written: {out}/actor-*.raw; python -m benchmarks.scale.profile tree {out}/actor-*.raw")
    return 0


def _actor_pids() -> list[int]:
    found = subprocess.run(["pgrep", "-f", "ray::ClientAppActor"], capture_output=True, text=True)
    return [int(p) for p in found.stdout.split()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="run one cell and sample its actors with py-spy")
    rec.add_argument("--cell", default="1000x50", help="NxK (default 1000x50)")
    rec.add_argument("--out", type=Path, required=True)
    rec.add_argument("--seconds", type=int, default=40, help="sampling time per actor")
    rec.add_argument("--warmup", type=int, default=60, help="seconds for round 1 to pass")
    tree = sub.add_parser("tree", help="print where train's time goes")
    tree.add_argument("raw", type=Path, nargs="+", help="py-spy raw files")
    tree.add_argument("--depth", type=int, default=6)
    tree.add_argument("--min-share", type=float, default=0.02)
    args = parser.parse_args(argv)
    if args.command == "record":
        return record(args.cell, args.out, args.seconds, args.warmup)
    counts, inside, main_thread = call_tree(read_stacks(args.raw))
    if not inside:
        print(f"no sample inside {ROOT_FRAME} in {[str(p) for p in args.raw]}")
        return 1
    if main_thread:
        print(f"train: {100 * inside / main_thread:.0f}% of the actors' main thread")
    print("\n".join(tree_lines(counts, inside, args.depth, args.min_share)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
