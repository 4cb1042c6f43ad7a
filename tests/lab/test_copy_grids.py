"""lab/scripts/fixed_worktree.sh's ``copy_grids``: the runs already published go into a fresh
worktree's results, wherever the grid publishes them (``PUBLISHED/runs/GRID``, or a report
folder's ``PUBLISHED/GRID/runs`` as the decoder check does), so a fresh machine does not
rerun them; a run the worktree already holds is left as it is."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def copy_grids(worktree: Path, published: Path, *grids: str) -> None:
    subprocess.run(
        [
            "bash",
            "-c",
            '. lab/scripts/fixed_worktree.sh; copy_grids "$@"',
            "copy-test",
            str(worktree),
            str(published),
            *grids,
        ],
        cwd=ROOT,
        check=True,
        env={"PATH": "/usr/bin:/bin"},
    )


def publish(folder: Path, text: str) -> None:
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(text)


def test_published_runs_reach_the_worktree_from_either_layout(tmp_path):
    worktree, published = tmp_path / "worktree", tmp_path / "published"
    (worktree / "conf" / "grids").mkdir(parents=True)
    publish(published / "runs" / "evidence-v2-exact" / "method=flora,seed=1", "grid layout")
    publish(published / "decoder-check" / "runs" / "method=fed-sb,seed=0", "report layout")
    # a run this worktree already holds (say, finished here before publishing) is kept
    publish(worktree / "results" / "decoder-check" / "runs" / "method=florg,seed=0", "mine")
    publish(published / "decoder-check" / "runs" / "method=florg,seed=0", "published")

    copy_grids(worktree, published, "decoder-check", "evidence-v2-exact")

    results = worktree / "results"
    assert (results / "evidence-v2-exact/runs/method=flora,seed=1/summary.json").read_text() == (
        "grid layout"
    )
    assert (results / "decoder-check/runs/method=fed-sb,seed=0/summary.json").read_text() == (
        "report layout"
    )
    assert (results / "decoder-check/runs/method=florg,seed=0/summary.json").read_text() == "mine"
    for grid in ("decoder-check", "evidence-v2-exact"):
        assert (worktree / "conf" / "grids" / f"{grid}.yaml").read_bytes() == (
            ROOT / "lab" / "grids" / f"{grid}.yaml"
        ).read_bytes()


def test_a_worktree_with_the_lab_reads_its_grids_from_lab_grids(tmp_path):
    """At a commit since the lab moved (lab/florg_lab), the runner reads lab/grids: the grid
    file goes there, not into a conf/grids the checkout does not have."""
    worktree, published = tmp_path / "worktree", tmp_path / "published"
    (worktree / "lab" / "florg_lab").mkdir(parents=True)
    (worktree / "lab" / "grids").mkdir()
    copy_grids(worktree, published, "async-stragglers")
    assert (worktree / "lab" / "grids" / "async-stragglers.yaml").read_bytes() == (
        ROOT / "lab" / "grids" / "async-stragglers.yaml"
    ).read_bytes()
    assert not (worktree / "conf").exists()


def test_the_grid_runner_is_the_checkouts_own(tmp_path):
    """A worktree at a commit from before the lab moved runs florg_tools.experiments; this
    checkout (and any later) runs florg_lab."""

    def runner(folder: Path) -> str:
        out = subprocess.run(
            ["bash", "-c", f'. "{ROOT}/lab/scripts/fixed_worktree.sh"; cd "$1"; grid_runner',
             "runner", str(folder)],
            check=True, capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"},
        )  # fmt: skip
        return out.stdout.strip()

    assert runner(ROOT) == "florg_lab"
    assert runner(tmp_path) == "florg_tools.experiments"
