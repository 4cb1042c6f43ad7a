"""The quickstart prints no warning a newcomer cannot act on.

``bash scripts/quickstart.sh`` is scripts/setup.sh, then the launcher on the
local-simulation connection with ``--ephemeral-superlink``. Four messages used to come with
it, each now avoided where it starts:

* setuptools' "Editable installation." notice (twice, as pip's BuildBackendWarning): the
  two editable installs of scripts/setup.sh filter that one message (``PYTHONWARNINGS``);
* Ray's ``ray.init`` FutureWarning "Tip: In future versions of Ray, ...": the launcher sets
  ``RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=0`` where that changes no device a ClientApp sees
  (``florg_tools.flwr_home.ray_cluster.quiet_ray_env``);
* Flower's "fraction_evaluate is set to 0.0. Federated evaluation will be skipped.": the
  strategy sets its 0.0 after FedAvg's ``__init__``, which logs it for a 0.0 passed in;
* "Manually terminating ClientAppActor", logged by every Ray actor the simulation ends:
  the launcher sets Ray's ``RAY_DEDUP_LOGS_SKIP_REGEX`` for that line only.

The launch runs the quickstart's command on the tiny BERT and task (2 SuperNodes, 1 round)
and fails on any line of its output that looks like a warning and is not on ``ALLOWED``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from florg_tools.flwr_home import write_local_simulation_connection
from florg_tools.flwr_home.ray_cluster import (
    ACTOR_EXIT_LINE_RE,
    RAY_ACCEL_OVERRIDE_ENV_VAR,
    RAY_LOG_SKIP_ENV_VAR,
    quiet_ray_env,
    set_ray_address,
)

ROOT = Path(__file__).resolve().parents[2]
NODES = 2

# What counts as a warning in the console: the words, and the two messages above that say
# neither (Flower prints its level as a coloured "WARNING", Ray's line has no level at all).
WARNING_LINE = re.compile(r"warn|deprecat|manually terminating|fraction_evaluate|tip:", re.I)
# Lines that match WARNING_LINE and are fine, each with why. Empty today: the quickstart's
# launch prints no warning at all. An entry needs a reason a newcomer can act on, or a
# reason why the line is no warning (e.g. a setting whose name contains "warn").
ALLOWED: tuple[tuple[re.Pattern[str], str], ...] = ()


def warning_lines(output: str) -> list[str]:
    """The lines of ``output`` (ANSI colours removed) that look like a warning and are not
    allowed."""
    plain = re.sub(r"\x1b\[[0-9;]*m", "", output)
    return [
        line
        for line in plain.splitlines()
        if WARNING_LINE.search(line) and not any(p.search(line) for p, _ in ALLOWED)
    ]


def test_warning_lines_finds_the_four_messages():
    # as they looked in the launcher's output before (Flower's and Ray's colour codes kept)
    before = "\n".join(
        [
            "\x1b[92mINFO \x1b[0m:      Starting Flower Simulation",
            ".../ray/_private/worker.py:2051: FutureWarning: Tip: In future versions of Ray, "
            "Ray will no longer override accelerator visible devices env var if num_gpus=0",
            "  warnings.warn(",
            "\x1b[93mWARNING \x1b[0m:   fraction_evaluate is set to 0.0. Federated evaluation "
            "will be skipped.",
            "\x1b[92mINFO \x1b[0m:      [florg] round 1/2 | acc 0.6000 loss 0.6928 | 17s",
            "\x1b[36m(ClientAppActor pid=29589)\x1b[0m \x1b[93mWARNING \x1b[0m:   Manually "
            "terminating ClientAppActor",
            "[launch] OK: run 4978880761148465490 finished:completed in 45.7s",
        ]
    )
    found = warning_lines(before)
    assert len(found) == 4 and "FutureWarning" in found[0] and "Manually" in found[3]


# ------------------------------------------------------------------ scripts/setup.sh

SETUPTOOLS_NOTICE = "Editable installation.\n!!\n\n        Please be careful with folders"


def test_setup_filters_only_setuptools_editable_notice():
    """Each editable install in scripts/setup.sh runs with the PYTHONWARNINGS filter that
    drops setuptools' notice (a UserWarning in the build backend, re-raised by pip as its
    BuildBackendWarning, a UserWarning too) and nothing else."""
    script = (ROOT / "scripts" / "setup.sh").read_text()
    installs = [ln for ln in script.splitlines() if re.search(r"pip install .*-e\b", ln)]
    assert len(installs) == 2, installs  # the project and the lab
    assert all(ln.startswith('PYTHONWARNINGS="$QUIET_EDITABLE" python -m pip') for ln in installs)
    assigned = re.search(r'^QUIET_EDITABLE="([^"\n]*)"$', script, re.M)
    assert assigned is not None
    value = assigned.group(1).replace("${PYTHONWARNINGS:+$PYTHONWARNINGS,}", "")
    assert value == "ignore:Editable installation:UserWarning"
    code = (
        "import warnings\n"
        "class BuildBackendWarning(UserWarning): pass\n"
        f"warnings.warn({SETUPTOOLS_NOTICE!r}, UserWarning)\n"
        f"warnings.warn({SETUPTOOLS_NOTICE!r}, BuildBackendWarning)\n"
        "warnings.warn('Compat editable installs', UserWarning)\n"
        "warnings.warn('Editable installation.', DeprecationWarning)\n"
    )
    env = {**os.environ, "PYTHONWARNINGS": f"default,{value}"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    shown = [ln for ln in done.stderr.splitlines() if "Warning:" in ln]
    assert len(shown) == 2, done.stderr  # the other UserWarning, the other category
    assert "Compat editable installs" in shown[0] and "DeprecationWarning" in shown[1]


# ------------------------------------------------------------------ the launcher's Ray env


def _home(tmp_path: Path, num_gpus: float = 0.0) -> Path:
    write_local_simulation_connection(
        tmp_path, num_supernodes=2, num_cpus_per_client=1, num_gpus_per_client=num_gpus
    )
    return tmp_path


def test_quiet_ray_env_skips_only_the_actor_exit_line(tmp_path):
    env = quiet_ray_env(_home(tmp_path), environ={}, cuda_device_count=lambda: 0)
    skip = re.compile(env[RAY_LOG_SKIP_ENV_VAR])
    assert skip.search("\x1b[93mWARNING \x1b[0m:   Manually terminating ClientAppActor")
    assert not skip.search("\x1b[93mWARNING \x1b[0m:   Manually terminating SomethingElse")
    assert not skip.search("ERROR :   ClientApp raised an exception")
    mine = quiet_ray_env(tmp_path, environ={RAY_LOG_SKIP_ENV_VAR: "noisy"}, cuda_device_count=int)
    combined = re.compile(mine[RAY_LOG_SKIP_ENV_VAR])  # the user's regex is kept
    assert combined.search("a noisy line") and combined.search(ACTOR_EXIT_LINE_RE)
    again = {RAY_LOG_SKIP_ENV_VAR: ACTOR_EXIT_LINE_RE}
    assert RAY_LOG_SKIP_ENV_VAR not in quiet_ray_env(tmp_path, environ=again, cuda_device_count=int)


def test_quiet_ray_env_keeps_ray_hiding_gpus_where_that_matters(tmp_path):
    """``RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=0`` only where Ray's ``CUDA_VISIBLE_DEVICES=""``
    for actors without a GPU changes nothing: no CUDA device here, or every ClientApp has a
    GPU. A value the user set is kept; on a Ray cluster with num-gpus 0 Ray keeps its way."""
    cpu_home = _home(tmp_path / "cpu")
    gpu_home = _home(tmp_path / "gpu", num_gpus=0.5)
    no_gpu, one_gpu = (lambda: 0), (lambda: 1)
    assert (
        quiet_ray_env(cpu_home, environ={}, cuda_device_count=no_gpu)[RAY_ACCEL_OVERRIDE_ENV_VAR]
        == "0"
    )
    assert RAY_ACCEL_OVERRIDE_ENV_VAR not in quiet_ray_env(
        cpu_home, environ={}, cuda_device_count=one_gpu
    )
    assert (
        quiet_ray_env(gpu_home, environ={}, cuda_device_count=one_gpu)[RAY_ACCEL_OVERRIDE_ENV_VAR]
        == "0"
    )
    user = {RAY_ACCEL_OVERRIDE_ENV_VAR: "1"}
    assert RAY_ACCEL_OVERRIDE_ENV_VAR not in quiet_ray_env(
        cpu_home, environ=user, cuda_device_count=no_gpu
    )
    set_ray_address(cpu_home, "local-simulation", "10.0.0.5:6379")
    assert RAY_ACCEL_OVERRIDE_ENV_VAR not in quiet_ray_env(
        cpu_home, "local-simulation", environ={}, cuda_device_count=no_gpu
    )


def test_the_names_are_those_ray_and_flower_use():
    """Ray reads the two variables under these names, and Flower's actor logs that line
    (if an upgrade renames one, the settings silently stop working: this fails instead)."""
    import inspect

    from flwr.simulation.ray_transport import ray_actor
    from ray._private import accelerators, ray_constants

    assert accelerators.RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO_ENV_VAR == RAY_ACCEL_OVERRIDE_ENV_VAR
    assert RAY_LOG_SKIP_ENV_VAR in inspect.getsource(ray_constants)
    terminate = inspect.getsource(ray_actor.VirtualClientEngineActor.terminate)
    assert '"Manually terminating %s", self.__class__.__name__' in terminate
    assert "class ClientAppActor(VirtualClientEngineActor)" in inspect.getsource(ray_actor)
    assert re.search(ACTOR_EXIT_LINE_RE, "Manually terminating ClientAppActor")


# ------------------------------------------------------------------ the strategy


def test_the_strategy_skips_client_evaluation_without_flowers_warning():
    from tests.harness.strategy_helpers import strategy_for

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    flower = logging.getLogger("flwr")
    flower.addHandler(handler)
    try:
        strategy = strategy_for(
            "fedit", {"l.lora_A": np.zeros((2, 3)), "l.lora_B": np.zeros((3, 2))}
        )
    finally:
        flower.removeHandler(handler)
    assert strategy.fraction_evaluate == 0.0 and strategy.min_evaluate_nodes == 0
    assert list(strategy.configure_evaluate(1, None, None, None)) == []  # type: ignore[arg-type]
    assert not [r for r in records if r.levelno >= logging.WARNING], records


# ------------------------------------------------------------------ the quickstart's launch


@pytest.mark.integration
def test_quickstart_launch_prints_no_warning(tmp_path):
    """README command 1's launch (``--connection local-simulation --ephemeral-superlink``)
    on the tiny BERT: the run completes, its metrics rows are there, and its output has no
    warning line."""
    from florg_tools.synthetic import make_sentiment_task, make_tiny_bert

    model = make_tiny_bert(tmp_path / "model")
    task = make_sentiment_task(tmp_path / "task", n_train=60, n_eval=20, n_test=0)
    home, out = tmp_path / "flwr-home", tmp_path / "outputs"
    subprocess.run(
        [sys.executable, "-m", "florg_tools.flwr_home", "setup", "--flwr-home", str(home),
         "--num-supernodes", str(NODES), "--num-cpus", "1"],
        cwd=ROOT, check=True, capture_output=True,
    )  # fmt: skip
    env = {**os.environ, "FLWR_HOME": str(home), "FLORG_OUTPUT_ROOT": str(tmp_path),
           "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1"}  # fmt: skip
    env.pop("FLWR_LOG_LEVEL", None)  # DEBUG would add Flower's own (actionable) warning
    settings = {"model": model, "task": "local", "data-path": task, "text-fields": "sentence",
                "rank": 2, "num-server-rounds": 1, "min-available-nodes": NODES,
                "batch-size": 16, "max-eval-examples": 20, "output-dir": out,
                "run-name": "quickstart", "tensorboard": "off"}  # fmt: skip
    overrides = [arg for key, value in settings.items() for arg in ("--set", f"{key}={value}")]
    done = subprocess.run(
        [sys.executable, "-m", "florg_tools.launch", "--connection", "local-simulation",
         "--ephemeral-superlink", *overrides],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    assert "[florg] round 1/1" in done.stdout, done.stdout[-3000:]
    rows = (out / "quickstart" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["round"] for r in rows] == [0, 1]
    found = warning_lines(done.stdout)
    assert not found, "warnings in the quickstart's output:\n" + "\n".join(found)
