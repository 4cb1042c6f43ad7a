"""Simulation settings and attaching the simulation to an existing Ray cluster.

``docs/deploy-ray.md`` describes these commands; this module runs them.

* Fast checks of ``python -m florg_tools.flwr_home setup`` (``--num-supernodes``,
  ``--num-cpus-per-client``, ``--num-gpus-per-client``, ``--ray-address``): what it writes,
  how Flower 1.41's own parser reads it (and that it drops ``init-args.address``, which is
  why the address travels as ``RAY_ADDRESS``), its errors, and ``pick_device``.
* ``test_simulation_runs_on_an_existing_two_node_ray_cluster``: a private Ray cluster on
  this machine -- a head with no CPUs (``ray start --head``) and a second node that joins
  it the way another machine would (``ray start --address HEAD``, 2 CPUs) -- then the
  tiny model through ``python -m florg_tools.launch --ephemeral-superlink`` with the
  ``export`` lines printed by ``flwr_home setup --ray-address``. It asserts the run
  completed and that it ran on that cluster: the cluster's GCS lists the
  ``flwr-simulation`` driver as a finished job and its ClientApp actors, two of them
  (2 CPUs / ``num-cpus-per-client`` 1), all on the joined node. Were the address ignored,
  ``flwr-simulation`` would start a Ray of its own and the cluster would list neither.
  Both nodes run ``ray start --block`` in their own sessions and are stopped by their
  pids (``ray stop`` would stop every Ray on the machine); then nothing of the test may
  be left alive.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil
import pytest
import torch

from florg_tools.flwr_home import (
    RAY_ADDRESS_ENV_VAR,
    main,
    ray_address_env,
    read_flower_config,
    set_ray_address,
    validate_ray_address,
    write_local_simulation_connection,
)
from florg_tools.synthetic import make_sentiment_task, make_tiny_bert
from flower_app.modeling import pick_device
from tests.harness.ray_harness import RayCluster, two_node_ray_cluster

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
CONN = "local-simulation"

# --------------------------------------------------------------------------------------
# flwr_home setup: simulation settings and the Ray address
# --------------------------------------------------------------------------------------


def _setup(home: Path, *args: str) -> list[str]:
    """Run ``flwr_home setup`` in this process; its stdout lines."""
    import io
    from contextlib import redirect_stdout

    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["setup", "--flwr-home", str(home), *args]) == 0
    return out.getvalue().splitlines()


def test_setup_writes_client_resources_and_the_ray_address(tmp_path: Path) -> None:
    home = tmp_path / "home"
    lines = _setup(
        home,
        "--num-supernodes", "20",
        "--num-cpus-per-client", "2",
        "--num-gpus-per-client", "0.25",
        "--ray-address", "10.0.0.5:6379",
    )  # fmt: skip
    assert lines == [f"export FLWR_HOME={home.resolve()}", "export RAY_ADDRESS=10.0.0.5:6379"]
    conn = read_flower_config(home)["superlink"][CONN]
    assert conn["address"] == ":local:"
    assert conn["options"]["num-supernodes"] == 20
    resources = conn["options"]["backend"]["client-resources"]
    assert resources == {"num-cpus": 2, "num-gpus": 0.25}
    assert type(resources["num-cpus"]) is int  # Flower carries it in an integer field
    assert conn["options"]["backend"]["init-args"] == {"address": "10.0.0.5:6379"}
    assert ray_address_env(home) == {RAY_ADDRESS_ENV_VAR: "10.0.0.5:6379"}
    assert ray_address_env(home, CONN) == {RAY_ADDRESS_ENV_VAR: "10.0.0.5:6379"}

    # The old spellings still work; without --ray-address the address is gone again.
    lines = _setup(home, "--num-cpus", "1", "--num-gpus", "0")
    assert lines == [f"export FLWR_HOME={home.resolve()}"]
    conn = read_flower_config(home)["superlink"][CONN]
    assert conn["options"]["backend"] == {"client-resources": {"num-cpus": 1, "num-gpus": 0.0}}
    assert ray_address_env(home) == {}

    # "auto": the cluster last started with `ray start` on the SuperLink's machine.
    assert _setup(home, "--ray-address", "auto")[-1] == "export RAY_ADDRESS=auto"
    set_ray_address(home, CONN, None)
    assert "init-args" not in read_flower_config(home)["superlink"][CONN]["options"]["backend"]


def test_flwr_reads_the_connection_but_drops_the_ray_address(tmp_path: Path) -> None:
    """What `flwr run` 1.41 sends for the connection: the SimulationConfig built by its
    own parser carries the supernodes and client resources, and has no address field."""
    from flwr.cli.flower_config import parse_superlink_connection
    from flwr.cli.run.run import _parse_deprecated_options
    from flwr.proto.federation_config_pb2 import SimulationConfig

    home = tmp_path / "home"
    _setup(home, "--num-supernodes", "7", "--num-cpus-per-client", "3",
           "--num-gpus-per-client", "0.5", "--ray-address", "head.example:6380")  # fmt: skip
    conn = parse_superlink_connection(read_flower_config(home)["superlink"][CONN], CONN)
    sim = _parse_deprecated_options(conn)
    assert sim is not None
    assert sim.num_supernodes == 7
    assert sim.client_resources_num_cpus == 3
    assert sim.client_resources_num_gpus == 0.5
    assert not sim.HasField("init_args_num_cpus")
    fields = [f.name for f in SimulationConfig.DESCRIPTOR.fields]
    assert not [f for f in fields if "address" in f], fields  # hence RAY_ADDRESS


@pytest.mark.parametrize(
    "args,message",
    [
        (["--num-supernodes", "0"], "whole number >= 1"),
        (["--num-cpus-per-client", "1.5"], "whole number >= 1"),
        (["--num-cpus-per-client", "0"], "whole number >= 1"),
        (["--num-cpus-per-client", "two"], "whole number >= 1"),
        (["--num-gpus-per-client", "-0.5"], "number >= 0"),
        (["--num-gpus-per-client", "nan"], "number >= 0"),
        (["--ray-address", "10.0.0.5"], "no port"),
        (["--ray-address", "10.0.0.5:0"], "1..65535"),
        (["--ray-address", "10.0.0.5:http"], "1..65535"),
        (["--ray-address", "ray://10.0.0.5:10001"], "Ray Client"),
        (["--ray-address", "local"], "leave --ray-address out"),
        (["--ray-address", "bad host:6379"], "not a host name"),
        (["--ray-address", "::1:6379"], "brackets"),
        (["--ray-address", ""], "empty"),
    ],
)
def test_setup_rejects_bad_values(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["setup", "--flwr-home", str(tmp_path), *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert args[0] in err and message in err, err
    assert not (tmp_path / "config.toml").exists()


def test_validate_ray_address() -> None:
    for good in ("auto", "10.0.0.5:6379", "head-1.cluster.local:6379", "[::1]:6379"):
        assert validate_ray_address(f" {good} ") == good
    for bad in ("head:", ":6379", "[::1", "[nope]:6379", "http://head:6379", "head:99999"):
        with pytest.raises(ValueError, match="ray address"):
            validate_ray_address(bad)


def test_ray_address_env_ignores_connections_without_one(tmp_path: Path) -> None:
    assert ray_address_env(tmp_path) == {}  # no config.toml
    write_local_simulation_connection(
        tmp_path, num_supernodes=2, num_cpus_per_client=1, num_gpus_per_client=0.0
    )
    assert ray_address_env(tmp_path) == {}
    assert ray_address_env(tmp_path, "no-such-connection") == {}
    with pytest.raises(ValueError, match="no connection 'other'"):
        set_ray_address(tmp_path, "other", "auto")


def test_pick_device() -> None:
    assert pick_device("cpu") == torch.device("cpu")
    has_cuda = torch.cuda.is_available()
    assert pick_device("auto").type == ("cuda" if has_cuda else "cpu")
    if has_cuda:
        assert pick_device("cuda").type == "cuda"
    else:
        with pytest.raises(RuntimeError, match="device='cuda' but .*(no CUDA|CUDA_VISIBLE)"):
            pick_device("cuda")
    with pytest.raises(ValueError, match="device must be"):
        pick_device("tpu")


# --------------------------------------------------------------------------------------
# A private two-node Ray cluster on this machine (tests/harness/ray_harness.py)
# --------------------------------------------------------------------------------------


_QUERY = """
import json, os, sys
import ray
from ray._private import state

ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)

