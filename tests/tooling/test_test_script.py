"""scripts/test.sh's split of the integration set: the deployment tests run in a pytest
process of their own beside the others (docs/testing.md), with the simulation modules of
SIDE_SIMULATIONS. The lists must name real modules, and a new deployment or Docker module with
integration tests must join the first (or it would run with the simulations and lengthen CI's
critical path)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def listed_tests(name: str) -> list[str]:
    text = (ROOT / "scripts" / "test.sh").read_text()
    block = re.search(rf"^{name}=\((.*?)\)", text, re.S | re.M)
    assert block, f"scripts/test.sh has no {name}=( ... ) list"
    return block.group(1).split()


def deployment_tests() -> list[str]:
    return listed_tests("DEPLOYMENT_TESTS")


def test_the_side_set_names_every_deployment_module_and_only_integration_ones():
    listed = deployment_tests()
    assert len(listed) == len(set(listed))
    for name in listed:
        path = ROOT / name
        assert path.is_file(), f"scripts/test.sh lists {name}, which does not exist"
        text = path.read_text()
        assert "pytest.mark.integration" in text, f"{name} has no integration test"
    modules = sorted(ROOT.glob("tests/deployment/test_deploy_*.py")) + sorted(
        ROOT.glob("tests/deployment/test_docker*.py")
    )
    expected = {
        p.relative_to(ROOT).as_posix()
        for p in modules
        if "pytest.mark.integration" in p.read_text()  # test_deploy_units.py: no servers
    }
    assert expected <= set(listed), f"not in scripts/test.sh's list: {expected - set(listed)}"


def test_the_side_simulations_are_integration_modules_outside_the_deployment_list():
    side = listed_tests("SIDE_SIMULATIONS")
    assert side, "SIDE_SIMULATIONS is empty: drop it from scripts/test.sh instead"
    text = (ROOT / "scripts" / "test.sh").read_text()
    assert 'SIDE_TESTS=("${DEPLOYMENT_TESTS[@]}" "${SIDE_SIMULATIONS[@]}")' in text
    for name in side:
        path = ROOT / name
        assert path.is_file(), f"scripts/test.sh lists {name}, which does not exist"
        assert "pytest.mark.integration" in path.read_text(), f"{name} has no integration test"
        assert name not in deployment_tests(), f"{name} is in both lists"


def test_the_tests_live_in_one_folder_per_area():
    """tests/ holds conftest.py and one folder per area (docs/testing.md), each a package
    pytest collects from; no test module lies loose at the top."""
    areas = {"runtime", "deployment", "tooling", "lab", "benchmarks", "harness"}
    top = {p.name for p in (ROOT / "tests").iterdir() if p.name != "__pycache__"}
    assert top == {"__init__.py", "conftest.py", *areas}, top
    for area in areas:
        assert (ROOT / "tests" / area / "__init__.py").is_file(), area
        found = list((ROOT / "tests" / area).glob("test_*.py"))
        assert bool(found) == (area != "harness"), area
