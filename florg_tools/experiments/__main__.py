"""Command line for experiment grids.

    python -m florg_tools.experiments run GRID [--out DIR] [--only TEXT ...] [--max-runs N]
    python -m florg_tools.experiments report GRID [--out DIR]
    python -m florg_tools.experiments list GRID
    python -m florg_tools.experiments evidence GRID [--with GRID[=DIR] ...] \
        [--centralised FILE ...] [--publish DIR]

GRID is a YAML file or the name of one in conf/grids/. ``run`` runs the unfinished runs
through the Flower simulation engine (finished ones are skipped, so it resumes) and then
writes the report; ``report`` only aggregates: ``results.csv``, ``results.md`` and
``plots/*.png`` in the grid's folder (default ``results/<grid name>``); ``evidence``
writes the evidence report of a tuned, seeded grid (``florg_tools.experiments.evidence``:
``evidence.md``, ``evidence/summary.json``, paired intervals, verdicts, plots).
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from florg_tools.experiments.aggregate import collect, markdown_report, write_csv
from florg_tools.experiments.evidence import write_evidence
from florg_tools.experiments.grid import Grid, GridError, load_grid
from florg_tools.experiments.plots import write_plots
from florg_tools.experiments.runner import run_grid
from florg_tools.experiments.runs import is_finished, run_dir
from florg_tools.experiments.tuning import load_candidates, load_choices

DEFAULT_RESULTS = Path(__file__).resolve().parents[2] / "results"


def write_report(grid: Grid, out: Path) -> Path:
    """Aggregate the finished runs under ``out``; returns the markdown report's path."""
    results, missing = collect(grid, out)
    write_csv(results, grid, out / "results.csv")
    plots = write_plots(grid, results, out) if results else []
    report = out / "results.md"
    report.write_text(markdown_report(grid, results, missing, plots, out) + "\n")
    return report


def publish(grid: Grid, out: Path, target: Path) -> Path:
    """Copy the report, the CSV, the plots and each finished run's config, metrics and
    summary (not its weights or logs) to ``target``, e.g. docs/results/<grid>."""
    target.mkdir(parents=True, exist_ok=True)
    for name in ("results.md", "results.csv"):
        shutil.copy2(out / name, target / name)
    if (out / "plots").is_dir():
        shutil.copytree(out / "plots", target / "plots", dirs_exist_ok=True)
    for run in grid.runs:
        folder = run_dir(out, run)
        if is_finished(folder, run):
            dest = target / "runs" / run.run_id
            dest.mkdir(parents=True, exist_ok=True)
            for name in ("config.json", "metrics.jsonl", "summary.json"):
                shutil.copy2(folder / name, dest / name)
    return target


def publish_evidence(
    grid: Grid,
    out: Path,
    target: Path,
    ablations: list[tuple[Grid, Path]],
    centralised_files: Sequence[Path] = (),
) -> Path:
    """Copy the evidence report (evidence.md as README.md, summary.json, tuning.json,
    centralised.json, the seeded centralised references, the evidence plots) and every
    finished run's config, metrics and summary (the main grid's and the ablations') to
    ``target``."""
    target.mkdir(parents=True, exist_ok=True)
    for path in centralised_files:
        if path.resolve().parent != target:
            shutil.copy2(path, target / path.name)
    shutil.copy2(out / "evidence.md", target / "README.md")
    shutil.copy2(out / "evidence" / "summary.json", target / "summary.json")
    for source_grid, source_out in [(grid, out), *ablations]:
        for name in ("tuning.json", "centralised.json"):
            if (source_out / name).is_file():
                shutil.copy2(source_out / name, target / f"{source_grid.name}-{name}")
    (target / "plots").mkdir(exist_ok=True)
    for plot in (out / "plots").glob("evidence_*.png"):
        shutil.copy2(plot, target / "plots" / plot.name)
    for source_grid, source_out in [(grid, out), *ablations]:
        for run in source_grid.runs:
            folder = run_dir(source_out, run)
            if is_finished(folder, run):
                dest = target / "runs" / source_grid.name / run.run_id
                dest.mkdir(parents=True, exist_ok=True)
                for name in ("config.json", "metrics.jsonl", "summary.json"):
                    shutil.copy2(folder / name, dest / name)
                _publish_final_arrays(folder, dest)
    return target


