"""The ``florg`` console script ([project.scripts]): its subcommands reach the tooling's
own parsers, the same ones ``python -m florg_tools.X`` runs."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from florg_tools.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[2]
FLORG = Path(sys.executable).parent / "florg"  # the installed script, next to this python

# subcommand -> its usage line (florg's, whichever way it is run) and an option only that
# parser has
PARSERS = {
    "launch": ("usage: florg launch", "--ephemeral-superlink"),
    "deploy": ("usage: florg deploy", "superlink,node,connection"),
    "experiments": ("usage: florg experiments", "run,report,list,evidence"),
    "assets": ("usage: florg assets", "{fetch}"),
    "flwr-home": ("usage: florg flwr-home", "{setup}"),
    "flowertune": ("usage: florg flowertune", "{projection}"),
}


def _run(*argv: str | Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "100"}  # the same help layout in every process
    return subprocess.run(
        [str(a) for a in argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def test_the_florg_script_is_installed():
    assert FLORG.is_file(), f"{FLORG} missing: reinstall the project (pip install -e .)"


def test_florg_help_lists_every_subcommand():
    out = _run(FLORG, "--help")
    assert out.returncode == 0, out.stderr
    assert set(COMMANDS) == set(PARSERS)
    for name in PARSERS:
        assert f"    {name}" in out.stdout, out.stdout


@pytest.mark.parametrize("name", ["assets", "launch"])
def test_subcommand_help_reaches_its_own_parser(name):
    usage, option = PARSERS[name]
    out = _run(FLORG, name, "--help")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(usage), out.stdout
    assert option in out.stdout, out.stdout
    other = "assets" if name == "launch" else "launch"
    assert PARSERS[other][1] not in out.stdout


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_every_subcommand_prints_its_module_help(name, monkeypatch, capsys):
    """``florg NAME --help`` prints exactly what ``python -m MODULE --help`` prints: the
    module's own ``main`` with the same arguments (called here in-process)."""
    monkeypatch.setenv("COLUMNS", "100")
    script = _run(FLORG, name, "--help")
    assert script.returncode == 0, script.stderr
    module = COMMANDS[name][0]
    assert PARSERS[name][0] == f"usage: florg {name}"  # the command users type
    with pytest.raises(SystemExit) as exited:
        importlib.import_module(module).main(["--help"])
    assert exited.value.code == 0
    direct = capsys.readouterr().out
    assert PARSERS[name][1] in direct
    assert script.stdout == direct


def test_florg_experiments_without_the_lab_says_how_to_install_it(monkeypatch, capsys):
    """The app installs without the lab (lab/): its command then names the install."""
    from florg_tools import cli

    monkeypatch.setitem(sys.modules, "florg_lab", None)  # import florg_lab now fails
    monkeypatch.setitem(sys.modules, "florg_lab.__main__", None)
    assert cli.main(["experiments", "list", "evidence-v2"]) == 2
    assert "pip install -e lab" in capsys.readouterr().err


def test_unknown_subcommand_and_bare_florg_are_usage_errors():
    bad = _run(FLORG, "no-such-command")
    assert bad.returncode == 2
    assert "invalid choice" in bad.stderr
    bare = _run(FLORG)
    assert bare.returncode == 2
    assert "launch" in bare.stderr


@pytest.mark.integration  # runs the launcher, which the guard counts as a server start
def test_subcommand_exit_status_is_passed_through(tmp_path):
    """A launch refused for a bad run config exits 2 (EXIT_USAGE) through the script too."""
    out = _run(FLORG, "launch", "--flwr-home", tmp_path, "--set", "no-such-key=1", "--quiet")
    assert out.returncode == 2, out.stdout + out.stderr
    assert "no-such-key" in out.stderr


def test_the_console_leaves_out_flowers_misleading_federation_size_warning():
    """flwr-simulation warns 'default simulated SuperNodes changed from 10 to 2' in every
    run, whatever the connection sets; the launcher's echo drops that line (the next one
    states the real size) and the run's log keeps it."""
    import io

    from florg_tools.flwr_cli import _stream_process

    text = (
        "WARNING :   Since flwr 1.32, default simulated SuperNodes changed from 10 to 2.\n"
        "INFO :      Federation `default` (5 simulated SuperNodes)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", f"print({text!r}, end='')"], stdout=subprocess.PIPE, text=True
    )
    sink, lines = io.StringIO(), []
    _stream_process(proc, sink, lines)
    proc.wait()
    assert sink.getvalue() == "INFO :      Federation `default` (5 simulated SuperNodes)\n"
    assert len(lines) == 2


def test_the_launchers_superlink_keeps_rays_session_folders_in_a_folder_it_removes(
    monkeypatch,
):
    """``local_superlink`` (the launcher's and the grid runner's) hands the SuperLink a
    RAY_TMPDIR of its own and removes it once the SuperLink is stopped; with a Ray cluster
    (RAY_ADDRESS) it leaves Ray's folders to the cluster."""
    from pathlib import Path

    from florg_tools import superlink as module

    seen = []

    class Stopped:
        def stop(self):
            return []

    def fake_start(flwr_home, *, extra_env=None, **kwargs):
        seen.append(dict(extra_env or {}))
        return Stopped()

    monkeypatch.setattr(module, "start_local_superlink", fake_start)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with module.local_superlink(Path("unused")):
        folder = Path(seen[-1]["RAY_TMPDIR"])
        assert folder.is_dir() and folder.name.startswith("florg-ray-")
        assert len(str(folder)) < 40  # Ray's Unix socket paths must stay under 107 bytes
    assert not folder.exists()
    with module.local_superlink(Path("unused"), extra_env={"RAY_ADDRESS": "10.0.0.1:6379"}):
        assert "RAY_TMPDIR" not in seen[-1]
