"""The docker compose demo (docker/): validated by a real compose tool, its commands equal to
the loopback deployment's, its Dockerfile consistent with the project's pins.

These checks need no Docker engine: ``docker-compose config`` (Debian's package, installed
by ``.ci/run``) parses, validates and merges the files without one. Without the tool the
validation tests skip locally and FAIL in CI (``CI=true``). The demo itself runs on a real
engine in ``tests/deployment/test_docker_engine.py``.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import flwr
import pytest
import yaml
from flwr.common.config import parse_config_args
from flwr.supercore.cli.flower_superexec import _parse_args as superexec_parser
from flwr.superlink.cli.flower_superlink import _parse_args_run_superlink
from flwr.supernode.cli.flower_supernode import _parse_args_run_supernode
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from florg_tools.deploy import compose_gen
from florg_tools.deploy.commands import split_address
from florg_tools.deploy.compose_gen import (
    APP_IMAGE,
    COMPOSE_FILES,
    ENTRYPOINTS,
    FLWR_VERSION,
    DockerLayout,
    compose_files,
    render,
    service_specs,
)

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
DOCKERFILE = DOCKER / "Dockerfile"
LAYOUT = DockerLayout()
N = LAYOUT.num_supernodes
PARSERS = {
    "flower-superlink": _parse_args_run_superlink,
    "flower-supernode": _parse_args_run_supernode,
    "flower-superexec": superexec_parser,
}


# --------------------------------------------------------------------------- helpers


def _compose_tool() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True)
        if probe.returncode == 0:
            return ["docker", "compose"]
    return None


def _require_compose_tool() -> list[str]:
    tool = _compose_tool()
    if tool is None:
        reason = (
            "no compose tool: install Debian's docker-compose (apt-get install -y "
            "docker-compose; .ci/run does) to validate docker/*.yml"
        )
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(reason)
        pytest.skip(reason)
    return tool


def _compose_config(*files: str, extra_env: dict[str, str] | None = None) -> dict[str, Any]:
    tool = _require_compose_tool()
    argv = [*tool]
    for name in files:
        argv += ["-f", name]
    argv += ["config"]
    env = {**os.environ, **(extra_env or {})}
    env.pop("COMPOSE_FILE", None)
    proc = subprocess.run(argv, cwd=DOCKER, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, f"{' '.join(argv)} failed:\n{proc.stderr}\n{proc.stdout}"
    return yaml.safe_load(proc.stdout)


def _committed(name: str) -> dict[str, Any]:
    return yaml.safe_load((DOCKER / name).read_text(encoding="utf-8"))


def _merged_committed() -> dict[str, dict[str, Any]]:
    """compose.yml + with-tls.yml merged by compose's rules for these keys (command
    replaced; volumes and depends_on combined), from the committed text."""
    base = _committed("compose.yml")["services"]
    over = _committed("with-tls.yml")["services"]
    merged = {k: dict(v) for k, v in base.items()}
    for name, svc in over.items():
        target = merged.setdefault(name, {})
        for key, value in svc.items():
            if key == "volumes":
                target[key] = [*target.get(key, []), *value]
            elif key == "depends_on":
                target[key] = {**target.get(key, {}), **value}
            else:
                target[key] = value
    return merged


def _argv(service: dict[str, Any]) -> list[str]:
    return [ENTRYPOINTS[service["image"]], *service["command"]]


def _flags(argv: list[str]) -> list[str]:
    return [tok for tok in argv if tok.startswith("--")]


def _value(argv: list[str], flag: str) -> str:
    assert argv.count(flag) == 1, f"{flag} appears {argv.count(flag)} times in {argv}"
    return argv[argv.index(flag) + 1]


def _mount_targets(service: dict[str, Any]) -> dict[str, str]:
    """{container path: host path} of the service's bind mounts (short syntax)."""
    out = {}
    for vol in service.get("volumes", []):
        parts = vol.split(":")
        if parts[0].startswith("."):
            out[parts[1]] = parts[0]
    return out


# --------------------------------------------------------------------------- generation


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_committed_compose_files_are_the_generated_ones(name):
    have = (DOCKER / name).read_text(encoding="utf-8")
    assert have == render(name), (
        f"docker/{name} differs from what florg_tools/deploy/commands.py generates; "
        "run `python -m florg_tools.deploy.compose_gen --write docker`"
    )


