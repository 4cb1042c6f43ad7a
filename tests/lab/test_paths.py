"""Issue 15, item 4: a run folder always lies inside the operator's output root."""

from __future__ import annotations

import json
import os

import pytest

from flower_app.paths import OUTPUT_ROOT_ENV, confined, output_root
from flower_app.run_output.recorder import make_run_dir
from flower_app.settings.config import ConfigError, resolve_config


@pytest.fixture()
def root(tmp_path, monkeypatch):
    """An operator-set output root, with the working directory elsewhere."""
    root = tmp_path / "root"
    root.mkdir()
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setenv(OUTPUT_ROOT_ENV, str(root))
    return root.resolve()


@pytest.mark.parametrize(
    "name", ["../../escaped-run", "..", "a/b", "/abs", "a\\b", ".hidden", "x..y", "a b", "é"]
)
def test_run_names_with_separators_or_dots_are_refused(name):
    with pytest.raises(ConfigError, match="run-name"):
        resolve_config({"run-name": name})


@pytest.mark.parametrize(
    "output_dir", ["/tmp", "..", "../outside", "sub/../../outside", "/etc/florg"]
)
def test_output_dir_outside_the_root_is_refused(root, output_dir):
    with pytest.raises(ConfigError, match="output-dir.*outside the output root"):
        make_run_dir(resolve_config({"output-dir": output_dir, "run-name": "r"}))
    assert not (root.parent / "outside").exists()


def test_the_escape_from_the_issue_writes_nothing(root):
    """`run-name=../../escaped-run` made the ServerApp create its folder outside output-dir."""
    with pytest.raises(ConfigError, match="run-name"):
        make_run_dir(resolve_config({"run-name": "../../escaped-run"}))
    assert not (root.parent / "escaped-run").exists()
    assert not (root.parent.parent / "escaped-run").exists()
    assert list(root.iterdir()) == []


def test_symlink_out_of_the_root_is_refused(root, tmp_path):
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", root / "link")
    with pytest.raises(ConfigError, match="outside the output root"):
        make_run_dir(resolve_config({"output-dir": "link", "run-name": "r"}))
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_grid_run_ids_are_plain_folder_names():
    name = "method=florg,seed=0,task=snli,learning-rate=1e-05,target-modules=query+value"
    assert resolve_config({"run-name": name}).run_name == name


def test_folders_inside_the_root_are_accepted(root):
    assert make_run_dir(resolve_config({"run-name": "r1"})) == root / "outputs" / "r1"
    nested = make_run_dir(resolve_config({"output-dir": "grid/runs", "run-name": "r2"}))
    assert nested == root / "grid" / "runs" / "r2"
    absolute = make_run_dir(resolve_config({"output-dir": str(root / "abs"), "run-name": "r3"}))
    assert absolute == root / "abs" / "r3"
    assert json.loads((absolute / "config.json").read_text())["run-name"] == "r3"
    default = make_run_dir(resolve_config({"task": "a weird/../task name"}))
    assert default.parent == root / "outputs" and default.is_dir()


def test_resume_must_name_a_run_folder_inside_the_root(root):
    run = make_run_dir(resolve_config({"run-name": "r"}))
    assert make_run_dir(resolve_config({"resume": str(run)})) == run
    assert make_run_dir(resolve_config({"resume": "outputs/r"})) == run
    with pytest.raises(ConfigError, match="resume.*outside"):
        make_run_dir(resolve_config({"resume": str(root.parent)}))
    with pytest.raises(ConfigError, match="resume.*not a run folder"):
        make_run_dir(resolve_config({"resume": "outputs/missing"}))


def test_default_root_is_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.delenv(OUTPUT_ROOT_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    assert output_root() == tmp_path.resolve()
    assert make_run_dir(resolve_config({"run-name": "r"})) == tmp_path.resolve() / "outputs/r"
    with pytest.raises(ConfigError):
        confined("../x", "output-dir")


def test_every_shipped_grid_run_id_is_an_accepted_run_name():
    from pathlib import Path

    from florg_lab.grid import load_grid
    from flower_app.settings.config import is_folder_name

    grids = sorted((Path(__file__).resolve().parents[2] / "lab" / "grids").glob("*.yaml"))
    for path in grids:
        for run in load_grid(path).runs:
            assert is_folder_name(run.run_id), (path.name, run.run_id)
