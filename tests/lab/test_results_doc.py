"""lab/florg_lab/results_doc.py: the result pages' generated blocks.

The committed pages must be what the command writes from the published evidence (the
check CI runs), an edited block must fail the check by page and block name, and the
report copies and number formats behave as the pages rely on."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from florg_lab import page_exact, page_text, page_v1, page_v2, results_doc
from florg_lab.page_headline import verdict_cells
from florg_lab.page_text import signed
from florg_lab.results_doc import BLOCKS, COMMAND, check, fill, main, pages, write

ROOT = Path(__file__).resolve().parents[2]
V1_PAGE = ROOT / "docs" / "results-v1.md"


def _copy_pages(target: Path) -> None:
    """The pages under ``target`` as in the repository, and the evidence and the grid files
    linked back (a grid's placeholder says whether its file is written yet)."""
    for page in pages():
        (target / page).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / page, target / page)
    (target / "lab").mkdir()
    for folder in ("evidence", "grids"):
        (target / "lab" / folder).symlink_to(ROOT / "lab" / folder)


def test_the_committed_pages_are_what_the_command_writes():
    """CI's check: every generated block of README.md, docs/results.md and
    docs/results-v1.md equals what the command writes from lab/evidence/ today."""
    problems = check(ROOT, ROOT)
    assert not problems, "\n".join(problems) + f"\n(run `{COMMAND}` and commit the pages)"


