"""benchmarks.scale.profile's reading of py-spy raw files (the recording needs py-spy and a
running simulation: run by hand, see the module)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.scale.profile import call_tree, frame_name, read_stacks, tree_lines

ACTOR = "<module> (ray/default_worker.py:1);Worker.main_loop (ray/_private/worker.py:2)"
TRAIN = "train (client_app/client_app.py:90)"


def test_the_tree_shares_train_time_by_callee(tmp_path: Path) -> None:
    raw = tmp_path / "actor-1.raw"
    site = "/x/.venv/lib/python3.11/site-packages/"
    raw.write_text(
        f"{ACTOR};{TRAIN};train_round (flower_app/client/round.py:5);"
        f"train_steps (flower_app/client/round.py:9) 6\n"
        f"{ACTOR};{TRAIN};train_round (flower_app/client/round.py:5);"
        f"Dataset.map ({site}datasets/arrow_dataset.py:77) 3\n"
        f"{ACTOR};{TRAIN};Message.reply (flwr/app.py:3) 1\n"
        f"{ACTOR};Event.wait (threading.py:600) 10\n"
        "Thread.run (threading.py:1) 5\n"
    )
    stacks = read_stacks([raw])
    assert frame_name(f"f ({site}torch/x.py:12)") == "f (torch/x.py)"
    counts, inside, main = call_tree(stacks)
    assert (inside, main) == (10, 20)  # train is half the actor's main thread
    lines = tree_lines(counts, inside, depth=3, min_share=0.15)
    assert lines == [
        " 90.0% train_round (flower_app/client/round.py)",
        "   60.0% train_steps (flower_app/client/round.py)",
        "   30.0% Dataset.map (datasets/arrow_dataset.py)",
    ]  # Message.reply's 10% is below min_share
    assert tree_lines(counts, inside, depth=1, min_share=0.0) == [
        " 90.0% train_round (flower_app/client/round.py)",
        " 10.0% Message.reply (flwr/app.py)",
    ]
