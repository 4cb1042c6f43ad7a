"""The refactor check (ci/behaviour_snapshot.py) covers every registered method, and its
comparison catches a changed metric or adapter array."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from ci.behaviour_snapshot import CASES, compare_case
from flower_app.methods.registry import method_names


def test_every_registered_method_is_a_case():
    covered = {settings["method"] for settings in CASES.values()}
    assert set(method_names()) <= covered, set(method_names()) - covered


def test_the_snapshot_covers_ranks_privacy_and_sampling():
    settings = list(CASES.values())
    assert any("client-ranks" in s for s in settings)
    assert {s.get("dp") for s in settings} >= {"central", "example"}
    assert any(s.get("client-sampling") == "poisson" for s in settings)


def _case(folder: Path, accuracy: float, array: np.ndarray) -> Path:
    folder.mkdir(parents=True)
    rows = [{"round": 1, "accuracy": accuracy, "elapsed-seconds": accuracy * 7}]
    (folder / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    save_file({"layer.A": array}, str(folder / "adapter.safetensors"))
    return folder


def test_compare_ignores_the_clock_and_catches_a_changed_number(tmp_path):
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    before = _case(tmp_path / "before", 0.5, a)
    assert compare_case(before, _case(tmp_path / "same", 0.5, a.copy())) == []
    assert compare_case(before, _case(tmp_path / "metric", 0.6, a)) != []
    b = a.copy()
    b[0, 0] = np.nextafter(b[0, 0], np.float32(1))
    assert compare_case(before, _case(tmp_path / "array", 0.5, b)) != []


def test_the_snapshot_covers_async_rounds_and_every_lossy_encoding():
    from flower_app.wire.encoding import LOSSY

    settings = list(CASES.values())
    assert any(s.get("round-mode") == "async" for s in settings)
    sent = {s.get(k) for s in settings for k in ("uplink-encoding", "downlink-encoding")}
    assert set(LOSSY) <= sent, set(LOSSY) - sent


def test_compare_can_ignore_the_keys_a_change_means_to_alter(tmp_path):
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    before = _case(tmp_path / "before", 0.5, a)
    after = _case(tmp_path / "after", 0.6, a)
    assert compare_case(before, after) != []
    assert compare_case(before, after, ("accuracy",)) == []