def test_the_check_fails_naming_the_page_and_the_block_when_a_block_is_edited(tmp_path, capsys):
    _copy_pages(tmp_path)
    page = tmp_path / "docs" / "results.md"
    text = page.read_text()
    start = text.index("<!-- VERDICT-TABLE -->")
    cell = text.index("does not hold", start)  # a verdict inside the generated table
    page.write_text(text[:cell] + "holds" + text[cell + len("does not hold") :])
    assert main(["--check", "--root", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "docs/results.md: block VERDICT-TABLE differs" in out
    assert out.count("differs") == 1  # only the edited block
    # writing repairs it (the figures stay: they are the repository's), then the check passes
    assert write(tmp_path, ROOT, figures=False) == ["docs/results.md"]
    assert page.read_text() == (ROOT / "docs" / "results.md").read_text()
    assert main(["--check", "--root", str(tmp_path)]) == 0


def test_a_block_whose_markers_are_gone_is_named(tmp_path):
    _copy_pages(tmp_path)
    readme = tmp_path / "README.md"
    readme.write_text(readme.read_text().replace("<!-- /HEADLINE -->", ""))
    assert any(
        line.startswith("README.md: block HEADLINE is missing") for line in check(tmp_path, ROOT)
    )


def test_prose_outside_the_blocks_is_the_authors(tmp_path):
    """Edits outside the markers are not the command's business: the check passes."""
    _copy_pages(tmp_path)
    page = tmp_path / "docs" / "results.md"
    page.write_text(page.read_text().replace("**In words.**", "**In short.**", 1))
    assert check(tmp_path, ROOT) == []


def test_every_block_names_the_command_and_its_sources():
    for block in BLOCKS:
        text = (ROOT / block.page).read_text()
        first = text.split(f"<!-- {block.marker} -->\n", 1)[1].splitlines()[0]
        assert first.startswith(f"<!-- written by `{COMMAND}` from "), (block.page, block.marker)
        assert all(source in first for source in block.sources)


def test_the_readme_links_to_the_verdict_instead_of_restating_intervals():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    assert "bash scripts/setup.sh" in readme and "bash scripts/test.sh" in readme
    assert "bash scripts/quickstart.sh" in readme
    assert "](docs/results.md)" in readme
    assert "[−" not in readme and "[-0." not in readme  # no interval typed or generated


def test_signed_numbers_keep_their_sign_visible():
    assert signed(-0.0781) == "−0.078"
    assert signed(0.0515) == "+0.052" or signed(0.0515) == "+0.051"  # float rounding
    assert signed(-0.0001) == "−0.0001"  # three decimals would read as 0
    assert signed(0.0) == "+0.000"


def test_the_verdict_table_pairs_seeds_and_decides():
    entries = {
        "florg": {"seeds": [0, 1, 2], "test_final": [0.5, 0.6, 0.7]},
        "fedit": {"seeds": [2, 1, 0], "test_final": [0.9, 0.8, 0.7]},
    }
    found = page_text.paired(entries["florg"], entries["fedit"])
    assert found.seeds == 3 and found.ahead == 0 and found.behind == 3
    assert found.verdict == "does not hold"
    assert found.text().startswith("−0.200 [")


def test_the_v1_tables_are_its_reports_rendered_from_its_runs_and_fill_replaces_a_copy():
    """Protocol v1's blocks are rendered from the report's published runs with the report's
    own table functions, not cut out of it: each table is the report's, per-task headings
    one level down, no plot links."""
    parts = page_v1.tables(page_text.Evidence(ROOT))
    report = (ROOT / page_v1.V1_REPORT).read_text()
    assert set(parts) == set(page_v1.MARKERS)
    assert parts["VERDICTS"].startswith("| claim | task | measure | interval (95%) | verdict |")
    assert parts["VERDICTS"] in report and parts["LEARNING"] in report
    assert "#### movie-sentiment" in parts["TESTS"]
    assert "Test score per tested round, mean over seeds:\n\n| method | round 0 |" in parts["TESTS"]
    assert parts["TESTS"].replace("#### ", "### ") in report
    assert parts["TUNING"].startswith("`evidence`:\n\n| combination | learning-rate = 0.0005 |")
    assert all(table in report for table in parts["TUNING"].split("\n\n")[1::2])
    assert parts["SERVER"].replace("#### ", "### ") in report
    assert parts["SERVER"].endswith("|")
    assert "plots/" not in "".join(parts.values())
    doc = "# Results\n\n<!-- VERDICTS -->\n\n## Appendix\n"
    once = fill(doc, "VERDICTS", "first")
    assert "<!-- VERDICTS -->\nfirst\n<!-- /VERDICTS -->" in once
    twice = fill(once, "VERDICTS", "second")
    assert twice.count("<!-- VERDICTS -->") == 1 and "first" not in twice
    assert twice.endswith("## Appendix\n")


def test_no_block_is_cut_out_of_another_page():
    """The renderers read summaries, tuning files and runs: none searches a published
    report's text for a section."""
    from florg_lab import comm_to_target, long_budget, page_hetero, page_sft, privacy_regimes

    for module in (page_v1, page_v2, page_exact, page_hetero, page_sft, long_budget, comm_to_target,
                   privacy_regimes, results_doc):  # fmt: skip
        source = Path(module.__file__).read_text()
        assert "import re\n" not in source and "_section(" not in source, module.__name__
        assert 'README.md").read_text' not in source, module.__name__


def test_the_long_budget_run_count_is_its_grid_files_and_tuning_jsons():
    """The long-budget block's planned runs come from lab/grids/evidence-long-snli.yaml
    (per method: each listed rate at the tuning seed, then the other seeds) and the rates
    tuning.json says tuning added, never from a number typed into the code."""
    from florg_lab import long_budget
    from florg_lab.grid import load_grid

    grid = load_grid(long_budget.GRID)
    main, tuning = grid.blocks["main"], grid.tuning
    per_method = len(tuning.values) + len(main["seed"]) - (tuning.seed in main["seed"])
    assert long_budget.grid_runs() == len(main["method"]) * len(main["task"]) * per_method
    published = ROOT / long_budget.PUBLISHED
    document = json.loads((published / "tuning.json").read_text())
    tuned = load_grid(long_budget.GRID, document["choices"], document.get("candidates"))
    planned = long_budget.planned_runs(published, long_budget.grid_runs())
    assert planned == tuned.expected_runs
    assert f"runs finished, of {planned} planned" in (ROOT / "docs" / "results.md").read_text()
    assert not hasattr(results_doc, "LONG_RUNS")


def test_the_block_engine_imports_no_grid_module():
    """florg_lab.pages finds, fills and checks blocks: it imports the standard library
    only, nothing of the lab's grids or renderers."""
    import ast

    from florg_lab import pages as engine

    tree = ast.parse(Path(engine.__file__).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}  # fmt: skip
    imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not any(name.split(".")[0] in ("florg_lab", "flower_app", "strategies")
                   for name in imported), imported  # fmt: skip
    assert imported <= {"__future__", "argparse", "re", "collections.abc", "dataclasses",
                        "pathlib", "typing"}  # fmt: skip


def test_a_missing_marker_is_an_error():
    with pytest.raises(ValueError, match="VERDICTS"):
        fill("# nothing here", "VERDICTS", "x")


def test_the_v1_page_leads_with_the_verdicts():
    """docs/results-v1.md reads verdicts first: v1's verdicts, then the report's remaining
    tables, each marker once."""
    text = V1_PAGE.read_text()
    order = [
        "# Protocol v1: the verdicts",
        "### What to conclude",
        "<!-- VERDICTS -->",
        "<!-- LEARNING -->",
        "## The report's tables",
        "<!-- TESTS -->",
        "<!-- TUNING -->",
        "<!-- SERVER -->",
    ]
    assert [text.count(part) for part in order] == [1] * len(order)
    assert [text.index(part) for part in order] == sorted(text.index(part) for part in order)


def test_published_runs_keep_config_metrics_and_summary_only():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    listed = subprocess.run(
        ["git", "ls-files", "lab/evidence"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    in_runs = [path for path in listed if "/runs/" in path]
    assert in_runs, "no published run found"
    extra = [
        p for p in in_runs if Path(p).name not in ("config.json", "metrics.jsonl", "summary.json")
    ]
    assert not extra, extra[:5]


def test_the_exact_methods_table_pairs_them_with_v2s_florg_and_fedit(tmp_path):
    """A published exact grid (synthetic: Fed-SB on movie sentiment, five seeds, 16
    parameters each way per client per round) joins protocol v2's real FLoRG and FedIT:
    paired by seed both ways, its traffic per client per round counted from its runs, and
    the three methods not published named with the count of published runs."""
    from tests.lab.test_comm_to_target import write_run

    (tmp_path / "lab" / "evidence").mkdir(parents=True)
    (tmp_path / "lab" / "evidence" / "evidence-v2").symlink_to(
        ROOT / "lab" / "evidence" / "evidence-v2"
    )
    exact = tmp_path / "lab" / "evidence" / "evidence-v2-exact"
    fed_sb = [0.625, 0.5, 0.75, 0.5, 0.75]
    entry = {"lr": 0.002, "seeds": [0, 1, 2, 3, 4], "test_final": fed_sb,
             "lr_path": [0.001, 0.002, 0.004], "test_last3": fed_sb}  # fmt: skip
    (exact).mkdir()
    summary = {"tasks": {"movie-sentiment": {"methods": {"fed-sb": entry}}}}
    (exact / "summary.json").write_text(json.dumps(summary))
    for seed in range(5):
        scores = [0.5, 0.5, 0.5, 0.5, fed_sb[seed]]
        write_run(exact / "runs" / "evidence-v2-exact", "fed-sb", seed, 0.002, scores, 16)

    text = page_exact.exact_table("movie-sentiment")(page_text.Evidence(tmp_path))
    cells = [[c.strip() for c in line.strip("|").split("|")]
             for line in text.splitlines() if line.startswith("| ")]  # fmt: skip
    rows = {row[0]: row for row in cells}
    assert set(rows) == {"method", "FLoRG", "FedIT", "Fed-SB"}
    v2 = json.loads((ROOT / "lab/evidence/evidence-v2/summary.json").read_text())
    florg = v2["tasks"]["movie-sentiment"]["methods"]["florg"]
    fedit = v2["tasks"]["movie-sentiment"]["methods"]["fedit"]
    to_florg = page_text.paired(florg, entry).text()
    to_fedit = page_text.paired(entry, fedit).text()
    assert rows["Fed-SB"][1:3] == ["2e-3 (tried 1e-3 to 4e-3)", "5"]
    assert rows["Fed-SB"][3].startswith("0.625 [")  # the seed mean
    assert rows["Fed-SB"][4:] == [to_florg, to_fedit, "32"]
    assert rows["FLoRG"][4] == "–" and rows["FedIT"][5] == "–"
    assert rows["FedIT"][4] == page_text.paired(florg, fedit).text()
    assert "RoLoRA, FedSVD, FLoRA: not published yet" in text
    assert "5 of the grid's runs published" in text


def test_the_exact_methods_table_before_any_run_is_published(tmp_path):
    (tmp_path / "lab" / "evidence").mkdir(parents=True)
    (tmp_path / "lab" / "evidence" / "evidence-v2").symlink_to(
        ROOT / "lab" / "evidence" / "evidence-v2"
    )
    text = page_exact.exact_table("snli")(page_text.Evidence(tmp_path))
    assert text == (
        "RoLoRA, FedSVD, FLoRA, Fed-SB: not published yet (`lab/grids/evidence-v2-exact-snli"
        ".yaml`, queued in `bash lab/scripts/evidence_queue.sh`; 0 of the grid's runs published)."
    )


def test_the_exact_methods_table_while_a_method_has_one_seed(tmp_path):
    """Mid-grid, a method's first published run is its tuning run at the chosen rate: one
    seed. Its row shows that score and says the paired intervals wait for a second seed,
    rather than failing the whole page (results_doc raised on it)."""
    from tests.lab.test_comm_to_target import write_run

    (tmp_path / "lab" / "evidence").mkdir(parents=True)
    (tmp_path / "lab" / "evidence" / "evidence-v2").symlink_to(
        ROOT / "lab" / "evidence" / "evidence-v2"
    )
    exact = tmp_path / "lab" / "evidence" / "evidence-v2-exact"
    entry = {"lr": 0.001, "seeds": [0], "test_final": [0.7], "lr_path": [0.0005, 0.001, 0.002]}
    exact.mkdir()
    summary = {"tasks": {"movie-sentiment": {"methods": {"rolora": entry}}}}
    (exact / "summary.json").write_text(json.dumps(summary))
    write_run(exact / "runs" / "evidence-v2-exact", "rolora", 0, 0.001, [0.5] * 4 + [0.7], 16)

    text = page_exact.exact_table("movie-sentiment")(page_text.Evidence(tmp_path))
    rows = {row[0]: row for row in (
        [c.strip() for c in line.strip("|").split("|")]
        for line in text.splitlines() if line.startswith("| ")
    )}  # fmt: skip
    waiting = "– (seeds shared: 1; an interval needs two)"
    assert rows["RoLoRA"][1:] == ["1e-3 (tried 5e-4 to 2e-3)", "1", "0.700 (one seed)",
                                  waiting, waiting, "32"]  # fmt: skip
    assert "FedSVD, FLoRA, Fed-SB: not published yet" in text


def test_the_headline_has_a_task_of_the_exact_grid_once_every_method_has_every_seed(tmp_path):
    """Synthetic exact summaries beside protocol v2's real FLoRG: on movie sentiment every
    method has FLoRG's five seeds (RoLoRA far above FLoRG, Fed-SB far below, FedSVD and
    FLoRA within 0.02 of it on every seed), so its row sorts them by the paired verdict;
    on SNLI one method has a seed missing, so that grid still runs and its task has no
    row."""
    (tmp_path / "lab" / "evidence").mkdir(parents=True)
    (tmp_path / "lab" / "evidence" / "evidence-v2").symlink_to(
        ROOT / "lab" / "evidence" / "evidence-v2"
    )
    v2 = json.loads((ROOT / "lab/evidence/evidence-v2/summary.json").read_text())["tasks"]
    tasks = {}
    for task, shift in (("movie-sentiment", {"rolora": 0.2, "fed-sb": -0.2}), ("snli", {})):
        florg = v2[task]["methods"]["florg"]
        methods = {}
        for m in page_v2.exact_methods():
            scores = [s + shift.get(m, 0.0) + 0.02 * (-1) ** i
                      for i, s in enumerate(florg["test_final"])]  # fmt: skip
            methods[m] = {"lr": 1e-3, "seeds": list(florg["seeds"]), "test_final": scores}
        tasks[task] = {"methods": methods}
    snli_fed_sb = tasks["snli"]["methods"]["fed-sb"]
    for key in ("seeds", "test_final"):
        snli_fed_sb[key] = snli_fed_sb[key][:-1]
    (tmp_path / "lab" / "evidence" / "evidence-v2-exact").mkdir()
    (tmp_path / "lab" / "evidence" / "evidence-v2-exact" / "summary.json").write_text(
        json.dumps({"tasks": tasks})
    )
    rows = [
        [what, page_text.task_name(task), *verdict_cells(verdicts)]
        for what, task, verdicts in page_exact.exact_headline(page_text.Evidence(tmp_path))
    ]
    assert rows == [["exact methods (`evidence-v2-exact`), protocol v2", "movie sentiment",
                     "Fed-SB", "RoLoRA", "FedSVD, FLoRA"]]  # fmt: skip