def test_check_cli_catches_a_hand_edit(tmp_path):
    for name in COMPOSE_FILES:
        (tmp_path / name).write_text(render(name), encoding="utf-8")
    assert compose_gen.main(["--check", str(tmp_path)]) == 0
    path = tmp_path / "compose.yml"
    path.write_text(path.read_text().replace("- process\n", "- subprocess\n", 1))
    assert compose_gen.main(["--check", str(tmp_path)]) == 1


def test_connection_cli_writes_the_demo_connection_without_stealing_the_default(tmp_path):
    from florg_tools.flwr_home import read_flower_config, write_local_simulation_connection

    home = tmp_path / "home"
    write_local_simulation_connection(
        home, num_supernodes=2, num_cpus_per_client=1, num_gpus_per_client=0.0
    )
    ca = tmp_path / "ca.crt"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    argv = ["connection", "--flwr-home", str(home), "--root-certificates", str(ca)]
    assert compose_gen.main(argv) == 0
    superlink = read_flower_config(home)["superlink"]
    assert superlink["default"] == "local-simulation"
    assert superlink["docker-tls"] == {
        "address": f"127.0.0.1:{LAYOUT.superlink_port}",
        "root-certificates": str(ca.resolve()),
    }
    assert compose_gen.main([*argv[:3], "--root-certificates", str(tmp_path / "no")]) == 2


def test_layout_scales_and_rejects_nonsense():
    specs = {s.name: s.argv for s in service_specs(DockerLayout(num_supernodes=5), tls=True)}
    configs = [
        parse_config_args([_value(specs[f"supernode-{i}"], "--node-config")]) for i in range(1, 6)
    ]
    assert [c["partition-id"] for c in configs] == [0, 1, 2, 3, 4]
    assert {c["num-partitions"] for c in configs} == {5}
    ports = {_value(specs[f"supernode-{i}"], "--port") for i in range(1, 6)}
    assert len(ports) == 5
    for bad in (0, 65, True, "3"):
        with pytest.raises(ValueError):
            DockerLayout(num_supernodes=bad)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- compose tool


def test_base_compose_file_validates():
    config = _compose_config("compose.yml")
    services = config["services"]
    expected = {"superlink", "superexec-serverapp"}
    expected |= {f"supernode-{i}" for i in range(1, N + 1)}
    expected |= {f"superexec-clientapp-{i}" for i in range(1, N + 1)}
    assert set(services) == expected
    # What the tool resolved is what we generated: the same argv for every service.
    for spec in service_specs(LAYOUT, tls=False):
        assert [ENTRYPOINTS[spec.image], *services[spec.name]["command"]] == spec.argv
        assert services[spec.name]["image"] == spec.image


def test_tls_overlay_validates_and_replaces_every_insecure_command():
    config = _compose_config("compose.yml", "with-tls.yml")
    services = config["services"]
    assert "certs" in services
    tls_specs = service_specs(LAYOUT, tls=True)
    assert set(services) == {"certs"} | {s.name for s in tls_specs}
    for spec in tls_specs:
        svc = services[spec.name]
        assert [ENTRYPOINTS[spec.image], *svc["command"]] == spec.argv, spec.name
        assert "--insecure" not in svc["command"], spec.name
        assert svc["depends_on"]["certs"]["condition"] == "service_completed_successfully"
        # Every certificate file a flag names is mounted, read-only, at that path.
        mounted = {v.split(":")[1]: v.split(":")[-1] for v in svc.get("volumes", []) if ":" in v}
        for flag in ("--ssl-ca-certfile", "--ssl-certfile", "--ssl-keyfile", "--root-certificates"):
            if flag in svc["command"]:
                path = _value(svc["command"], flag)
                assert mounted.get(path) == "ro", f"{spec.name}: {flag} {path} not mounted ro"
    # The base's volume and restart policy survive the merge.
    assert any("/app/outputs" in v for v in services["superexec-serverapp"]["volumes"])


