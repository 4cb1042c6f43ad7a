"""Reruns: the run config of ``florg launch --rerun RUN_DIR`` (florg_tools/run_config.py),
from a published run's config.json. The rerun through the simulation, and the app-commit a
run records: tests/runtime/test_app_e2e.py; the commit itself: tests/tooling/test_environment.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from florg_tools.launch import main as launch_main
from florg_tools.run_config import ConfigValidationError, rerun_run_config
from flower_app.settings.config import defaults, resolve_config

ROOT = Path(__file__).resolve().parents[2]
PUBLISHED = sorted((ROOT / "lab" / "evidence").glob("evidence-v2-exact/runs/*/*/config.json"))[
    0
].parent


def test_a_published_runs_config_becomes_a_new_runs_config():
    saved = json.loads((PUBLISHED / "config.json").read_text())
    config = rerun_run_config(PUBLISHED)
    assert config["run-name"] == saved["run-name"] + "-rerun"
    assert not {"output-dir", "resume", "app-commit"} & set(config)
    resolved = resolve_config({}, config)  # today's app takes it as it is
    for key, value in saved.items():
        if key not in ("output-dir", "run-name", "preset"):
            assert resolved.as_dict()[key] == value, key
    override = rerun_run_config(PUBLISHED, {"seed": 7, "run-name": "mine"})
    assert (override["seed"], override["run-name"]) == (7, "mine")


def test_a_config_of_another_version_or_no_config_is_refused(tmp_path):
    with pytest.raises(ConfigValidationError, match="--rerun: cannot read"):
        rerun_run_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**defaults(), "old-key": 1}))
    with pytest.raises(ConfigValidationError, match="does not know: old-key"):
        rerun_run_config(tmp_path)


def test_resume_and_rerun_together_are_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exited:
        launch_main(["--resume", str(PUBLISHED), "--rerun", str(PUBLISHED)])
    assert exited.value.code == 2
    assert "give one" in capsys.readouterr().err
