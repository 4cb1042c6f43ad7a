"""The docker compose demo on a real Docker engine: images built, a SuperLink and three
SuperNodes (each with its ClientApp SuperExec) over TLS, a FLoRG run finished -- with one
SuperNode container killed in the middle of round 2.

What runs, in order (docs/deploy-docker.md, "What the test runs"):

1. a private ``dockerd`` (``ci.docker_engine``): its own network namespace
   with only a loopback interface, its own socket, exec-root and config under a temp
   folder, its data-root in ``~/.cache/florg-docker/engine`` so that a second run reuses
   the images (a run that finds the cache locked uses a temporary one); stopped by pid at
   the end, also after a failure, and no process of it may survive;
2. ``ci.docker_standin.prepare`` (what ``ci/docker_standin.sh`` runs):
   the wheelhouse fetched by the host's pip into ``docker/wheelhouse/``, and the
   stand-ins for ``flwr/superlink``, ``flwr/supernode``, ``flwr/superexec`` 1.42.0;
3. ``bash scripts/docker_demo.sh`` itself, in the engine's network namespace: it checks
   that docker/compose.yml and docker/with-tls.yml are the generated ones, runs
   ``compose up -d --build`` on them unchanged (the app image is built from
   docker/Dockerfile offline), waits for the SuperLink's TLS health, and runs FLoRG
   (MiniLM, a 96-example SNLI subset, 2 rounds) through ``flwr`` until the run ends;
   meanwhile the test kills the ``supernode-2`` container as soon as it received round 2;
4. checks: the run ended ``finished:completed``; round 1 sampled 3 nodes and all three
   partitions trained; round 2 names the lost node (its id and partition 1) and went on
   with the two others; the metrics rows and the adapter are in the outputs volume; every
   container is on the compose project's network only, the one published port binds
   127.0.0.1; the stand-ins and the app image are the images that ran;
5. teardown: ``compose down -v``, the certificates and wheelhouse this test created
   removed, the engine stopped.

Needs root, Debian's docker.io, debootstrap and docker-compose (``.ci/run`` installs
them). Where any of it is missing, the test skips locally with the reason and FAILS
under ``CI=true``. ``FLORG_DOCKER_FRESH=1`` wipes the image cache first (a cold run).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from ci import docker_standin
from ci.docker_engine import (
    DockerEngineError,
    PrivateDockerd,
    cached_data_root,
    compose_command,
    docker_cli,
    engine_prerequisites,
    remove_tree,
    start_engine,
)
from florg_tools.deploy import docker_offline
from florg_tools.deploy.compose_gen import APP_IMAGE, DockerLayout, service_specs

ROOT = Path(__file__).resolve().parents[2]
CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
PROJECT = "docker"  # compose's default project name: the compose files' folder
FILES = ["-f", "docker/compose.yml", "-f", "docker/with-tls.yml"]
NODES = DockerLayout().num_supernodes
VICTIM = 2  # supernode-2, partition 1
RUN_NAME = "docker-engine"
SETTINGS = {
    "num-server-rounds": 2,
    "max-train-examples": 96,  # 32 SNLI examples per node
    "max-eval-examples": 64,
    "min-train-nodes": 2,  # round 2 goes on without the killed node...
    "min-available-nodes": NODES,  # ...and round 1 waits for all three
    "run-name": RUN_NAME,
}
# Hang guards, not the budget: on an idle 2-core machine the whole test takes minutes
# (docs/deploy-docker.md has the timings), but a machine shared with other jobs can make
# the three ClientApps' process starts many times slower.
RUN_TIMEOUT = 1800  # the launcher stops the run after this
SCRIPT_TIMEOUT = 3000  # app image build (cold) + start + run
RECEIVED = re.compile(r"Receiving: train message")
NODE_ID = re.compile(r"SuperNode ID: (\d+)")


def _unavailable(reason: str) -> None:
    if CI:
        pytest.fail(f"the Docker engine test cannot run in CI: {reason}")
    pytest.skip(reason)


def _preflight() -> list[str]:
    problems = engine_prerequisites()
    for binary in ("debootstrap", "tar"):
        if shutil.which(binary) is None:
            problems.append(f"{binary} is missing (apt-get install {binary})")
    try:
        compose_command(docker_cli())
    except (DockerEngineError, OSError, subprocess.SubprocessError) as err:
        problems.append(str(err))
    if sys.version_info[:2] != docker_standin.STANDIN_PYTHON:
        problems.append(
            f"the wheelhouse needs Python {docker_standin.STANDIN_PYTHON}, this is "
            f"{sys.version_info[:2]}"
        )
    return problems


def _container(engine: PrivateDockerd, service: str) -> str | None:
    proc = engine.docker(
        "ps", "-aq",
        "--filter", f"label=com.docker.compose.project={PROJECT}",
        "--filter", f"label=com.docker.compose.service={service}",
        check=False,
    )  # fmt: skip
    ids = proc.stdout.split()
    return ids[0] if ids else None


def _logs(engine: PrivateDockerd, cid: str) -> str:
    proc = engine.docker("logs", cid, check=False, timeout=60)
    return proc.stdout + proc.stderr


def _inspect(engine: PrivateDockerd, cid: str) -> dict[str, Any]:
    return json.loads(engine.docker("inspect", cid).stdout)[0]


class _Killer(threading.Thread):
    """Waits until ``supernode-VICTIM`` has received its round-2 train message, then
    ``docker kill``s its container (SIGKILL: no goodbye to the SuperLink). Also records
    every SuperNode's id from its log."""

    def __init__(self, engine: PrivateDockerd, script: subprocess.Popen[bytes]) -> None:
        super().__init__(daemon=True)
        self.engine, self.script = engine, script
        self.stop_event = threading.Event()
        self.node_ids: dict[int, int] = {}
        self.killed_at: float | None = None
        self.kill_output = ""
        self.error = ""

    def run(self) -> None:
        try:
            self._run()
        except Exception as err:  # reported by the test
            self.error = repr(err)

    def _run(self) -> None:
        victim = None
        while not self.stop_event.is_set() and self.script.poll() is None:
            for i in range(1, NODES + 1):
                if i not in self.node_ids:
                    cid = _container(self.engine, f"supernode-{i}")
                    match = NODE_ID.search(_logs(self.engine, cid)) if cid else None
                    if match:
                        self.node_ids[i] = int(match.group(1))
            victim = victim or _container(self.engine, f"supernode-{VICTIM}")
            if victim and len(RECEIVED.findall(_logs(self.engine, victim))) >= 2:
                proc = self.engine.docker("kill", victim, check=False)
                self.kill_output = (proc.stdout + proc.stderr).strip()
                self.killed_at = time.monotonic()
                return
            self.stop_event.wait(0.5)