def test_tls_overlay_alone_only_extends_the_base():
    # An overlay is not a complete project (compose refuses services without an image);
    # it may add only the one-shot certs service.
    base = set(_committed("compose.yml")["services"])
    over = set(_committed("with-tls.yml")["services"])
    assert over - base == {"certs"}
    assert base <= over  # every service switches to TLS


# --------------------------------------------------------------------------- argv checks


@pytest.mark.parametrize("tls", [False, True], ids=["insecure", "tls"])
def test_every_command_parses_with_flower_1_41(tls):
    services = _merged_committed() if tls else _committed("compose.yml")["services"]
    node_configs = []
    for name, svc in services.items():
        if name == "certs":
            continue
        argv = _argv(svc)
        args = PARSERS[argv[0]]().parse_args(argv[1:])
        if argv[0] == "flower-superlink":
            assert (args.host, args.port, args.isolation) == ("0.0.0.0", 8000, "process")
            assert args.insecure is (not tls)
            assert args.runtime_dependency_install is False
            published = svc["ports"][0].split(":")
            assert published == ["127.0.0.1", str(args.port), str(args.port)]
        elif argv[0] == "flower-supernode":
            assert args.superlink == f"superlink:{LAYOUT.superlink_port}"
            assert args.isolation == "process" and args.host == "0.0.0.0"
            assert (args.root_certificates is not None) is tls and args.insecure is (not tls)
            node_configs.append(parse_config_args([args.node_config]))
            # Its ClientApp SuperExec dials exactly this node's Runtime API.
            i = name.removeprefix("supernode-")
            client = _argv(services[f"superexec-clientapp-{i}"])
            assert _value(client, "--runtime-api-address") == f"{name}:{args.port}"
        else:
            host, port = split_address(args.runtime_api_address)
            target = "superlink" if name == "superexec-serverapp" else name.split("-", 2)[2]
            target = target if target == "superlink" else f"supernode-{target}"
            assert host == target
            server = _argv(services[target])
            assert port == int(_value(server, "--port"))
            assert (args.root_certificates is not None) is tls
    assert sorted(c["partition-id"] for c in node_configs) == list(range(N))
    assert {c["num-partitions"] for c in node_configs} == {N}


def _loopback_argv(tmp_path: Path, monkeypatch, tls: bool) -> dict[str, list[str]]:
    """The argv the loopback deployment (florg_tools.deploy.deployment.Deployment, as the
    loopback deployment test drives it) would start, captured instead of started."""
    from florg_tools.deploy import deployment as deploy_module
    from florg_tools.deploy.certs import generate_certificates

    started: dict[str, list[str]] = {}

    class _Fake:
        def __init__(self, argv: list[str], name: str) -> None:
            self.argv, self.name, self.info = list(argv), name, {}

        def alive(self) -> bool:
            return True

    def fake_start(argv, *, name, **_kwargs):
        started[name] = list(argv)
        return _Fake(argv, name)

    ports = iter(range(41000, 41100))
    monkeypatch.setattr(deploy_module, "start_process", fake_start)
    monkeypatch.setattr(deploy_module, "wait_healthy", lambda *a, **k: None)
    monkeypatch.setattr(deploy_module, "find_free_port", lambda *a, **k: next(ports))
    certs = generate_certificates(tmp_path / "certs") if tls else None
    deployment = deploy_module.Deployment(tmp_path / "deploy", certs=certs, isolation="process")
    deployment.start_superlink()
    for pid in range(N):
        deployment.start_supernode(pid, N, wait=False)
    return started


