"""On-disk caches of what a fresh ClientApp process (a SuperNode starts one per message) would
otherwise rebuild: the tokenised partitions and the adapted model.

* ``disk_cached_dataset`` (``tokenized_split``): ``datasets``' save_to_disk / load_from_disk;
* ``disk_cached_model`` (``cached_adapted_model``): every tensor of the freshly built
  ``AdaptedModel`` as safetensors, its metadata as JSON; a hit rebuilds the skeleton and copies
  the tensors in. Nothing is unpickled; a file that does not parse or match is a miss.

Keys hash every setting of the groups a cache declares (``groups=``), the model and data files'
identity, the library versions and the code that builds the result (flower_app/cache/keys.py).
Folder: ``$FLORG_DERIVED_CACHE``, else ``<$FLORG_CACHE or ~/.cache/florg>/derived``, kept under
``$FLORG_DERIVED_CACHE_MAX_MB`` (default 4096); ``FLORG_DISK_CACHE=0`` turns it off."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from flower_app.cache.eviction import MAX_MB_ENV_VAR, evict
from flower_app.cache.keys import (
    _code_hash,
    _key,
    _model_identity,
    _settings,
    _versions,
    path_identity,
)
from flower_app.methods.registry import method_sources

__all__ = [
    "DISABLE_ENV_VAR",
    "DIR_ENV_VAR",
    "MAX_MB_ENV_VAR",
    "STATS",
    "cache_root",
    "disk_cached_dataset",
    "disk_cached_model",
    "path_identity",
]

DIR_ENV_VAR = "FLORG_DERIVED_CACHE"
DISABLE_ENV_VAR = "FLORG_DISK_CACHE"
STATS: dict[str, int] = {"hits": 0, "misses": 0, "stores": 0, "errors": 0}

F = TypeVar("F", bound=Callable[..., Any])
_FORMAT = 1
_TENSORS = "tensors.safetensors"
_META = "meta.json"


def cache_root() -> Path | None:
    """The cache folder, or None when ``FLORG_DISK_CACHE=0``."""
    if os.environ.get(DISABLE_ENV_VAR, "1").strip().lower() in ("0", "false", "off", "no"):
        return None
    if os.environ.get(DIR_ENV_VAR):
        return Path(os.environ[DIR_ENV_VAR]).expanduser().resolve()
    from flower_app.cache.assets import default_cache_dir

    return default_cache_dir() / "derived"


def _replace_into(tmp: Path, final: Path) -> None:
    try:
        os.replace(tmp, final)
    except OSError:  # a folder written by a concurrent process is already there
        shutil.rmtree(tmp, ignore_errors=True)


def _touch(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.utime(path)


def disk_cached_dataset(
    *, groups: tuple[str, ...], source: Callable[[Any], Any]
) -> Callable[[F], F]:
    """Cache ``func(config, split, partition_id=0, num_partitions=1) -> datasets.Dataset``,
    keyed on the settings of ``groups``, on ``source(config)`` (what the settings do not
    say: the resolved task, the identity of its files) and on the tokenizer."""

    def decorate(func: F) -> F:
        @functools.wraps(func)
        def wrapper(config: Any, split: str, partition_id: int = 0, num_partitions: int = 1) -> Any:
            root = cache_root()
            if root is None:
                return func(config, split, partition_id, num_partitions)
            key = _key(
                "tokenized-split",
                {
                    "settings": _settings(config, groups),
                    "source": source(config),
                    "tokenizer": _model_identity(config.model),
                    "split": [split, int(partition_id), int(num_partitions)],
                    "code": _code_hash(func.__module__),
                    "versions": _versions(),
                },
            )
            build = functools.partial(func, config, split, partition_id, num_partitions)
            return _dataset_entry(root, key, build)

        return wrapper  # type: ignore[return-value]

    return decorate


def _dataset_entry(root: Path, key: str, build: Callable[[], Any]) -> Any:
    """The cached dataset of ``key``, or ``build()`` stored under it."""
    import datasets

    final = root / "tokenized" / key
    if (final / "dataset_info.json").is_file():
        try:
            ds = datasets.load_from_disk(str(final))
            STATS["hits"] += 1
            _touch(final)
            return ds
        except Exception:  # a damaged entry: rebuild it
            STATS["errors"] += 1
            shutil.rmtree(final, ignore_errors=True)
    STATS["misses"] += 1
    ds = build()
    try:
        tmp = final.with_name(f".{key}.{uuid.uuid4().hex}")
        tmp.parent.mkdir(parents=True, exist_ok=True)
        ds.save_to_disk(str(tmp))
        _replace_into(tmp, final)
        STATS["stores"] += 1
        evict(root, final)
        if final.is_dir():
            return datasets.load_from_disk(str(final))  # memory-mapped, like a hit
    except OSError:
        STATS["errors"] += 1
    return ds


class _SkeletonProjections:
    """While active, FLoRG's ``make_projections`` returns zeros of the right shapes instead
    of computing L and R (a QR or an SVD per layer): the skeleton that a cache hit fills
    with the stored tensors is then cheap to build. Without that hook (other adapter code)
    the skeleton is built in full, which is only slower."""

    def __enter__(self) -> _SkeletonProjections:
        import numpy as np

        try:
            from flower_app.adapters.florg import model as florg_model
        except ImportError:  # pragma: no cover - the adapters are part of this package
            self.module = None
            return self
        self.module = florg_model
        self.original = getattr(florg_model, "make_projections", None)
        if self.original is None:
            self.module = None
            return self

        def zeros(d_out: int, d_in: int, **_: Any) -> tuple[Any, Any]:
            k = min(d_in, d_out)
            return np.zeros((d_out, k)), np.zeros((k, d_in))

        florg_model.make_projections = zeros
        return self

    def __exit__(self, *exc: object) -> None:
        if self.module is not None:
            self.module.make_projections = self.original


def _model_tensors(adapted: Any) -> dict[str, Any]:
    """Every tensor that defines an AdaptedModel: the model's parameters and buffers (L and
    R are non-persistent buffers, so not in ``state_dict``) and a method's held tensors."""
    model = adapted.model
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    for group, held in adapted.held_tensors.items():  # a method's own (``held_tensors``)
        tensors.update({f"{group}/{name}": value for name, value in held.items()})
    return tensors


