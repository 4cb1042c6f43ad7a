"""Write, or check, every generated block of the result pages from the published evidence.

    python -m florg_lab.results_doc            # rewrite every block and figure
    python -m florg_lab.results_doc --check    # exit 1 naming each stale block

The pages (README.md, docs/results.md, docs/results-v1.md, docs/async.md,
docs/secure-aggregation.md) mark each
generated block as ``<!-- NAME -->`` ... ``<!-- /NAME -->``; :mod:`florg_lab.pages` finds,
fills and checks them. This module only lists the blocks and figures, each with the files
it is computed from and the renderer that writes it. Each renderer sits beside its grid's
report code and reads what ``florg experiments evidence ... --publish`` (and the grids'
publish scripts) put under ``lab/evidence/``:

- README's headline: :mod:`florg_lab.page_headline`;
- protocol v2 and its variants: :mod:`florg_lab.page_v2`; the exact-aggregation methods:
  :mod:`florg_lab.page_exact`;
- communication to a target score: :mod:`florg_lab.comm_to_target`; accuracy per byte
  under message encodings: :mod:`florg_lab.page_encodings`;
- the privacy grid and the two privacy regimes: :mod:`florg_lab.privacy_regimes`;
- the long-budget SNLI grid: :mod:`florg_lab.long_budget`;
- clients of different rank: :mod:`florg_lab.page_hetero`; the causal LM:
  :mod:`florg_lab.page_sft`;
- docs/async.md's straggler comparison: :mod:`florg_lab.stragglers`;
- docs/secure-aggregation.md's accuracy in the clear and secure: :mod:`florg_lab.page_secure`;
- protocol v1's page, its report's tables rendered from its published runs:
  :mod:`florg_lab.page_v1`.

``--check`` rewrites nothing: it prints ``PAGE: block NAME ...`` for every block that
differs from what this command would write (or whose markers are missing) and exits 1;
the unit tests run it on the committed pages. Figures are written, not compared byte for
byte (their pixels depend on the installed matplotlib); the check requires that each one
that is due exists.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

from florg_lab import comm_to_target as ctt
from florg_lab import long_budget as lb
from florg_lab import page_encodings as encodings
from florg_lab import page_exact, stragglers
from florg_lab import page_hetero as hetero
from florg_lab import page_secure as secure
from florg_lab import page_sft as sft
from florg_lab import page_v1 as v1
from florg_lab import page_v2 as v2
from florg_lab import privacy_regimes as privacy
from florg_lab.page_headline import headline
from florg_lab.page_text import TASKS, Evidence
from florg_lab.pages import Block, Figure, Site, fill

__all__ = ["BLOCKS", "COMMAND", "FIGURES", "SITE", "Block", "check", "fill", "main", "write"]

COMMAND = "python -m florg_lab.results_doc"
ROOT = Path(__file__).resolve().parents[2]  # the repository

RESULTS = "docs/results.md"
ASYNC_PAGE = "docs/async.md"
V1_PAGE = "docs/results-v1.md"
SECURE_PAGE = "docs/secure-aggregation.md"
RUNS_OF = "the runs' summary.json under "
METRICS_OF = "the runs' metrics.jsonl under "
LONG = lb.PUBLISHED
REGIMES = ("cross-silo", "cross-device")


def _task_metrics(task: str) -> tuple[str, ...]:
    """Protocol v2's and the exact methods' summaries, and the runs' metrics of ``task``."""
    return (v2.V2, v2.EXACT, *(METRICS_OF + folder for folder in v2.task_folders(task)))


def _encoded(task: str) -> str:
    """The encodings grid's published runs of ``task``."""
    return f"{encodings.PUBLISHED}/runs/{encodings.GRIDS[task]}"