@pytest.mark.parametrize("tls", [False, True], ids=["insecure", "tls"])
def test_compose_commands_are_the_loopback_deployments(tmp_path, monkeypatch, tls):
    """Same executables, same flags in the same order, same isolation and node config as
    the loopback deployment; only addresses and certificate paths are docker's. The
    documented differences, all due to containers: a SuperNode's Runtime API binds
    0.0.0.0 (``--host``) so its SuperExec in another container can reach it, and with TLS
    that API is served over TLS (``--ssl-*``) and dialled with ``--root-certificates``
    where the loopback SuperExec uses ``--insecure`` on 127.0.0.1."""
    loop = _loopback_argv(tmp_path, monkeypatch, tls)
    services = _merged_committed() if tls else _committed("compose.yml")["services"]
    pairs = [("superlink", "superlink"), ("superexec-serverapp", "superexec-serverapp")]
    pairs += [(f"supernode-{i + 1}", f"supernode-{i}") for i in range(N)]
    pairs += [(f"superexec-clientapp-{i + 1}", f"superexec-clientapp-{i}") for i in range(N)]
    assert set(loop) == {lp for _, lp in pairs}
    node_tls = ["--ssl-certfile", "--ssl-keyfile", "--ssl-ca-certfile"] if tls else []
    for docker_name, loop_name in pairs:
        dock, here = _argv(services[docker_name]), loop[loop_name]
        assert Path(here[0]).name == dock[0], (docker_name, here[0])
        docker_only: list[str] = []
        loop_only: list[str] = []
        if docker_name.startswith("supernode-"):
            docker_only = ["--host", *node_tls]
        elif docker_name.startswith("superexec-clientapp-") and tls:
            docker_only, loop_only = ["--root-certificates"], ["--insecure"]
        assert [f for f in _flags(dock) if f not in docker_only] == [
            f for f in _flags(here) if f not in loop_only
        ], docker_name
        assert set(docker_only) <= set(_flags(dock)), docker_name
        for flag in ("--isolation", "--node-config"):
            if flag in here:
                assert _value(dock, flag) == _value(here, flag), (docker_name, flag)


# --------------------------------------------------------------------------- certificates


def test_certs_service_writes_every_file_the_overlay_mounts(tmp_path):
    certs = _committed("with-tls.yml")["services"]["certs"]
    assert certs["entrypoint"] == ["/bin/sh", "-c"] and certs["user"] == "root"
    script = certs["command"][0]
    host_dir, container_dir = certs["volumes"][0].split(":")[:2]
    steps = [s.strip() for s in script.split("&&")]
    assert steps[-1] == f"chown -R {compose_gen.APP_UID}:{compose_gen.APP_UID} {container_dir}"
    out = tmp_path / "certificates"
    for step in steps[:-1]:  # the generator, as the container runs it, into a temp dir
        argv = shlex.split(step.replace(container_dir, str(out)))
        assert argv[:3] == ["python", "-m", "florg_tools.deploy.certs"]
        proc = subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
    from florg_tools.deploy.certs import certificate_sans

    merged = _merged_committed()
    for name, svc in merged.items():
        for _target, host in _mount_targets(svc).items():
            if host.startswith(host_dir + "/"):
                assert (out / host.removeprefix(host_dir + "/")).is_file(), (name, host)
    # Each server certificate is valid for the name its clients dial.
    assert "superlink" in certificate_sans(out / "superlink" / "server.pem")
    assert "127.0.0.1" in certificate_sans(out / "superlink" / "server.pem")  # host CLI
    for i in range(1, N + 1):
        assert f"supernode-{i}" in certificate_sans(out / f"supernode-{i}" / "server.pem")


# --------------------------------------------------------------------------- Dockerfile


def _dockerfile() -> str:
    return DOCKERFILE.read_text(encoding="utf-8")


def _instructions() -> list[str]:
    """Dockerfile instructions, continuation lines joined, comments dropped."""
    lines, current = [], ""
    for raw in _dockerfile().splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        current += (" " if current else "") + line.rstrip("\\").strip()
        if not line.endswith("\\"):
            lines.append(current)
            current = ""
    return lines


def _arg_default(name: str) -> str:
    for ins in _instructions():
        match = re.fullmatch(rf"ARG {name}=(\S+)", ins)
        if match:
            return match.group(1)
    raise AssertionError(f"no ARG {name}=... in docker/Dockerfile")


