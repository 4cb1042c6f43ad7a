"""The local-training sweep's report (lab/florg_lab/local_steps.py) on synthetic run folders
whose numbers are known: the cells' intervals, the error keys (one recorded, one not), the
paired differences, the markdown, the figure, the pinned rates; and the paper-regime
grid and the sweep load with the runs their headers count."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from florg_lab import local_steps
from florg_lab.grid import load_grid
from florg_lab.stats import mean_interval, paired_difference

SPLITS = {15: 32, 48: 10, 160: 3}  # local steps a round -> rounds (480 steps in all)


def write_run(root: Path, method: str, steps: int, seed: int, test: float, error=None, lr=0.002):
    """A finished run: its final test score ``test``, and per training round the method's
    error key at ``error(round)`` when given (else the rows lack the key)."""
    rounds = SPLITS[steps]
    folder = root / f"learning-rate={lr},local-steps={steps},method={method},seed={seed}"
    folder.mkdir(parents=True)
    config = {"method": method, "local-steps": steps, "num-server-rounds": rounds,
              "seed": seed, "learning-rate": lr, "task": "snli"}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    rows = [{"round": 0, "test-score": 0.33}]
    for t in range(1, rounds + 1):
        row = {"round": t, "test-score": test if t == rounds else 0.4}
        if error is not None:
            row[local_steps.error_key(method)] = error(t)
        rows.append(row)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {"status": "finished", "final-test-score": test}
    (folder / "summary.json").write_text(json.dumps(summary))


def florg_score(steps: int, seed: int) -> float:
    return 0.5 + 0.001 * steps + 0.01 * seed


def fedit_score(steps: int, seed: int) -> float:
    return 0.6 - 0.0005 * steps + 0.02 * seed


@pytest.fixture
def runs(tmp_path: Path) -> Path:
    root = tmp_path / "runs"
    for steps in SPLITS:
        for seed in range(3):
            # FLoRG records gram_rel_error: 0.1 x seed + 0.001 x round
            write_run(root, "florg", steps, seed, florg_score(steps, seed),
                      error=lambda t, s=seed: 0.1 * s + 0.001 * t)  # fmt: skip
            # FedIT records product_rel_gap, growing with the steps a round
            write_run(root, "fedit", steps, seed, fedit_score(steps, seed),
                      error=lambda t, st=steps, s=seed: st / 1000 + 0.01 * s)  # fmt: skip
            # FedRot-LoRA: no row records its key (the diagnostic is not yet there)
            write_run(root, "fedrot-lora", steps, seed, 0.55 + 0.01 * seed)
    # an unfinished run and a run at another rate with fewer seeds are not counted
    write_run(root, "fedit", 15, 7, 0.9, lr=0.004)
    unfinished = root / "learning-rate=0.002,local-steps=15,method=florg,seed=9"
    unfinished.mkdir()
    (unfinished / "summary.json").write_text(json.dumps({"status": "failed"}))
    return root


def test_cells_hold_the_known_intervals(runs: Path):
    table = local_steps.cells(local_steps.load_runs(runs))
    by_key = {(c.method, c.steps): c for c in table}
    assert set(by_key) == {(m, s) for m in ("florg", "fedit", "fedrot-lora") for s in SPLITS}
    for steps, rounds in SPLITS.items():
        florg = by_key["florg", steps]
        assert (florg.rounds, florg.seeds, florg.learning_rate) == (rounds, (0, 1, 2), 0.002)
        assert florg.test == mean_interval([florg_score(steps, s) for s in range(3)])
        # the mean over training rounds 1..R of 0.1 s + 0.001 t
        expected = [0.1 * s + 0.001 * (rounds + 1) / 2 for s in range(3)]
        assert florg.error.mean == pytest.approx(mean_interval(expected).mean)
        assert florg.error.low == pytest.approx(mean_interval(expected).low)
        fedit = by_key["fedit", steps]
        assert fedit.learning_rate == 0.002 and fedit.seeds == (0, 1, 2)  # not the 4e-3 run
        assert fedit.error.mean == pytest.approx(steps / 1000 + 0.01)
        assert fedit.error_key == "product_rel_gap"
        assert by_key["fedrot-lora", steps].error is None


def test_paired_differences_and_markdown(runs: Path):
    loaded = local_steps.load_runs(runs)
    table = local_steps.cells(loaded)
    paired = local_steps.paired_rows(loaded, table, "florg")
    assert [(s, m) for s, m, _ in paired] == [
        (15, "fedit"), (48, "fedit"), (160, "fedit"),
        (15, "fedrot-lora"), (48, "fedrot-lora"), (160, "fedrot-lora"),
    ]  # fmt: skip
    at_160 = dict(((s, m), p) for s, m, p in paired)[160, "fedit"]
    expected = paired_difference(
        [florg_score(160, s) for s in range(3)], [fedit_score(160, s) for s in range(3)]
    )
    assert at_160 == expected
    text = local_steps.markdown(table, paired, "florg")
    assert "No run of fedrot-lora records `product_rel_gap`" in text
    assert "No run of fedit" not in text and "No run of florg" not in text
    assert "| fedrot-lora | 160 | 3 | 0.002 | 3 |" in text
    assert "| 160 | fedit |" in text


def test_missing_key_named_when_no_run_records_it(tmp_path: Path):
    for seed in range(2):
        write_run(tmp_path, "fedrot-lora", 15, seed, 0.5 + 0.1 * seed)
    table = local_steps.cells(local_steps.load_runs(tmp_path))
    text = local_steps.markdown(table, [], "florg")
    assert "No run of fedrot-lora records `product_rel_gap` (its aggregation error)." in text
    assert "| fedrot-lora | 15 | 32 | 0.002 | 2 | 0.5500 [" in text


def test_main_writes_plot_and_json(runs: Path, tmp_path: Path, capsys):
    figure, numbers = tmp_path / "sweep.png", tmp_path / "sweep.json"
    assert local_steps.main([str(runs), "--plot", str(figure), "--json", str(numbers)]) == 0
    assert figure.stat().st_size > 0
    document = json.loads(numbers.read_text())
    assert len(document["cells"]) == 9 and len(document["paired"]) == 6
    assert "| florg | 15 | 32 |" in capsys.readouterr().out


def test_rates_from_tuning_json(tmp_path: Path, capsys):
    tuning = tmp_path / "tuning.json"
    choices = {"method=florg,task=snli": 0.001, "method=fedrot-lora,task=snli": 3.125e-05}
    tuning.write_text(json.dumps({"key": "learning-rate", "choices": choices}))
    assert local_steps.main(["--rates", str(tuning)]) == 0
    # plain decimals, which YAML reads back as floats
    assert capsys.readouterr().out.splitlines() == ["fedrot-lora 0.00003125", "florg 0.001"]


def test_the_paper_regime_grid_and_the_sweep_load():
    paper = load_grid("paper-regime-snli")
    assert paper.tuning is not None and paper.tuning.extend == 2
    assert paper.num_supernodes == 20 and paper.base["batch-size"] == 4
    assert paper.base["local-steps"] == 0 and paper.base["local-epochs"] == 1
    # 6 methods x 3 tuning values at seed 0, then 4 more seeds each (before extensions)
    assert paper.expected_runs == 6 * (3 + 4)
    sweep = load_grid("local-steps-sweep")
    assert len(sweep.runs) == 3 * 3 * 5
    for run in sweep.runs:  # equal client compute: 480 local steps in every run
        assert run.setting("local-steps") * run.setting("num-server-rounds") == 480
    # every method has one CHOSEN-RATE line per split for the runner to pin
    text = sweep.path.read_text()
    for method in ("florg", "fedit", "fedrot-lora"):
        assert text.count(f"  # CHOSEN-RATE {method}\n") == 3