def _publish_final_arrays(folder: Path, dest: Path) -> None:
    """The last checkpoint's global arrays (adapter and head, 80-160 kB for MiniLM), so the
    published run can be probed (florg_tools/experiments/probe.py) without re-running it."""
    rounds = sorted(folder.glob("checkpoint/round-*/arrays.safetensors"))
    if rounds:
        relative = rounds[-1].relative_to(folder)
        (dest / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(rounds[-1], dest / relative)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m florg_tools.experiments")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (
        ("run", "run the grid's unfinished runs, then write the report"),
        ("report", "aggregate finished runs into results.csv, results.md and plots"),
        ("list", "print the grid's runs and whether each is finished"),
        ("evidence", "the evidence report: test scores, paired intervals, verdicts"),
    ):
        cmd = sub.add_parser(name, help=help_text)
        cmd.add_argument("grid", help="grid YAML file, or a name in conf/grids/")
        cmd.add_argument(
            "--out", type=Path, default=None, help="grid folder (default: results/<grid name>)"
        )
        if name == "run":
            cmd.add_argument(
                "--only",
                nargs="*",
                default=None,
                metavar="TEXT",
                help="run only runs whose id contains one of these",
            )
            cmd.add_argument(
                "--max-runs",
                type=int,
                default=None,
                help="stop after this many runs (the rest resume later)",
            )
            cmd.add_argument("--no-report", action="store_true", help="skip the report")
        if name == "evidence":
            cmd.add_argument(
                "--with",
                dest="others",
                nargs="*",
                default=[],
                metavar="GRID[=DIR]",
                help="more grids whose runs join the report (other tasks, ablations, a "
                "method run at another commit), read from DIR (default: results/<name>)",
            )
            cmd.add_argument(
                "--centralised",
                type=Path,
                action="append",
                default=[],
                metavar="FILE",
                help="a seeded centralised reference (the JSON of "
                "benchmarks.centralised.centralised_reference); its tasks replace the grid "
                "folders' centralised.json",
            )
        if name in ("run", "report", "evidence"):
            cmd.add_argument(
                "--publish",
                type=Path,
                default=None,
                metavar="DIR",
                help="also copy the report, plots and per-run metrics to DIR (e.g. "
                "docs/results/<grid>)",
            )
    return parser


def _interrupt_on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # run the same clean-up as Ctrl-C: stop the run and the SuperLink


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt_on_sigterm)
    try:
        grid = load_grid(args.grid)
    except GridError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    out = (args.out or DEFAULT_RESULTS / grid.name).resolve()
    if grid.tuning is not None:
        grid = load_grid(grid.path, load_choices(out), load_candidates(out))
    if args.command == "list":
        for run in grid.runs:
            done = is_finished(run_dir(out, run), run)
            print(f"{'done' if done else 'todo'}  {run.run_id}  [{'+'.join(run.blocks)}]")
        for combo in grid.pending_combos:
            print(f"wait  {combo}: its grid runs follow its tuning runs")
        return 0
    if args.command == "evidence":
        ablations = []
        for spec in args.others:
            name, _, folder = spec.partition("=")
            other = load_grid(name)
            other_out = (Path(folder) if folder else DEFAULT_RESULTS / other.name).resolve()
            if other.tuning is not None:
                other = load_grid(other.path, load_choices(other_out), load_candidates(other_out))
            ablations.append((other, other_out))
        missing = [str(p) for p in args.centralised if not p.is_file()]
        if missing:
            print(f"error: --centralised: no such file: {', '.join(missing)}", file=sys.stderr)
            return 2
        report = write_evidence(grid, out, ablations, args.centralised)
        print(f"[grid {grid.name}] evidence: {report}")
        if args.publish is not None:
            target = publish_evidence(
                grid, out, args.publish.resolve(), ablations, args.centralised
            )
            print(f"[grid {grid.name}] published to {target}")
        return 0
    code = 0
    if args.command == "run":
        t0 = time.monotonic()
        outcome = run_grid(grid, out, only=args.only, max_runs=args.max_runs)
        print(
            f"[grid {grid.name}] {len(outcome.finished)} finished, {len(outcome.skipped)} "
            f"skipped, {len(outcome.failed)} failed in {(time.monotonic() - t0) / 60:.1f} min"
        )
        for run_id, message in outcome.failed.items():
            print(f"  failed: {run_id}: {message}", file=sys.stderr)
        code = 0 if outcome.ok else 1
        if args.no_report:
            return code
    report = write_report(grid, out)
    print(f"[grid {grid.name}] report: {report}")
    if args.publish is not None:
        print(f"[grid {grid.name}] published to {publish(grid, out, args.publish.resolve())}")
    return code


if __name__ == "__main__":
    sys.exit(main())