def test_flower_version_is_pinned_consistently():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    flwr_req = next(d for d in pyproject["project"]["dependencies"] if d.startswith("flwr"))
    spec = SpecifierSet(re.sub(r"^flwr(\[[^\]]*\])?", "", flwr_req))
    assert Version(FLWR_VERSION) in spec, (FLWR_VERSION, flwr_req)
    lower = next(s.version for s in spec if s.operator == ">=")
    assert Version(FLWR_VERSION).release[:2] == Version(lower).release[:2]
    # The argv above were checked with the installed Flower's parsers: it must be the
    # version the images run.
    assert flwr.__version__ == FLWR_VERSION
    assert _arg_default("FLWR_VERSION") == FLWR_VERSION
    assert _arg_default("BASE_IMAGE") == "flwr/superexec:${FLWR_VERSION}"
    froms = [i for i in _instructions() if i.startswith("FROM ")]
    assert froms == ["FROM ${BASE_IMAGE}"]
    images = {
        svc["image"]
        for f in COMPOSE_FILES
        for svc in compose_files()[f]["services"].values()
        if "image" in svc
    }
    assert images == {f"flwr/superlink:{FLWR_VERSION}", f"flwr/supernode:{FLWR_VERSION}", APP_IMAGE}


def test_torch_is_installed_first_from_the_cpu_index():
    runs = [i for i in _instructions() if i.startswith("RUN ")]
    torch_at = next(k for k, r in enumerate(runs) if '"torch==${TORCH_VERSION}"' in r)
    reqs_at = next(k for k, r in enumerate(runs) if "-r requirements.txt" in r)
    app_at = next(k for k, r in enumerate(runs) if "--no-deps /app/florg-src" in r)
    assets_at = next(k for k, r in enumerate(runs) if "florg_tools.assets fetch" in r)
    assert torch_at < reqs_at < app_at < assets_at
    assert '--index-url "${TORCH_INDEX_URL}"' in runs[torch_at]
    assert _arg_default("TORCH_INDEX_URL") == "https://download.pytorch.org/whl/cpu"
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    pinned = re.search(r'"torch==([0-9.]+)"', setup)
    assert pinned and _arg_default("TORCH_VERSION") == pinned.group(1)
    # pip may not replace torch or flwr while installing the rest.
    assert "-c constraints.txt" in runs[reqs_at]
    assert "torch==%s\\nflwr==%s\\n" in runs[reqs_at]


