"""Copy the evidence report's tables into protocol v1's page, so the two never disagree.

    python -m florg_tools.experiments.results_doc [--doc docs/results-v1.md] \
        [--report evidence/evidence/README.md] [--status FILE]

docs/results-v1.md (moved from docs/results.md, which is now the verdict page) marks
the places with ``<!-- VERDICTS -->``, ``<!-- TESTS -->``,
``<!-- TUNING -->``, ``<!-- SERVER -->`` (FLoRG's server step per variant),
``<!-- LEARNING -->`` (each task's scores above chance against issue 11's bars; and
``<!-- STATUS -->``, filled from ``--status`` when given); each
marker, or a marked block ``<!-- X --> ... <!-- /X -->`` from an earlier copy, is replaced
by the matching part of the report that ``florg experiments evidence ... --publish`` wrote.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from pathlib import Path

INTRO = {
    "VERDICTS": "Printed by the publish command below into `evidence/evidence/README.md` "
    "(paired differences FLoRG − baseline over seeds, 95% t intervals; communication from "
    "exact parameter counts):",
    "TESTS": "From the same report (chance: the majority class of the test examples; "
    "centralised reference: LoRA trained on all the data in one process; with an interval "
    "when seeded, `centralised-reference.json`, else one run, `<grid>-centralised.json`):",
    "SERVER": "From the same report (each run's Gram error ||A_new^T A_new - Q||_F / ||Q||_F "
    "and drift ||A_new - A_prev||_F, averaged over the adapted layers and the rounds; mean "
    "and 95% t interval over seeds; paired differences over the shared seeds):",
    "LEARNING": "From the same report (final-round test score minus chance, mean and 95% t "
    "interval over seeds; the bars are issue 11's: the centralised reference at least 0.25 "
    "above chance, FLoRG and FedIT at least 0.15 on average, every other method above "
    "chance):",
    "TUNING": "From the same report (mean validation score of the last 3 rounds; for "
    "FedSA-LoRA its personalised models'; a choice marked *largest tried* or *smallest "
    "tried* sits at an end of the range, so that method's best value may lie outside it):",
}


def _section(report: str, title: str) -> str:
    found = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", report, re.S | re.M)
    if found is None:
        raise ValueError(f"the report has no section '## {title}'")
    return found.group(1).strip()


def report_parts(report: str) -> dict[str, str]:
    """The verdict table, the per-task test tables and the tuning tables of ``report``."""
    verdicts = [line for line in _section(report, "Verdicts").splitlines() if line.startswith("|")]
    kept = ("|", "### ", "Chance", "Test score per tested round")
    tests = [
        line for line in _section(report, "Test scores").splitlines()
        if not line or line.startswith(kept)
    ]  # fmt: skip
    tests_text = re.sub(r"\n{3,}", "\n\n", "\n".join(tests)).strip().replace("### ", "#### ")
    tuning = []
    pattern = r"^## Tuning of `([^`]+)` \(validation score, seed 0\)\n(.*?)(?=^## |\Z)"
    for found in re.finditer(pattern, report, re.S | re.M):
        table = [line for line in found.group(2).splitlines() if line.startswith("|")]
        tuning.append(f"`{found.group(1)}`:\n\n" + "\n".join(table))
    server = [
        line for line in _section(report, "FLoRG's server step").splitlines()
        if not line or line.startswith(("|", "### ", "No run"))
    ]  # fmt: skip
    server_text = re.sub(r"\n{3,}", "\n\n", "\n".join(server)).strip().replace("### ", "#### ")
    learning = [line for line in _section(report, "Learning").splitlines() if line.startswith("|")]
    return {
        "VERDICTS": "\n".join(verdicts),
        "LEARNING": "\n".join(learning),
        "TESTS": tests_text,
        "TUNING": "\n\n".join(tuning),
        "SERVER": server_text,
    }


def fill(doc: str, marker: str, text: str) -> str:
    """``doc`` with its ``marker`` (or earlier marked block) replaced by ``text``."""
    block = rf"<!-- {marker} -->.*?<!-- /{marker} -->|<!-- {marker} -->"
    if re.search(block, doc, re.S) is None:
        raise ValueError(f"the document has no <!-- {marker} --> marker")
    filled = f"<!-- {marker} -->\n{text}\n<!-- /{marker} -->"
    return re.sub(block, lambda _: filled, doc, count=1, flags=re.S)


def sync(doc_path: Path, report_path: Path, status: str | None = None) -> None:
    doc = doc_path.read_text()
    for marker, text in report_parts(report_path.read_text()).items():
        doc = fill(doc, marker, f"{INTRO[marker]}\n\n{text}")
    if status is not None:
        doc = fill(doc, "STATUS", status.strip())
    doc_path.write_text(doc)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m florg_tools.experiments.results_doc", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--doc", type=Path, default=Path("docs/results-v1.md"))
    parser.add_argument("--report", type=Path, default=Path("evidence/evidence/README.md"))
    parser.add_argument("--status", type=Path, default=None, help="a file with the status text")
    args = parser.parse_args(argv)
    status = None if args.status is None else args.status.read_text()
    sync(args.doc, args.report, status)
    print(f"{args.doc}: filled from {args.report}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
