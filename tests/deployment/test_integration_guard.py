"""tests/conftest.py's guard: an unmarked test that starts a server program fails."""

from __future__ import annotations

import stat
from pathlib import Path

INNER = """
import subprocess

import pytest

FLWR = {flwr!r}


@pytest.fixture(scope="module")
def server():
    subprocess.run([FLWR, "--version"], check=True)  # a module fixture: a SuperLink
    yield


def test_unmarked_start():
    subprocess.run([FLWR, "run"], check=True)


def test_unmarked_module_fixture(server):
    pass


@pytest.mark.integration
def test_marked_start():
    subprocess.run([FLWR, "run"], check=True)


def test_other_programs_are_fine():
    subprocess.run(["true"], check=True)
"""


def test_unmarked_tests_starting_flwr_fail(pytester) -> None:
    flwr = pytester.path / "bin" / "flwr"  # a stand-in: only the program's name counts
    flwr.parent.mkdir()
    flwr.write_text("#!/bin/sh\nexit 0\n")
    flwr.chmod(flwr.stat().st_mode | stat.S_IXUSR)
    pytester.makeconftest((Path(__file__).resolve().parents[1] / "conftest.py").read_text())
    pytester.makepyfile(test_inner=INNER.format(flwr=str(flwr)))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-W", "ignore")
    result.assert_outcomes(passed=2, failed=2)
    result.stdout.fnmatch_lines(
        [
            "*test_unmarked_start is not marked integration but started:",
            f"*{flwr} run",
            "*test_unmarked_module_fixture is not marked integration but started:",
            f"*{flwr} --version",
        ]
    )


def test_florg_commands_that_start_runs_are_recognised() -> None:
    from tests.conftest import _server_start

    assert _server_start(["/venv/bin/florg", "launch", "--ephemeral-superlink"])
    assert _server_start(["florg", "experiments", "run", "evidence"])
    assert _server_start(["florg", "deploy", "up"])
    assert _server_start(["florg", "assets", "fetch"]) is None
    assert _server_start(["florg", "--help"]) is None
    assert _server_start(["florg", "launch", "--help"]) is None