def test_requirements_step_keeps_everything_but_torch_and_flwr(tmp_path):
    run = next(i for i in _instructions() if "> requirements.txt" in i)
    code = re.search(r'python -c "(.*?)" > requirements\.txt', run)
    assert code, run
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    proc = subprocess.run(
        [sys.executable, "-c", code.group(1)], cwd=tmp_path, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    got = proc.stdout.split()
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = [re.split(r"[\[<>=!~; ]", d)[0] for d in deps]
    assert got == [d.replace(" ", "") for d, n in zip(deps, names, strict=True)
                   if n not in ("torch", "flwr")]  # fmt: skip
    assert not any(g.startswith(("torch", "flwr[", "flwr>", "flwr=")) for g in got)
    assert "transformers" in " ".join(got) and "flwr-datasets" in " ".join(got)


def test_dockerfile_copies_only_what_exists_and_is_not_ignored():
    copies = [i for i in _instructions() if i.startswith("COPY ")]
    sources = [tok for c in copies for tok in c.split()[1:-1] if not tok.startswith("--")]
    assert sources
    for src in sources:
        assert (ROOT / src).exists(), src
    ignore = (DOCKER / "Dockerfile.dockerignore").read_text().split()
    assert "**" in ignore
    for src in sources:
        assert f"!{src}" in ignore or f"!{src}/" in ignore, f"{src} excluded from the context"
    entry = next(i for i in _instructions() if i.startswith("ENTRYPOINT"))
    assert entry == f'ENTRYPOINT ["{ENTRYPOINTS[APP_IMAGE]}"]'
    # The app image's env agrees with the deployment's and the assets' cache path.
    env = " ".join(i for i in _instructions() if i.startswith("ENV "))
    assert "FLORG_CACHE=/app/.cache/florg" in env
    assert "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1" in env


def test_demo_script_uses_the_generated_files_and_checks_them():
    script = (ROOT / "scripts" / "docker_demo.sh").read_text()
    assert subprocess.run(["bash", "-n", str(ROOT / "scripts" / "docker_demo.sh")]).returncode == 0
    assert "FILES=(-f docker/compose.yml -f docker/with-tls.yml)" in script
    assert "compose_gen --check docker" in script
    assert f"127.0.0.1:{LAYOUT.superlink_port}" in script
    assert "python -m florg_tools.launch --connection" in script


# --------------------------------------------------------------------------- offline build


def _runs_with_pip() -> list[str]:
    return [
        i
        for i in _instructions()
        if i.startswith("RUN ") and ("pip install" in i or "florg_tools.assets fetch" in i)
    ]


def test_every_pip_step_reads_only_the_wheelhouse_when_it_holds_wheels():
    runs = _runs_with_pip()
    assert len(runs) == 4  # torch, requirements, the app, the assets
    mount = "RUN --mount=type=bind,source=docker/wheelhouse,target=/tmp/wheelhouse "
    switch = (
        "if ls /tmp/wheelhouse/*.whl >/dev/null 2>&1; then "
        "export PIP_NO_INDEX=1 PIP_FIND_LINKS=/tmp/wheelhouse; fi"
    )
    for run in runs:
        assert run.startswith(mount), run[:120]
        assert " ".join(run.split())[len(mount) :].startswith(switch), run[:200]
    # The mount's source is in the build context, and only its README is committed.
    ignore = (DOCKER / "Dockerfile.dockerignore").read_text().split()
    assert "!docker/wheelhouse/" in ignore
    assert (DOCKER / "wheelhouse" / "README.md").is_file()
    gitignore = (DOCKER / ".gitignore").read_text().split()
    assert "wheelhouse/*" in gitignore and "!wheelhouse/README.md" in gitignore
    # Nothing of the wheelhouse is copied into a layer.
    assert not any("wheelhouse" in i for i in _instructions() if i.startswith(("COPY", "ADD")))


def test_the_wheelhouse_requirements_are_the_images():
    from florg_tools.deploy.docker_offline import wheel_requirements

    reqs = wheel_requirements(ROOT)
    assert f"torch=={_arg_default('TORCH_VERSION')}" in reqs
    assert f"flwr[dp]=={FLWR_VERSION}" in reqs  # dp-accounting, for dp=central
    run = next(i for i in _instructions() if "> requirements.txt" in i)
    assert "printf 'flwr[dp]==%s\\n' \"${FLWR_VERSION}\" >> requirements.txt" in run
    code = re.search(r'python -c "(.*?)" > requirements\.txt', run)
    assert code
    proc = subprocess.run(
        [sys.executable, "-c", code.group(1)], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert set(proc.stdout.split()) <= set(reqs)  # every requirement of the image's step


def _standin_instructions() -> list[str]:
    lines, current = [], ""
    for raw in (DOCKER / "standin" / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        current += (" " if current else "") + line.rstrip("\\").strip()
        if not line.endswith("\\"):
            lines.append(current)
            current = ""
    return lines


def test_standins_have_the_official_names_entrypoints_user_and_paths():
    from ci.docker_standin import standin_images

    ins = _standin_instructions()
    stages: dict[str, list[str]] = {}
    stage = ""
    for i in ins:
        if i.startswith("FROM "):
            stage = i.split()[-1]
            stages[stage] = []
        elif stage:
            stages[stage].append(i)
    for target, image in standin_images().items():
        assert image == f"flwr/{target}:{FLWR_VERSION}"
        assert stages[target] == [f'ENTRYPOINT ["flower-{target}"]'], target
        if image in ENTRYPOINTS:  # the compose files' images: the entrypoint they assume
            assert ENTRYPOINTS[image] == f"flower-{target}"
    assert "FROM base AS superexec" in ins and "FROM base AS superlink" in ins
    base = " ".join(stages["base"])
    assert f"--uid {compose_gen.APP_UID} app" in base
    assert "COPY --from=python --chown=app:app /python/venv /python/venv" in base
    assert "PATH=/python/venv/bin:$PATH" in base
    for step in ("WORKDIR /app", "USER app", "ENV HOME=/app"):
        assert step in stages["base"], step
    python = " ".join(stages["python"])
    assert "python3 -m venv /python/venv" in python
    assert "PIP_NO_INDEX=1 PIP_FIND_LINKS=/wheelhouse" in python
    assert '"${FLWR_PACKAGE}==${FLWR_VERSION}"' in python
    assert f"ARG FLWR_VERSION={FLWR_VERSION}" in ins
