"""The repository root, and putting it on ``sys.path`` so that the product's packages
(flower_app, florg_tools, strategies) import wherever a benchmark is started from."""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def ensure_repo_on_path() -> None:
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