BLOCKS = (
    Block("README.md", "HEADLINE",
          (v1.V1, v2.V2, v2.EXACT, page_exact.FED_SB_S1, sft.SFT, hetero.HETERO,
           LONG + "/tuning.json",
           METRICS_OF + LONG + "/runs"),
          headline),
    Block(RESULTS, "VERDICT-TABLE", (v1.V1, v2.V2), v2.verdict_table),
    *(Block(RESULTS, f"V2-{task.upper()}", (v2.V2, RUNS_OF + v2.task_folders(task)[0]),
            v2.v2_methods_table(task)) for task in TASKS),
    *(Block(RESULTS, f"EXACT-{task.upper()}", (*_task_metrics(task), page_exact.FED_SB_S1),
            page_exact.exact_table(task))
      for task in TASKS),
    *(Block(RESULTS, f"COMM-TO-TARGET-{task.upper()}", _task_metrics(task), ctt.page_block(task))
      for task in TASKS),
    *(Block(RESULTS, f"ENCODINGS-{task.upper()}",
            (*_task_metrics(task), METRICS_OF + _encoded(task)), encodings.table(task))
      for task in TASKS),
    *(Block(RESULTS, f"BYTES-TO-TARGET-{task.upper()}",
            (*_task_metrics(task), METRICS_OF + _encoded(task)), encodings.bytes_to_target(task))
      for task in TASKS),
    *(Block(RESULTS, f"VARIANTS-{task.upper()}", (v2.V2,), v2.variants_table(task))
      for task in TASKS),
    Block(RESULTS, "PRIVACY-TABLE",
          tuple(RUNS_OF + p for p in privacy.PRIVACY_RUNS) + (v2.V2,), privacy.privacy_table),
    Block(RESULTS, "PRIVACY-MECHANISM",
          tuple(f"{p}/*/metrics.jsonl" for p in privacy.PRIVACY_RUNS), privacy.privacy_mechanism),
    *(Block(RESULTS, f"PRIVACY-{regime.upper()}", privacy.REGIMES_SOURCES,
            privacy.privacy_regime(regime)) for regime in REGIMES),
    Block(RESULTS, "LONG-BUDGET", (LONG + "/tuning.json", RUNS_OF + LONG + "/runs", v2.V2),
          lb.page_block),
    Block(RESULTS, "FEDERA-FEDIT", (v2.V2, LONG + "/tuning.json", METRICS_OF + LONG + "/runs"),
          lb.federa_fedit),
    Block(RESULTS, "COMM-TO-TARGET-LONG-SNLI",
          (LONG + "/tuning.json", METRICS_OF + LONG + "/runs"), ctt.long_budget_block),
    Block(RESULTS, "HETERO-TABLE", (hetero.HETERO, RUNS_OF + hetero.PUBLISHED + "/runs"),
          hetero.hetero_table),
    # the traffic by rank and v1's tables are the published reports' tables, rendered from
    # the runs those reports were written from; their origin lines name the reports
    Block(RESULTS, "HETERO-TRAFFIC", (hetero.PUBLISHED + "/README.md",), hetero.hetero_traffic),
    Block(RESULTS, "HETERO-DIAGNOSTICS", (hetero.HETERO_DIAGNOSTICS,), hetero.hetero_diagnostics),
    Block(RESULTS, "SFT-TABLE", (sft.SFT, sft.SFT_TUNING, RUNS_OF + sft.SFT_RUNS), sft.sft_table),
    *(Block(V1_PAGE, marker, (v1.V1_REPORT,), v1.v1_part(marker)) for marker in v1.MARKERS),
    Block(ASYNC_PAGE, "ASYNC-STRAGGLERS", (METRICS_OF + stragglers.RUNS,), stragglers.page_block),
    Block(SECURE_PAGE, "SECURE-EVIDENCE", (METRICS_OF + secure.PUBLISHED,), secure.secure_table),
)  # fmt: skip
# Figures the pages show, each drawn from the evidence; a regime's once a private run of it
# is published
FIGURES = (
    Figure(stragglers.FIGURE, stragglers.page_figure, stragglers.page_figure_due),
    Figure(privacy.PRIVACY_FIGURE, privacy.privacy_figure),
    Figure(lb.FIGURE, lb.page_figure),
    *(Figure(ctt.PAGE_FIGURE.format(task=task), ctt.page_figure(task)) for task in TASKS),
    *(Figure(encodings.FIGURE.format(task=task), encodings.figure(task),
             functools.partial(encodings.published, task=task)) for task in TASKS),
    *(Figure(privacy.REGIMES_FIGURE.format(regime=regime), privacy.privacy_regime_figure(regime),
             privacy.privacy_regime_drawn(regime)) for regime in REGIMES),
)  # fmt: skip
SITE = Site(COMMAND, "results_doc", BLOCKS, FIGURES, Evidence)


def pages() -> list[str]:
    return SITE.pages()


def check(pages_root: Path = ROOT, evidence_root: Path = ROOT) -> list[str]:
    """One line per stale or missing block (and missing figure); empty when up to date."""
    return SITE.check(pages_root, evidence_root)


def write(pages_root: Path = ROOT, evidence_root: Path = ROOT, figures: bool = True) -> list[str]:
    """Rewrite every page's blocks and (unless ``figures`` is false) every figure."""
    return SITE.write(pages_root, evidence_root, figures)


def main(argv: Sequence[str] | None = None) -> int:
    return SITE.main(argv, __doc__.split("\n\n")[0], ROOT)


if __name__ == "__main__":
    raise SystemExit(main())
