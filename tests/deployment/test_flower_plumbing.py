"""Flower plumbing: config.toml writer, run-config handling, and real simulation runs.

A throwaway Flower App (FedAvg over a 2-element array, 2 SuperNodes, 2 rounds) runs through
the real simulation engine (SuperLink -> SuperExec -> flwr-simulation -> Ray) on a private
SuperLink per test; every process spawned for it must be gone afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
from flwr.cli.flower_config import parse_superlink_connection
from flwr.common.config import parse_config_args

from florg_tools.flwr_cli import (
    STATUS_COMPLETED,
    STATUS_FAILED,
    STATUS_NOT_STARTED,
    run_flower_app,
)
from florg_tools.flwr_home import read_flower_config, write_local_simulation_connection
from florg_tools.launch import EXIT_FAILED, EXIT_USAGE, main
from florg_tools.run_config import (
    ConfigValidationError,
    parse_set_value,
    write_run_config_toml,
)
from tests.harness.flower_harness import (
    live_processes,
    local_simulation_superlink,
    run_app_in_simulation,
)

REPO_ROOT = Path(__file__).resolve().parents[2]

PYPROJECT = """\
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "plumbing-app"
version = "0.1.0"
description = "Throwaway Flower App for the florg plumbing tests"
license = "Apache-2.0"
dependencies = ["flwr>=1.41"]

[tool.flwr.app]
publisher = "florg-tests"

[tool.flwr.app.components]
serverapp = "plumbing_app.server:app"
clientapp = "plumbing_app.client:app"

[tool.flwr.app.config]
num-server-rounds = 2
marker-path = ""
note = ""
fail = false
"""

SERVER = """\
import json
import os
from pathlib import Path

import numpy as np
from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    if cfg["fail"]:
        raise RuntimeError("intentional ServerApp failure")
    strategy = FedAvg(fraction_evaluate=0.0)
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord([np.zeros(2, dtype=np.float32)]),
        num_rounds=int(cfg["num-server-rounds"]),
    )
    final = result.arrays.to_numpy_ndarrays()[0].tolist()
    metrics = {int(r): dict(m) for r, m in result.train_metrics_clientapp.items()}
    Path(str(cfg["marker-path"])).write_text(
        json.dumps({"final": final, "metrics": metrics, "note": cfg["note"], "cwd": os.getcwd()})
    )
"""

CLIENT = """\
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    pid = int(context.node_config["partition-id"])
    parts = int(context.node_config["num-partitions"])
    arrays = [a + 1.0 + pid for a in msg.content["arrays"].to_numpy_ndarrays()]
    metrics = MetricRecord({"num-examples": 1 + pid, "num-partitions": parts})
    return Message(RecordDict({"arrays": ArrayRecord(arrays), "metrics": metrics}), reply_to=msg)