def _store_model(adapted: Any, final: Path, meta: dict[str, Any]) -> None:
    """``final``/tensors.safetensors + meta.json, written to a temporary folder first."""
    from safetensors.torch import save_file

    tensors = _model_tensors(adapted)
    seen: dict[int, str] = {}
    unique: dict[str, Any] = {}
    aliases: dict[str, str] = {}
    for name, tensor in tensors.items():
        ptr = tensor.data_ptr()
        if ptr in seen and tensor.numel() > 0:  # tied weights are stored once
            aliases[name] = seen[ptr]
            continue
        seen[ptr] = name
        unique[name] = tensor.detach().cpu().contiguous().clone()
    tmp = final.with_name(f".{final.name}.{uuid.uuid4().hex}")
    tmp.mkdir(parents=True)
    try:
        save_file(unique, str(tmp / _TENSORS))
        (tmp / _META).write_text(
            json.dumps({**meta, "format": _FORMAT, "aliases": aliases}, sort_keys=True)
        )
        _replace_into(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _load_model(final: Path, key: str, build: Callable[[], Any]) -> Any:
    """Build the skeleton and fill every tensor from the entry; ValueError when the entry
    does not match (then the caller rebuilds)."""
    import torch
    from safetensors.torch import load_file

    meta = json.loads((final / _META).read_text())
    if meta.get("format") != _FORMAT or meta.get("key") != key:
        raise ValueError("cache entry of another format or key")
    stored = load_file(str(final / _TENSORS))
    aliases = meta.get("aliases", {})
    if not isinstance(aliases, dict):
        raise ValueError("bad aliases")
    with _SkeletonProjections():
        adapted = build()
    tensors = _model_tensors(adapted)
    names = set(stored) | set(aliases)
    if names != set(tensors):
        raise ValueError("cache entry holds other tensors than the model")
    with torch.no_grad():
        for name, tensor in tensors.items():
            value = stored[aliases.get(name, name)]
            if value.shape != tensor.shape or value.dtype != tensor.dtype:
                raise ValueError(f"{name}: cached {tuple(value.shape)} {value.dtype}")
            tensor.copy_(value)
    return adapted


def disk_cached_model(*, groups: tuple[str, ...]) -> Callable[[F], F]:
    """Cache ``func(config, num_labels, *args) -> AdaptedModel`` (a freshly built one),
    keyed on the settings of ``groups``, the base model's files and the arguments.

    An entry is a folder: ``tensors.safetensors`` (every parameter and buffer, a method's held
    pristine W0) and ``meta.json``; nothing is unpickled. A hit builds the model's skeleton
    with the same code (FLoRG's L and R not computed) and copies the stored tensors in."""

    def decorate(func: F) -> F:
        @functools.wraps(func)
        def wrapper(config: Any, num_labels: int, *args: Any, **kwargs: Any) -> Any:
            root = cache_root()
            if root is None:
                return func(config, num_labels, *args, **kwargs)
            key = _key(
                "adapted-model",
                {
                    "settings": _settings(config, groups),
                    "model": _model_identity(config.model),
                    "num-labels": int(num_labels),
                    "args": [str(a) for a in args] + sorted(f"{k}={v}" for k, v in kwargs.items()),
                    "code": _code_hash(func.__module__),
                    # the registered methods' code: their hooks build the adapter
                    "methods": [_code_hash(m) for m in method_sources()],
                    "versions": _versions(),
                },
            )
            return _model_entry(root, key, lambda: func(config, num_labels, *args, **kwargs))

        return wrapper  # type: ignore[return-value]

    return decorate


def _model_entry(root: Path, key: str, build: Callable[[], Any]) -> Any:
    """The cached model of ``key`` (its skeleton from ``build``), or ``build()`` stored."""
    final = root / "models" / key
    if (final / _META).is_file():
        try:
            adapted = _load_model(final, key, build)
            STATS["hits"] += 1
            _touch(final)
            return adapted
        except Exception:  # a damaged, foreign or unreadable entry: rebuild it
            STATS["errors"] += 1
            shutil.rmtree(final, ignore_errors=True)
    STATS["misses"] += 1
    adapted = build()
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        _store_model(adapted, final, {"key": key})
        STATS["stores"] += 1
        evict(root, final)
    except Exception:  # an exotic model or no space: just don't cache
        STATS["errors"] += 1
    return adapted