def _compose_logs(engine: PrivateDockerd) -> str:
    out = []
    for spec in service_specs(DockerLayout(), tls=True):
        cid = _container(engine, spec.name)
        if cid:
            out.append(f"===== {spec.name} =====\n{_logs(engine, cid)[-2000:]}")
    return "\n".join(out)


def _stop_script(script: subprocess.Popen[bytes]) -> None:
    """The demo script (and the launcher it runs) by pid: SIGINT first, as a user's
    Ctrl-C, so that the launcher stops its run; then SIGKILL to its process group."""
    if script.poll() is not None:
        return
    for sig, wait in ((signal.SIGINT, 60), (signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(script.pid, sig)
        except ProcessLookupError:
            return
        try:
            script.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


@pytest.mark.integration
def test_tls_demo_runs_florg_on_docker_and_names_a_killed_supernode(tmp_path):
    problems = _preflight()
    if problems:
        _unavailable("; ".join(problems))
    certs_dir = ROOT / "docker" / "certificates"
    certs_existed = certs_dir.exists()
    wheels_existed = docker_offline.wheelhouse_has_wheels(ROOT)
    timings: dict[str, float] = {}
    t_start = time.monotonic()
    # Unix socket paths are short: the engine's state lives in /tmp, not in tmp_path.
    state_dir = Path(tempfile.mkdtemp(prefix="florg-dockerd-", dir="/tmp"))
    fresh = os.environ.get("FLORG_DOCKER_FRESH") == "1"
    with cached_data_root(fresh=fresh) as (data_base, cached):
        try:
            engine = start_engine(state_dir, data_base)
        except DockerEngineError as err:
            remove_tree(state_dir)
            _unavailable(f"dockerd did not start: {err}")
        timings["engine"] = time.monotonic() - t_start
        failed = True
        try:
            _run_demo(engine, tmp_path, timings, cached)
            failed = False
        finally:
            t_down = time.monotonic()
            compose = compose_command(docker_cli())
            down = subprocess.run(
                [*compose, *FILES, "down", "-v", "--remove-orphans", "--timeout", "10"],
                cwd=ROOT, env=engine.env(), capture_output=True, text=True, timeout=300,
            )  # fmt: skip
            if not certs_existed:
                remove_tree(certs_dir)
            if not wheels_existed:
                docker_offline.clear_wheelhouse(ROOT)
            if cached:
                engine.prune()
            survivors = engine.stop()
            remove_tree(state_dir)
            timings["teardown"] = time.monotonic() - t_down
            timings["total"] = time.monotonic() - t_start
            (tmp_path / "timings.json").write_text(json.dumps(timings, indent=1))
            print(f"docker engine test timings (s, {engine.storage_driver}): {timings}")
            if not failed:
                assert down.returncode == 0, down.stderr[-2000:]
                assert not survivors, f"engine processes survived: {survivors}"


def _run_demo(
    engine: PrivateDockerd, tmp_path: Path, timings: dict[str, float], cached: bool
) -> None:
    # -- the network: nothing but loopback and what docker makes for the containers
    ifaces = engine.interfaces()
    assert "lo" in ifaces and all(
        i == "lo" or i == "docker0" or i.startswith(("br-", "veth")) for i in ifaces
    ), ifaces

    # -- leftovers of an interrupted earlier run on a cached engine would mix their logs in
    compose = compose_command(docker_cli())
    subprocess.run(
        [*compose, *FILES, "down", "-v", "--remove-orphans", "--timeout", "10"],
        cwd=ROOT, env=engine.env(), capture_output=True, timeout=300,
    )  # fmt: skip

    # -- stand-ins and wheelhouse (cached after the first run on this machine)
    t0 = time.monotonic()
    images = docker_standin.prepare(engine.client(), ROOT, log=lambda m: print(m, flush=True))
    timings["standins+wheelhouse"] = time.monotonic() - t0
    assert set(images) == set(docker_standin.standin_images().values())
    assert docker_offline.wheelhouse_has_wheels(ROOT)

    # -- the demo script, unchanged, in the engine's network namespace
    out = tmp_path / "outputs"
    env = engine.env()
    env |= {
        "FLWR_HOME": str(tmp_path / "flwr_home"),
        "KEEP_UP": "1",  # the test inspects the containers, then takes them down
        "OUTPUTS_DIR": str(out),
        "FLORG_VENV": sys.prefix,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
    }
    sets = [arg for k, v in SETTINGS.items() for arg in ("--set", f"{k}={v}")]
    argv = [*engine.netns(), "bash", "scripts/docker_demo.sh", "--timeout", str(RUN_TIMEOUT)]
    log_path = tmp_path / "docker_demo.log"
    t0 = time.monotonic()
    with log_path.open("wb") as log:
        script = subprocess.Popen(
            [*argv, *sets], cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    killer = _Killer(engine, script)
    killer.start()
    try:
        try:
            rc = script.wait(timeout=SCRIPT_TIMEOUT)
        except subprocess.TimeoutExpired:
            rc = None
    finally:
        _stop_script(script)
        killer.stop_event.set()
        killer.join(timeout=60)
    timings["demo-script"] = time.monotonic() - t0
    text = log_path.read_text(errors="replace")
    context = f"\n--- docker_demo.sh ---\n{text[-6000:]}\n--- containers ---\n"

    def fail_context() -> str:
        return context + _compose_logs(engine)

    assert rc == 0, f"docker_demo.sh exit {rc}" + fail_context()
    assert not killer.error, killer.error + fail_context()
    assert killer.killed_at is not None, "supernode-2 never received round 2" + fail_context()

    # -- the run: three nodes in round 1, the killed one named in round 2, completed
    assert re.search(r"\[launch\] OK: run \d+ finished:completed", text), fail_context()
    assert "docker_demo: SuperLink is up (TLS verified)" in text
    round1 = text[text.index("[ROUND 1/2]") : text.index("[ROUND 2/2]")]
    assert f"configure_train: Sampled {NODES} nodes (out of {NODES})" in round1, round1
    assert sorted(killer.node_ids) == [1, 2, 3], killer.node_ids
    assert len(set(killer.node_ids.values())) == NODES
    lost = f"round 2: lost node {killer.node_ids[VICTIM]} (partition {VICTIM - 1})"
    assert lost in text, lost + fail_context()

    # -- the outputs volume (seen through the ServerApp's container) and the copy of it
    serverapp = _container(engine, "superexec-serverapp")
    assert serverapp
    listing = engine.docker("exec", serverapp, "ls", f"/app/outputs/{RUN_NAME}").stdout.split()
    assert {"metrics.jsonl", "adapter.safetensors", "summary.json"} <= set(listing), listing
    mounts = {m["Destination"]: m for m in _inspect(engine, serverapp)["Mounts"]}
    assert mounts["/app/outputs"]["Type"] == "volume"
    assert mounts["/app/outputs"]["Name"] == f"{PROJECT}_florg-outputs"
    rows = [
        json.loads(line)
        for line in (out / RUN_NAME / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]
    assert [r["round"] for r in rows] == [0, 1, 2]
    assert rows[1]["clients"] == NODES and rows[1]["partitions"] == [0, 1, 2]
    assert rows[1]["lost-partitions"] == [] and rows[1]["lost-nodes"] == 0
    assert rows[2]["clients"] == NODES - 1 and rows[2]["partitions"] == [0, 2]
    assert rows[2]["lost-partitions"] == [VICTIM - 1] and rows[2]["lost-nodes"] == 1
    assert (out / RUN_NAME / "adapter.safetensors").stat().st_size > 0

    # -- what ran: the stand-ins and the app image; only the project network; 127.0.0.1
    standins = docker_standin.standin_images()
    expected = {"superlink": standins["superlink"], "superexec-serverapp": APP_IMAGE}
    for i in range(1, NODES + 1):
        expected[f"supernode-{i}"] = standins["supernode"]
        expected[f"superexec-clientapp-{i}"] = APP_IMAGE
    expected["certs"] = APP_IMAGE
    for service, image in expected.items():
        cid = _container(engine, service)
        assert cid, f"no container for {service}"
        info = _inspect(engine, cid)
        assert info["Config"]["Image"] == image, (service, info["Config"]["Image"])
        assert set(info["NetworkSettings"]["Networks"]) == {f"{PROJECT}_default"}, service
        bindings = info["HostConfig"]["PortBindings"] or {}
        if service == "superlink":
            assert bindings == {"8000/tcp": [{"HostIp": "127.0.0.1", "HostPort": "8000"}]}
        else:
            assert not bindings, (service, bindings)
    app_base = engine.docker(
        "image", "inspect", "--format",
        '{{ index .Config.Labels "' + docker_standin.STANDIN_LABEL + '" }}', APP_IMAGE,
    ).stdout.strip()  # fmt: skip
    assert app_base == images[standins["superexec"]], "the app image is not FROM the stand-in"
    timings["cached-engine"] = float(cached)


# --------------------------------------------------------------------------- no engine needed


def test_debian_mirror_is_read_from_both_apt_formats(tmp_path, monkeypatch):
    monkeypatch.delenv(docker_standin.MIRROR_ENV, raising=False)
    apt = tmp_path / "apt"
    (apt / "sources.list.d").mkdir(parents=True)
    (apt / "sources.list.d" / "other.list.disabled").write_text("deb http://x/ bookworm main\n")
    (apt / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\nURIs: http://mirror.example/debian-security\nSuites: bookworm-security\n"
        "Components: main\n\n"
        "Types: deb deb-src\nURIs: http://mirror.example/debian/\n"
        "Suites: bookworm bookworm-updates\nComponents: main\n"
    )
    assert docker_standin.debian_mirror(apt_dir=apt) == "http://mirror.example/debian"
    (apt / "sources.list.d" / "debian.sources").unlink()
    (apt / "sources.list").write_text(
        "# comment\ndeb-src http://src.example/debian bookworm main\n"
        "deb [signed-by=/k.gpg arch=amd64] http://one.example/debian bookworm main\n"
    )
    assert docker_standin.debian_mirror(apt_dir=apt) == "http://one.example/debian"
    monkeypatch.setenv(docker_standin.MIRROR_ENV, "http://override.example/debian")
    assert docker_standin.debian_mirror(apt_dir=apt) == "http://override.example/debian"
    monkeypatch.delenv(docker_standin.MIRROR_ENV)
    (apt / "sources.list").write_text("deb http://one.example/debian trixie main\n")
    with pytest.raises(docker_standin.DockerOfflineError, match="bookworm"):
        docker_standin.debian_mirror(apt_dir=apt)


def test_sync_and_clear_wheelhouse_keep_only_the_readme(tmp_path):
    root = tmp_path / "repo"
    dest = root / docker_offline.WHEELHOUSE_DIR
    dest.mkdir(parents=True)
    (dest / "README.md").write_text("keep")
    (dest / "stale-1.0-py3-none-any.whl").write_text("old")
    src = tmp_path / "cache"
    src.mkdir()
    (src / "a-1.0-py3-none-any.whl").write_text("a")
    (src / "b-2.0.tar.gz").write_text("bb")
    (src / docker_offline.STAMP).write_text("{}")
    docker_offline.sync_wheelhouse(src, root)
    assert sorted(p.name for p in dest.iterdir()) == [
        "README.md",
        "a-1.0-py3-none-any.whl",
        "b-2.0.tar.gz",
    ]
    assert docker_offline.wheelhouse_has_wheels(root)
    docker_offline.clear_wheelhouse(root)
    assert [p.name for p in dest.iterdir()] == ["README.md"]
    assert not docker_offline.wheelhouse_has_wheels(root)


def test_engine_refuses_what_it_cannot_do(tmp_path):
    too_long = tmp_path / ("x" * 120)
    engine = PrivateDockerd(too_long, tmp_path / "data")
    with pytest.raises(DockerEngineError, match="too long"):
        engine.start()
    assert engine.stop() == []  # never started: nothing to stop
    with pytest.raises(DockerEngineError, match="not running"):
        engine.netns()
