"""The ``florg`` console script ([project.scripts]): its subcommands reach the tooling's
own parsers, and every ``python -m florg_tools.X`` keeps working."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from florg_tools.cli import COMMANDS

ROOT = Path(__file__).resolve().parent.parent
FLORG = Path(sys.executable).parent / "florg"  # the installed script, next to this python

# subcommand -> its module's usage line and an option only that parser has
PARSERS = {
    "launch": ("usage: python -m florg_tools.launch", "--ephemeral-superlink"),
    "deploy": ("usage: python -m florg_tools.deploy", "superlink,node,connection"),
    "experiments": ("usage: python -m florg_tools.experiments", "run,report,list,evidence"),
    "assets": ("usage: python -m florg_tools.assets", "{fetch}"),
    "flwr-home": ("usage: python -m florg_tools.flwr_home", "{setup}"),
}


def _run(*argv: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in argv], cwd=ROOT, capture_output=True, text=True, timeout=120
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
def test_every_subcommand_equals_its_python_m_form(name):
    usage, option = PARSERS[name]
    module = usage.split()[-1]
    script, direct = _run(FLORG, name, "--help"), _run(sys.executable, "-m", module, "--help")
    assert script.returncode == direct.returncode == 0, script.stderr + direct.stderr
    assert option in script.stdout
    assert script.stdout == direct.stdout


def test_unknown_subcommand_and_bare_florg_are_usage_errors():
    bad = _run(FLORG, "no-such-command")
    assert bad.returncode == 2
    assert "invalid choice" in bad.stderr
    bare = _run(FLORG)
    assert bare.returncode == 2
    assert "launch" in bare.stderr


def test_subcommand_exit_status_is_passed_through(tmp_path):
    """A launch refused for a bad run config exits 2 (EXIT_USAGE) through the script too."""
    out = _run(FLORG, "launch", "--flwr-home", tmp_path, "--set", "no-such-key=1", "--quiet")
    assert out.returncode == 2, out.stdout + out.stderr
    assert "no-such-key" in out.stderr
