"""benchmarks.centralised.centralised_reference: the centralised reference follows the grids'
protocol (rate chosen on the mean validation score of the last three evaluations at the
first seed, ties to the smaller rate; every seed at the chosen rate; mean and 95% t
interval of the test scores), resumes from the runs it recorded, and its AdamW restarts
never straddle an evaluation."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks.centralised import centralised_reference as reference
from benchmarks.centralised.training import chunk_schedule


def test_restarts_every_15_steps_and_evaluates_every_60():
    schedule = chunk_schedule(steps=120, eval_every=60, restart_every=15)
    assert [chunk for chunk, _ in schedule] == [15] * 8
    assert [scored for _, scored in schedule] == [False, False, False, True] * 2


def test_a_chunk_never_crosses_an_evaluation_and_the_last_step_is_scored():
    schedule = chunk_schedule(steps=13, eval_every=4, restart_every=3)
    assert schedule == [
        (3, False), (1, True), (3, False), (1, True), (3, False), (1, True), (1, True),
    ]  # fmt: skip
    assert sum(chunk for chunk, _ in schedule) == 13


def test_selection_averages_the_last_three_evaluations_and_ignores_step_zero():
    points = [[0, 0.9, 1.0], [60, 0.40, 1.0], [120, 0.50, 1.0], [180, 0.60, 1.0],
              [240, 0.70, 1.0]]  # fmt: skip
    assert reference.selection_score(points) == pytest.approx((0.5 + 0.6 + 0.7) / 3)
    assert reference.selection_score(points[:3]) == pytest.approx((0.4 + 0.5) / 2)


def test_the_best_validation_rate_wins_and_ties_go_to_the_smaller_rate():
    assert reference.choose_rate({5e-4: 0.50, 1e-3: 0.62, 2e-3: 0.61}) == 1e-3
    assert reference.choose_rate({2e-3: 0.60, 5e-4: 0.60, 1e-3: 0.55}) == 5e-4


def _args(**overrides):
    argv = ["--task", "snli", "--json", "unused.json", "--learning-rates", "1e-3,2e-3",
            "--seeds", "0,1,2"]  # fmt: skip
    args = reference.parse_args(argv)
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def _run(test: float, selection: float = 0.0) -> dict:
    return {"selection-score": selection, "test": test, "validation": []}


def test_summary_tunes_on_seed_zero_and_reports_the_chosen_rates_seeds():
    args = _args()
    key = reference.run_key
    runs = {
        key("fedit", 1e-3, 0): _run(0.60, selection=0.62),
        key("fedit", 2e-3, 0): _run(0.70, selection=0.61),  # better test, worse validation
        key("fedit", 1e-3, 1): _run(0.64),
        key("fedit", 1e-3, 2): _run(0.62),
        key("fedit", 2e-3, 1): _run(0.99),  # not the chosen rate: never used
        key("florg", 1e-3, 0): _run(0.50, selection=0.40),
        key("florg", 2e-3, 0): _run(0.52, selection=0.45),
        key("florg", 2e-3, 1): _run(0.54),
        key("florg", 2e-3, 2): _run(0.56),
    }
    entry = {"settings": {}, "runs": runs}
    reference.summarise(entry, args)
    fedit = entry["methods"]["fedit"]
    assert fedit["learning-rate"] == 1e-3
    assert fedit["test"] == [0.60, 0.64, 0.62]
    # mean 0.62, sd 0.02, t_{0.975, 2} = 4.302653: half-width 4.302653 * 0.02 / sqrt(3)
    half = 4.302653 * 0.02 / 3**0.5
    assert fedit["test-score"] == pytest.approx(0.62)
    assert fedit["test-interval"] == pytest.approx([0.62 - half, 0.62 + half], abs=1e-6)
    assert entry["methods"]["florg"]["learning-rate"] == 2e-3
    assert entry["methods"]["florg"]["test"] == [0.52, 0.54, 0.56]
    # FLoRG − FedIT per seed: -0.08, -0.10, -0.06; mean -0.08, sd 0.02
    paired = entry["methods"]["florg"]["minus-fedit"]
    assert paired["mean"] == pytest.approx(-0.08)
    assert paired["interval"] == pytest.approx([-0.08 - half, -0.08 + half], abs=1e-6)
    assert (paired["wins"], paired["seeds"]) == (0, 3)
    assert "minus-fedit" not in fedit
    assert entry["reference-method"] == "fedit"
    assert entry["test-score"] == pytest.approx(0.62)
    assert entry["test-interval"] == fedit["test-interval"]


def test_one_seed_gives_no_interval_but_a_json_null():
    args = _args(seeds=[0], learning_rates=[1e-3], methods=["fedit"])
    entry = {"runs": {reference.run_key("fedit", 1e-3, 0): _run(0.6, 0.6)}}
    reference.summarise(entry, args)
    assert entry["test-interval"] == [None, None]
    json.dumps(entry, allow_nan=False)


def test_recorded_runs_are_reused_only_under_the_same_settings(tmp_path: Path):
    path = tmp_path / "reference.json"
    settings = {"steps": 600, "eval-every": 60}
    entry = reference.load_task_entry(path, "snli", settings)
    assert entry == {"settings": settings, "runs": {}}
    entry["runs"]["method=fedit,lr=0.001,seed=0"] = _run(0.6, 0.6)
    reference.save_task_entry(path, "snli", entry)
    reference.save_task_entry(path, "movie-sentiment", {"settings": {}, "runs": {}})
    again = reference.load_task_entry(path, "snli", dict(settings))
    assert list(again["runs"]) == ["method=fedit,lr=0.001,seed=0"]
    assert reference.load_task_entry(path, "snli", {**settings, "steps": 300})["runs"] == {}
    assert set(json.loads(path.read_text())["tasks"]) == {"snli", "movie-sentiment"}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--reference", "ffa-lora"], "is not among --methods"),
        (["--seeds", "0,0"], "repeats a seed"),
        (["--steps", "60", "--eval-every", "30"], "3 evaluations"),
        (["--max-test-examples", "0"], "must be >= 1"),
        (["--restart-every", "0"], "must be >= 1"),
    ],
)
def test_bad_arguments_are_refused_with_a_reason(argv, message, capsys):
    with pytest.raises(SystemExit):
        reference.parse_args(["--json", "x.json", *argv])
    assert message in capsys.readouterr().err


def test_a_small_real_run_tunes_seeds_and_resumes(tmp_path: Path, capsys):
    """MiniLM on movie sentiment, 6 steps per run: 2 rates at seed 0, then seed 1."""
    path = tmp_path / "reference.json"
    argv = ["--task", "movie-sentiment", "--methods", "fedit", "--steps", "6",
            "--eval-every", "2", "--restart-every", "1", "--max-train-examples", "32",
            "--max-eval-examples", "16", "--max-test-examples", "16",
            "--learning-rates", "1e-3,2e-3", "--seeds", "0,1", "--json", str(path)]  # fmt: skip
    assert reference.main(argv) == 0
    task = json.loads(path.read_text())["tasks"]["movie-sentiment"]
    assert set(task["runs"]) == {
        "method=fedit,lr=0.001,seed=0", "method=fedit,lr=0.002,seed=0",
        f"method=fedit,lr={task['methods']['fedit']['learning-rate']:g},seed=1",
    }  # fmt: skip
    for run in task["runs"].values():
        assert [step for step, _, _ in run["validation"]] == [0, 2, 4, 6]
        assert 0.0 <= run["test"] <= 1.0
    capsys.readouterr()
    assert reference.main(argv) == 0  # resumes: nothing left to train
    out = capsys.readouterr().out
    assert "3 runs already in" in out and "test score" not in out


def test_one_seed_and_one_rate_is_a_single_run_per_method():
    """The single-run case (once ``centralized_baseline.py``): no file, no tuning budget
    needed, and the reference is FedIT when it runs, else the first method."""
    args = reference.parse_args(["--seeds", "0", "--learning-rates", "1e-3", "--steps", "30",
                                 "--eval-every", "30", "--methods", "florg,ffa-lora"])  # fmt: skip
    assert args.json is None and args.reference == "florg"
    assert reference.parse_args(["--methods", "florg,fedit"]).reference == "fedit"
    assert reference.load_task_entry(None, "snli", {"steps": 30}) == {
        "settings": {"steps": 30}, "runs": {},
    }  # fmt: skip
    reference.save_task_entry(None, "snli", {"settings": {}, "runs": {}})  # writes nothing


def test_a_single_run_prints_its_curve_and_writes_no_file(tmp_path: Path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["--task", "movie-sentiment", "--methods", "florg", "--steps", "4",
            "--eval-every", "2", "--max-train-examples", "32", "--max-eval-examples", "16",
            "--max-test-examples", "16", "--learning-rates", "1e-3", "--seeds", "0"]  # fmt: skip
    assert reference.main(argv) == 0
    out = capsys.readouterr().out
    assert "| florg | 0.001 | " in out and "step 0 | step 2 | step 4" in out
    assert "writing no file" in out and "written to" not in out
    assert list(tmp_path.iterdir()) == []


def test_a_causal_lm_reference_scores_held_out_generation(tmp_path: Path, capsys):
    """The tiny decoder on a labelled task as generation (task-kind causal-lm through --set,
    the label as a word, as snli-gen): validation and test are scored as the ServerApp
    scores them (score = gen-F1 / 100, loss = the response-token cross-entropy), and the
    --set settings key the file's runs."""
    from florg_tools.synthetic import make_sentiment_task, make_tiny_causal_lm

    model = make_tiny_causal_lm(tmp_path / "model")
    task = make_sentiment_task(tmp_path / "task")
    names = ["bad", "good"]  # the label as a word needs label names: string labels
    for split in task.glob("*.jsonl"):
        rows = [json.loads(line) for line in split.read_text().splitlines()]
        split.write_text(
            "".join(json.dumps({**r, "label": names[r["label"]]}) + "\n" for r in rows)
        )
    path = tmp_path / "reference.json"
    sets = {"data-path": str(task), "task-kind": "causal-lm", "text-fields": "sentence",
            "max-seq-length": 32, "max-new-tokens": 2}  # fmt: skip
    argv = ["--model", str(model), "--task", "local", "--methods", "fedit,florg",
            "--steps", "2", "--eval-every", "2", "--restart-every", "2", "--batch-size", "4",
            "--max-train-examples", "16", "--max-eval-examples", "6", "--max-test-examples",
            "5", "--learning-rates", "1e-2", "--seeds", "0", "--rank", "2",
            "--json", str(path)]  # fmt: skip
    for key, value in sets.items():
        argv += ["--set", f"{key}={value}"]
    assert reference.main(argv) == 0
    entry = json.loads(path.read_text())["tasks"]["local"]
    assert entry["settings"]["set"] == dict(sorted(sets.items()))
    assert set(entry["runs"]) == {"method=fedit,lr=0.01,seed=0", "method=florg,lr=0.01,seed=0"}
    for run in entry["runs"].values():
        assert [step for step, _, _ in run["validation"]] == [0, 2]
        for _, score, loss in run["validation"]:
            assert 0.0 <= score <= 1.0 and math.isfinite(loss) and loss > 0
        assert 0.0 <= run["test"] <= 1.0
    assert "test score" in capsys.readouterr().out
    # a key that is not a run setting is refused before anything trains
    assert reference.main([*argv, "--set", "no-such-key=1"]) == 2


def test_the_head_benchmarks_refuse_a_task_kind_without_a_classification_head(tmp_path: Path):
    """head_learning_rate and adapter_growth measure the classification head: they ask
    centralised_data for that kind and a causal-LM task is refused with the kind named."""
    from benchmarks.centralised.training import centralised_data
    from florg_tools.synthetic import make_generative_qa_task, make_tiny_causal_lm
    from flower_app.settings.config import resolve_config

    config = resolve_config({}, {
        "model": str(make_tiny_causal_lm(tmp_path / "model")), "task": "local",
        "data-path": str(make_generative_qa_task(tmp_path / "task")),
        "task-kind": "causal-lm", "text-fields": "question,context", "label-field": "answers",
        "max-seq-length": 48,
    })  # fmt: skip
    with pytest.raises(ValueError, match="task kind 'causal-lm': only classification here"):
        centralised_data(config, kinds=("classification",))
    data, _, held_out = centralised_data(config)  # every kind without the restriction
    assert data.spec.kind == "causal-lm" and held_out.split == "eval"