@ray.remote(num_cpus=1)
def visible_gpus():
    return os.environ.get("CUDA_VISIBLE_DEVICES")

payload = {
    "nodes": ray.nodes(),
    "jobs": state.jobs(),
    "actors": list(state.actors().values()),
    "cuda_visible_devices": ray.get(visible_gpus.remote()),
}
ray.shutdown()
print("QUERY" + json.dumps(payload, default=str))
"""


def query_cluster(cluster: RayCluster) -> dict:
    """Nodes, jobs and actors from the cluster's GCS (a short-lived driver; the state CLI
    `ray list` needs the dashboard, which this cluster does not run)."""
    proc = subprocess.run(
        [sys.executable, "-c", _QUERY, cluster.address],
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("QUERY"))
    return json.loads(line[len("QUERY") :])


def ray_status(cluster: RayCluster, nodes: int, timeout: float = 120.0) -> str:
    """``ray status --address HEAD`` until it lists ``nodes`` active nodes."""
    deadline = time.monotonic() + timeout
    while True:
        proc = subprocess.run(
            [str(BIN / "ray"), "status", "--address", cluster.address],
            env=cluster.env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        text = proc.stdout
        active = text.split("Active:", 1)[-1].split("Pending:", 1)[0]
        if proc.returncode == 0 and active.count(" node_") == nodes:
            return text
        if time.monotonic() > deadline:
            raise AssertionError(f"ray status never showed {nodes} nodes:\n{text}{proc.stderr}")
        time.sleep(2.0)


def _tagged(tag: str) -> list[str]:
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if (
                proc.pid != os.getpid()
                and proc.environ().get("FLORG_RAY_TEST_TAG") == tag
                and proc.status() != psutil.STATUS_ZOMBIE
            ):
                found.append(f"{proc.pid}: {' '.join(proc.cmdline())[:120]}")
    return found


@pytest.mark.integration
def test_simulation_runs_on_an_existing_two_node_ray_cluster() -> None:
    t0 = time.monotonic()
    # Short: Ray's unix sockets live under the temp dir (a path limit of 107 bytes).
    root = Path(tempfile.mkdtemp(prefix="rayc-", dir="/tmp"))
    ok = False
    try:
        with two_node_ray_cluster(root) as cluster:
            phases = [f"cluster up {time.monotonic() - t0:.0f}s"]
            status = ray_status(cluster, nodes=2)
            phases.append(f"ray status {time.monotonic() - t0:.0f}s")
            assert "0.0/2.0 CPU" in status, status  # the head has none, the joined node 2

            # flwr_home setup, as a user would run it, and its export lines.
            model = make_tiny_bert(root / "assets" / "model")
            task = make_sentiment_task(root / "assets" / "task")
            home = root / "flwr_home"
            setup = subprocess.run(
                [sys.executable, "-m", "florg_tools.flwr_home", "setup", "--flwr-home",
                 str(home), "--num-supernodes", "3", "--num-cpus-per-client", "1",
                 "--num-gpus-per-client", "0", "--ray-address", cluster.address],
                cwd=ROOT, env=cluster.env, capture_output=True, text=True, check=True,
            )  # fmt: skip
            exports = dict(
                line.removeprefix("export ").split("=", 1) for line in setup.stdout.splitlines()
            )
            assert exports == {"FLWR_HOME": str(home), RAY_ADDRESS_ENV_VAR: cluster.address}

            tag = uuid.uuid4().hex
            env = {
                **cluster.env,
                **exports,
                "FLORG_RAY_TEST_TAG": tag,
                "FLORG_OUTPUT_ROOT": str(root),
                "HF_HUB_OFFLINE": "1",
                "FLWR_TELEMETRY_ENABLED": "0",
            }
            settings = {
                "model": model,
                "task": "local",
                "data-path": task,
                "text-fields": "sentence",
                "rank": 2,
                "num-server-rounds": 1,
                "min-available-nodes": 3,
                "batch-size": 16,
                "output-dir": root / "outputs",
                "run-name": "on-ray-cluster",
                "progress-bar": "false",
            }
            command = [sys.executable, "-m", "florg_tools.launch", "--ephemeral-superlink",
                       "--timeout", "400"]  # fmt: skip
            for key, value in settings.items():
                command += ["--set", f"{key}={value}"]
            run = subprocess.run(
                command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=480
            )
            log = run.stdout + run.stderr
            phases.append(f"run {time.monotonic() - t0:.0f}s")
            assert run.returncode == 0, log[-5000:]
            assert "finished:completed" in run.stderr
            rows = [
                json.loads(line)
                for line in (root / "outputs" / "on-ray-cluster" / "metrics.jsonl")
                .read_text()
                .splitlines()
            ]
            assert [r["round"] for r in rows] == [0, 1]
            assert rows[1]["clients"] == 3 and rows[1]["failures"] == 0
            assert _tagged(tag) == []  # the launcher's SuperLink, SuperExec, flwr-simulation

            # Did it run on *this* cluster? Ask the cluster's GCS.
            state = query_cluster(cluster)
            phases.append(f"query {time.monotonic() - t0:.0f}s")
            print("; ".join(phases))
            alive = {n["NodeID"]: n["Resources"].get("CPU", 0.0) for n in state["nodes"]
                     if n["Alive"]}  # fmt: skip
            assert sorted(alive.values()) == [0.0, 2.0], state["nodes"]
            head_id = next(node for node, cpus in alive.items() if cpus == 0.0)
            worker_id = next(node for node, cpus in alive.items() if cpus == 2.0)
            flwr_jobs = [j for j in state["jobs"] if "flwr-simulation" in j["Entrypoint"]]
            assert len(flwr_jobs) == 1, state["jobs"]
            assert flwr_jobs[0]["IsDead"], flwr_jobs  # the driver finished with the run
            actors = [a for a in state["actors"] if a["JobID"] == flwr_jobs[0]["JobID"]]
            assert {a["ActorClassName"] for a in actors} == {"ClientAppActor"}, actors
            # num-cpus-per-client 1 on the joined node's 2 CPUs: a pool of two actors,
            # placed on that node (the head has no CPUs), gone after the run.
            assert len(actors) == 2, actors
            assert {a["Address"]["NodeID"] for a in actors} == {worker_id} != {head_id}
            assert {a["State"] for a in actors} == {"DEAD"}
            # A task without GPUs sees none: Ray hides them (docs/deploy-ray.md, GPUs).
            assert state["cuda_visible_devices"] == ""
        ok = True
    finally:
        if ok:
            shutil.rmtree(root, ignore_errors=True)
        print(f"ray cluster test: {time.monotonic() - t0:.0f}s; files in {root}")
