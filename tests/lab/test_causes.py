"""The cause measurements of issue 27 (lab/florg_lab/causes.py): the reachable
fraction of an update in FLoRG's PSD set, ΔW⁰'s share, the FedAvg gap rows, the head-lr
contrast; and ``final_updates`` on a real checkpoint of a tiny model."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from florg_lab.causes import (
    _folders,
    fedavg_gap_rows,
    final_updates,
    head_lr_report,
    init_share,
    init_share_rows,
    reachable_fraction,
    reachable_rows,
)
from flower_app.adapters.florg.projections import make_projections
from flower_app.cache.per_process import cached_adapted_model
from flower_app.run_output.checkpoint import save_checkpoint
from flower_app.settings.config import resolve_config

L, R = make_projections(9, 7, seed=3, name="x")  # 9 x 7 and 7 x 7: k = 7
rng = np.random.default_rng(0)


def _psd(k: int) -> np.ndarray:
    X = rng.standard_normal((k, 3))
    return X @ X.T


def test_a_florg_update_is_wholly_reachable_and_its_negative_not_at_all():
    P = _psd(7)
    reached, total = reachable_fraction(L @ P @ R, L, R)
    assert reached == pytest.approx(total, rel=1e-12)
    reached, total = reachable_fraction(-(L @ P @ R), L, R)
    assert reached == pytest.approx(0.0, abs=1e-12) and total > 0


def test_an_antisymmetric_core_or_an_update_outside_the_frame_is_unreachable():
    X = rng.standard_normal((7, 7))
    reached, _ = reachable_fraction(L @ (X - X.T) @ R, L, R)
    assert reached == pytest.approx(0.0, abs=1e-12)
    outside = rng.standard_normal((9, 7))
    outside -= L @ (L.T @ outside)  # orthogonal to L's columns
    reached, total = reachable_fraction(outside, L, R)
    assert reached == pytest.approx(0.0, abs=1e-10) and total > 1


def test_a_random_square_matrix_is_about_a_quarter_reachable():
    Ls, Rs = make_projections(120, 120, seed=1, name="sq")
    reached = total = 0.0
    for _ in range(5):
        a, b = reachable_fraction(rng.standard_normal((120, 120)), Ls, Rs)
        reached, total = reached + a, total + b
    assert reached / total == pytest.approx(0.25, abs=0.02)


def test_init_share_of_twice_the_start_is_all_of_it():
    delta0 = L @ _psd(7) @ R
    inner, norm0, norm = init_share(2 * delta0, delta0)
    coef = inner / norm0
    assert coef == pytest.approx(2.0) and coef**2 * norm0 / norm == pytest.approx(1.0)


def _write_run(folder, config, arrays, rows=()):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config.as_dict()))
    (folder / "summary.json").write_text(json.dumps({"status": "finished"}))
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    save_checkpoint(folder, 3, arrays, {}, {"lineage": "0" * 32})


@pytest.mark.parametrize("subtract_init", [False, True])
def test_final_updates_and_init_share_from_a_checkpoint(
    tmp_path, tiny_bert_dir, sentiment_task_dir, subtract_init
):
    settings = {"model": str(tiny_bert_dir), "task": "local", "data-path": str(sentiment_task_dir),
                "text-fields": "sentence", "rank": 2, "max-train-examples": 32,
                "max-eval-examples": 8, "subtract-init": subtract_init}  # fmt: skip
    config = resolve_config({}, settings)
    adapted = cached_adapted_model(config, 2)
    state = adapted.shared_state()
    final = {k: (2 * v if k.endswith(".A") else v) for k, v in state.items()}  # A -> 2 A0
    run = tmp_path / "runs" / "florg-run"
    _write_run(run, config, final, rows=[
        {"round": 1, "fedavg_gap_procrustes": 0.2, "fedavg_gap_truncate": 0.4},
        {"round": 2, "fedavg_gap_procrustes": 0.4, "fedavg_gap_truncate": 0.6},
    ])  # fmt: skip
    _, updates = final_updates(run)
    assert updates
    modules = dict(adapted.model.named_modules())
    for name, (delta, _, delta0) in updates.items():
        with torch.no_grad():
            start = modules[name].delta_weight().double().numpy()  # this model holds A0
        # A = 2 A0: ΔW = 4 ΔW⁰ over the original W0, or 3 ΔW⁰ when W0 - ΔW⁰ is frozen
        np.testing.assert_allclose(delta, (3 if subtract_init else 4) * start, atol=1e-6)
        np.testing.assert_allclose(delta0, 0 * start if subtract_init else start, atol=1e-7)
    (row,) = init_share_rows([run])
    if subtract_init:
        assert row["coef"] == 0.0 and row["share"] == 0.0
    else:
        assert row["coef"] == pytest.approx(4.0, rel=1e-5)
        assert row["share"] == pytest.approx(1.0, rel=1e-5)
    (row,) = reachable_rows([run])
    assert row["semi-orthogonal"] == pytest.approx(1.0, rel=1e-6) or subtract_init
    assert 0.0 <= row["svd"] <= 1.0 and 0.1 < row["random semi-orthogonal"] < 0.5
    (gap,) = fedavg_gap_rows([run])
    assert gap["procrustes"] == pytest.approx(0.3) and gap["truncate"] == pytest.approx(0.5)
    assert _folders([tmp_path / "runs"]) == [run]


def test_a_run_without_checkpoint_is_skipped_with_the_command_to_rerun(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"method": "florg"}))
    (run / "summary.json").write_text(json.dumps({"status": "finished"}))
    (row,) = reachable_rows([run])
    assert "no checkpoint" in row["skipped"] and "florg_lab run" in row["skipped"]


def _finished(root, name, method, lr, seed, score):
    folder = root / name
    folder.mkdir(parents=True)
    config = {"method": method, "learning-rate": lr, "seed": seed}
    (folder / "config.json").write_text(json.dumps(config))
    summary = {"status": "finished", "final-test-score": score}
    (folder / "summary.json").write_text(json.dumps(summary))


def test_head_lr_contrast_pairs_the_gaps_by_seed(tmp_path):
    v1, v2 = tmp_path / "v1", tmp_path / "v2"
    for seed, (a1, b1, a2, b2) in enumerate([(0.6, 0.7, 0.7, 0.72), (0.5, 0.7, 0.66, 0.7)]):
        _finished(v1, f"f{seed}", "florg", 1e-3, seed, a1)
        _finished(v1, f"i{seed}", "fedit", 2e-3, seed, b1)
        _finished(v2, f"f{seed}", "florg", 2e-3, seed, a2)
        _finished(v2, f"i{seed}", "fedit", 2e-3, seed, b2)
    _finished(v1, "tuning", "florg", 5e-4, 0, 0.1)  # a tuning run at another rate: ignored
    lines = head_lr_report([v1], [v2], ["method=florg", "method=fedit"])
    assert "v1: -0.1500" in lines[1] and "v2: -0.0300" in lines[2]
    assert "0.1200" in lines[3]  # the gap shrinks by 0.12 on both seeds
