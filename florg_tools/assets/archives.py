"""Read members of a downloaded wheel or sdist, and write the JSON-lines files of a task."""

from __future__ import annotations

import fnmatch
import json
import tarfile
import zipfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from florg_tools.assets.base import AssetError


def _archive_members(archive: Path) -> Iterator[tuple[str, Callable[[], bytes]]]:
    """Yield (path inside the package, reader); sdists lose their top-level folder."""
    if archive.suffix == ".whl":
        with zipfile.ZipFile(archive) as zf:
            for info in zf.infolist():
                if not info.is_dir():
                    yield info.filename, lambda info=info: zf.read(info)
        return
    with tarfile.open(archive, "r:gz") as tf:
        for member in tf:
            if member.isfile():
                name = member.name.split("/", 1)[1] if "/" in member.name else member.name
                yield name, lambda member=member: tf.extractfile(member).read()  # type: ignore[union-attr]


def extract(archive: Path, patterns: Sequence[str], dest: Path, strip: str = "") -> list[Path]:
    """Write the members matching any glob pattern under ``dest`` (minus prefix ``strip``)."""
    written: list[Path] = []
    for name, read in _archive_members(archive):
        if not any(fnmatch.fnmatchcase(name, p) for p in patterns):
            continue
        rel = Path(name[len(strip) :] if strip and name.startswith(strip) else name)
        if rel.is_absolute() or ".." in rel.parts:
            raise AssetError(f"unsafe path {name!r} in {archive.name}")
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(read())
        written.append(target)
    if not written:
        raise AssetError(f"{archive.name}: no member matches {list(patterns)}")
    return written


def read_member(archive: Path, name: str) -> bytes:
    for member, read in _archive_members(archive):
        if member == name:
            return read()
    raise AssetError(f"{archive.name}: member {name!r} not found")


def write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with open(path, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
            count += 1
    return count