"""


def write_app(root: Path) -> Path:
    app = root / "plumbing-app"
    (app / "plumbing_app").mkdir(parents=True)
    (app / "pyproject.toml").write_text(PYPROJECT)
    (app / "plumbing_app" / "__init__.py").write_text("")
    (app / "plumbing_app" / "server.py").write_text(SERVER)
    (app / "plumbing_app" / "client.py").write_text(CLIENT)
    return app


# ---------------------------------------------------------------------------------------
# Fast tests: no processes
# ---------------------------------------------------------------------------------------


def test_connection_writer_keeps_other_connections(tmp_path: Path) -> None:
    original = textwrap.dedent(
        """\
        [superlink]
        default = "remote"

        [superlink.remote]
        address = "10.1.2.3:9093"
        root-certificates = "/etc/flwr/ca.pem"
        federation = "@acme/prod"

        [superlink.legacy]
        address = ":local:"
        options.num-supernodes = 7
        options.backend.client-resources.num-cpus = 3

        [other-tool]
        keep = [1, 2]
        """
    )
    (tmp_path / "config.toml").write_text(original)
    before = tomllib.loads(original)

    write_local_simulation_connection(
        tmp_path, num_supernodes=4, num_cpus_per_client=2, num_gpus_per_client=0.25
    )
    path = write_local_simulation_connection(
        tmp_path, num_supernodes=2, num_cpus_per_client=1.0, num_gpus_per_client=0
    )

    after = read_flower_config(tmp_path)
    assert path == tmp_path / "config.toml"
    assert after["superlink"]["default"] == "remote"
    for name in ("remote", "legacy"):
        assert after["superlink"][name] == before["superlink"][name]
    assert after["other-tool"] == {"keep": [1, 2]}
    ours = after["superlink"]["local-simulation"]
    assert ours["address"] == ":local:"
    resources = ours["options"]["backend"]["client-resources"]
    assert ours["options"]["num-supernodes"] == 2
    assert resources == {"num-cpus": 1, "num-gpus": 0.0}
    assert isinstance(resources["num-cpus"], int)  # Flower carries it in an integer field

    conn = parse_superlink_connection(ours, "local-simulation")  # flwr's own parser
    assert conn.options is not None and conn.options.num_supernodes == 2

    write_local_simulation_connection(
        tmp_path,
        "mine",
        num_supernodes=3,
        num_cpus_per_client=1,
        num_gpus_per_client=0.5,
        address="127.0.0.1:4567",
        set_default=True,
    )
    after = read_flower_config(tmp_path)
    assert after["superlink"]["default"] == "mine"
    assert after["superlink"]["mine"]["address"] == "127.0.0.1:4567"
    assert after["superlink"]["mine"]["insecure"] is True
    assert after["superlink"]["remote"] == before["superlink"]["remote"]


def test_connection_writer_new_file_and_bad_values(tmp_path: Path) -> None:
    home = tmp_path / "home"
    write_local_simulation_connection(
        home, num_supernodes=2, num_cpus_per_client=1, num_gpus_per_client=0.0
    )
    conns = read_flower_config(home)["superlink"]
    assert conns["default"] == "local-simulation"  # a fresh file names no other default
    assert conns["local"] == {"address": ":local:"}  # flwr's own defaults are seeded
    with pytest.raises(ValueError, match="whole number"):
        write_local_simulation_connection(
            home, num_supernodes=2, num_cpus_per_client=1.5, num_gpus_per_client=0.0
        )
    with pytest.raises(ValueError, match="num_supernodes"):
        write_local_simulation_connection(
            home, num_supernodes=0, num_cpus_per_client=1, num_gpus_per_client=0.0
        )


def test_flwr_home_setup_cli(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "florg_tools.flwr_home", "setup", "--flwr-home", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        check=True,
    )
    assert proc.stdout.strip() == f"export FLWR_HOME={tmp_path.resolve()}"
    conn = read_flower_config(tmp_path)["superlink"]["local-simulation"]
    assert conn["options"]["num-supernodes"] == 2
    assert conn["options"]["backend"]["client-resources"]["num-cpus"] >= 1


def test_run_config_file_round_trips_through_flwr_parser(tmp_path: Path) -> None:
    config = {
        "note": 'it\'s a "quoted" value with spaces = and # hash',
        "lr": 0.0005,
        "rounds": 3,
        "flag": False,
        "nested.key": "x",
        "path": "/tmp/a b/c.json",
    }
    path = write_run_config_toml(config, tmp_path / "run.toml")
    assert parse_config_args([str(path)]) == config


def test_validation_happens_before_launch(tmp_path: Path) -> None:
    app = write_app(tmp_path)
    seen: list[dict] = []

    def validate(cfg: dict) -> None:
        seen.append(cfg)
        raise ConfigValidationError("refused by validator")

    missing_home = tmp_path / "no-such-home"
    with pytest.raises(ConfigValidationError, match="refused by validator"):
        run_flower_app(app, "x", {"note": "hi"}, missing_home, 10, validate=validate)
    assert seen == [{"num-server-rounds": 2, "marker-path": "", "note": "hi", "fail": False}]
    with pytest.raises(ConfigValidationError, match="unknown run-config key"):
        run_flower_app(app, "x", {"not-a-key": 1}, missing_home, 10)
    assert not missing_home.exists()  # nothing was launched or written


def test_launch_cli_merges_file_and_set_then_validates(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    app = write_app(tmp_path)
    config_file = tmp_path / "overrides.toml"
    config_file.write_text('note = "from file"\nnum-server-rounds = 5\n')
    assert parse_set_value("3") == 3
    assert parse_set_value("0.5") == 0.5
    assert parse_set_value("true") is True
    assert parse_set_value("'quoted'") == "quoted"
    assert parse_set_value("bare/path with space") == "bare/path with space"
    common = ["--app", str(app), "--flwr-home", str(tmp_path / "none"), "--quiet"]
    validator = "tests.deployment.test_flower_plumbing:_refuse"
    code = main([*common, "--run-config-file", str(config_file), "--set", "bogus=1"])
    assert code == EXIT_USAGE
    assert "unknown run-config key(s) bogus" in capsys.readouterr().err
    code = main(
        [*common, "--run-config-file", str(config_file), "--set", "note=cli",
         "--validate-with", validator]
    )  # fmt: skip
    assert code == EXIT_USAGE
    assert _REFUSED[-1] == {
        "num-server-rounds": 5, "marker-path": "", "note": "cli", "fail": False
    }  # fmt: skip
    assert "refused:" in capsys.readouterr().err


_REFUSED: list[dict] = []


def _refuse(config: dict) -> None:
    _REFUSED.append(config)
    raise ValueError(f"refused: {sorted(config)}")


# ---------------------------------------------------------------------------------------
# Real simulation runs
# ---------------------------------------------------------------------------------------


@pytest.mark.integration
def test_simulation_run_completes(tmp_path: Path) -> None:
    app = write_app(tmp_path)
    marker = tmp_path / "marker.json"
    note = 'it\'s "quoted" with spaces'
    outcome = run_app_in_simulation(
        app,
        {"marker-path": str(marker), "note": note},
        num_supernodes=2,
        tmp_dir=tmp_path / "sim",
        timeout=240,
        stream=None,
    )
    assert outcome.ok, f"{outcome.message}\n{outcome.log_text[-3000:]}"
    assert outcome.status == STATUS_COMPLETED
    assert outcome.run_id is not None
    assert "[ROUND 2/2]" in outcome.log_text
    result = json.loads(marker.read_text())
    # Partition p adds 1 + p, weighted by 1 + p: round 1 -> 5/3, round 2 -> 10/3.
    assert result["final"] == pytest.approx([10 / 3, 10 / 3], rel=1e-5)
    assert result["metrics"]["2"]["num-partitions"] == pytest.approx(2.0)
    assert result["note"] == note
    # The ServerApp's working directory is the SuperLink's (relative paths land there).
    assert Path(result["cwd"]).resolve() == (tmp_path / "sim").resolve()


@pytest.mark.integration
def test_failing_serverapp_fails_launch_cli(tmp_path: Path) -> None:
    app = write_app(tmp_path)
    with local_simulation_superlink(tmp_path / "sim", num_supernodes=2) as sim:
        home, connection = sim
        # Unknown keys are refused by the SuperLink too (here without the local check).
        refused = run_flower_app(app, connection, {"bogus": 1}, home, 60, check_keys=False)
        assert refused.status == STATUS_NOT_STARTED and not refused.ok
        assert refused.run_id is None
        assert refused.message.endswith("Invalid run configuration.")
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "florg_tools.launch",
                "--app",
                str(app),
                "--connection",
                connection,
                "--flwr-home",
                str(home),
                "--set",
                "fail=true",
                "--timeout",
                "240",
            ],
            capture_output=True,
            text=True,
            cwd=REPO_ROOT,
            timeout=300,
            env={**os.environ, "FLWR_HOME": "/nonexistent-flwr-home"},  # --flwr-home wins
        )
        superlink = sim.superlink
    assert proc.returncode == EXIT_FAILED, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert STATUS_FAILED in proc.stderr
    assert "intentional ServerApp failure" in proc.stdout + proc.stderr
    # The run really went through flwr-simulation (and Ray), and nothing outlived it.
    commands = " ".join(info.cmdline for info in superlink.recorded())
    assert "flwr-simulation" in commands
    assert "flower-superexec" in commands
    assert live_processes(superlink.recorded(), superlink.tag) == []
