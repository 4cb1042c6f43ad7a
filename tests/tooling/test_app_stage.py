"""The staged app folder that ``run_flower_app`` hands to ``flwr run`` builds the same FAB.

``florg_tools.app_stage`` copies only the folders named by ``fab-include``; if it dropped a
file the FAB needs, or Flower's build changed, the FAB hash (the app's identity on the
SuperLink) would change and these tests fail.
"""

from __future__ import annotations

from pathlib import Path

from flwr.cli.build import build_fab_from_disk

from florg_tools.app_stage import fab_include_roots, stage_app

ROOT = Path(__file__).resolve().parents[2]


def test_the_staged_repository_builds_the_same_fab_byte_for_byte(tmp_path):
    staged = stage_app(ROOT, tmp_path / "app")
    assert staged == tmp_path / "app"
    assert build_fab_from_disk(staged) == build_fab_from_disk(ROOT)
    copied = [p for p in staged.rglob("*") if p.is_file()]
    # The packages and the two files Flower reads, not the .venv, tests, docs or results.
    assert not (staged / "tests").exists() and not (staged / ".venv").exists()
    assert len(copied) < 400, len(copied)


def _app(root: Path, include: str | None) -> Path:
    root.mkdir()
    table = f"fab-include = {include}\n" if include is not None else ""
    (root / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["hatchling"]\nbuild-backend = "hatchling.build"\n'
        '[project]\nname = "toyapp"\nversion = "1.0.0"\ndependencies = ["flwr"]\n'
        f'[tool.flwr.app]\npublisher = "me"\n{table}'
        '[tool.flwr.app.components]\nserverapp = "pkg.server:app"\n'
        'clientapp = "pkg.client:app"\n[tool.flwr.app.config]\nx = 1\n'
    )
    (root / ".gitignore").write_text(".venv/\nsecret.py\n")
    for rel in (
        "pkg/server.py",
        "pkg/client.py",
        "pkg/sub/util.py",
        "pkg/secret.py",
        "pkg/notes.md",
        "other/extra.py",
        ".venv/lib/site.py",
        "top.py",
    ):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(f"# {rel}\n")
    (root / "pkg" / "link.py").symlink_to(root / "top.py")
    return root


def test_a_toy_app_stages_only_its_included_folder_and_builds_the_same_fab(tmp_path):
    app = _app(tmp_path / "toy", '["pkg/**/*.py"]')
    staged = stage_app(app, tmp_path / "staged")
    names = sorted(p.relative_to(staged).as_posix() for p in staged.rglob("*") if p.is_file())
    # secret.py is copied (the filter is Flower's, applied again on the stage), the
    # symlink, notes.md, other/ and .venv/ are not.
    assert names == [
        ".gitignore",
        "pkg/client.py",
        "pkg/secret.py",
        "pkg/server.py",
        "pkg/sub/util.py",
        "pyproject.toml",
    ]
    assert build_fab_from_disk(staged) == build_fab_from_disk(app)


def test_patterns_that_may_match_anywhere_use_the_app_folder_itself(tmp_path):
    for i, include in enumerate(
        [
            None,
            '["**/*.py"]',
            '["top.py", "pkg/**/*.py"]',
            '["pkg/**/*.py", "!pkg/secret.py"]',
            '["*/x.py"]',
        ]
    ):
        app = _app(tmp_path / f"toy{i}", include)
        assert fab_include_roots(app) is None, include
        assert stage_app(app, tmp_path / f"staged{i}") == app.resolve()
        assert not (tmp_path / f"staged{i}").exists()
