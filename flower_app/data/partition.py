"""Split a dataset across federated clients with flwr-datasets partitioners."""

from __future__ import annotations

import warnings
from collections import OrderedDict
from typing import Literal

import datasets

# flwr_datasets.partitioner is imported where it is used: importing it pulls
# flwr_datasets.visualization (seaborn, scipy.stats), seconds of start-up that every
# deployed ClientApp process would pay even when its partition comes from the disk cache.

Scheme = Literal["dirichlet", "iid"]
_INDEX = "__florg_row__"
_CACHE: OrderedDict[tuple[object, ...], list[list[int]]] = OrderedDict()
_CACHE_SIZE = 8


def _check(ds: datasets.Dataset, num_partitions: int, scheme: str, alpha: float) -> None:
    if num_partitions < 1:
        raise ValueError(f"num_partitions must be >= 1, got {num_partitions}")
    if num_partitions > len(ds):
        raise ValueError(f"num_partitions ({num_partitions}) exceeds the {len(ds)} rows")
    if scheme not in ("dirichlet", "iid"):
        raise ValueError(f"unknown partition scheme {scheme!r}; use 'dirichlet' or 'iid'")
    if scheme == "dirichlet" and not alpha > 0:
        raise ValueError(f"Dirichlet alpha must be > 0, got {alpha}")


def _dirichlet_draw(
    ds: datasets.Dataset,
    num_partitions: int,
    alpha: float,
    seed: int,
    label_field: str,
    min_size: int,
) -> list[list[int]]:
    from flwr_datasets.partitioner import DirichletPartitioner

    partitioner = DirichletPartitioner(
        num_partitions,
        label_field,
        float(alpha),
        min_partition_size=min_size,
        self_balancing=True,
        shuffle=True,
        seed=seed,
    )
    partitioner.dataset = ds
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flwr warns on every re-draw
        return [partitioner.load_partition(i)[_INDEX].to_pylist() for i in range(num_partitions)]


def _dirichlet(
    ds: datasets.Dataset,
    num_partitions: int,
    alpha: float,
    seed: int,
    label_field: str,
    min_size: int,
) -> list[list[int]]:
    """flwr's sampler re-draws up to 10 times for ``min_size`` rows per partition; at small
    alpha that can fail, and then the unconstrained draw (min 0) is used instead."""
    try:
        return _dirichlet_draw(ds, num_partitions, alpha, seed, label_field, min_size)
    except ValueError:
        if min_size == 0:
            raise
        return _dirichlet_draw(ds, num_partitions, alpha, seed, label_field, 0)


def _top_up(parts: list[list[int]], min_size: int) -> list[list[int]]:
    """Move rows from the largest partitions into those below ``min_size`` (deterministic)."""
    parts = [list(p) for p in parts]
    for part in parts:
        while len(part) < min_size:
            donor = max(range(len(parts)), key=lambda j: (len(parts[j]), -j))
            if len(parts[donor]) <= min_size:
                break
            part.append(parts[donor].pop())
    return parts


def partition_indices(
    ds: datasets.Dataset,
    num_partitions: int,
    scheme: Scheme = "dirichlet",
    alpha: float = 0.5,
    seed: int = 42,
    label_field: str = "label",
    min_partition_size: int = 1,
) -> list[list[int]]:
    """Row indices of every partition: disjoint, covering ``ds``, deterministic per seed.

    Dirichlet partitions (label skew, ``alpha``) get at least ``min_partition_size`` rows
    each (clamped to ``len(ds) // num_partitions``); rows are moved over from the largest
    partitions when flwr's sampler cannot meet it. IID partitions are equal seeded shards.
    """
    _check(ds, num_partitions, scheme, alpha)
    min_size = max(0, min(min_partition_size, len(ds) // num_partitions))
    key = (
        ds._fingerprint,
        len(ds),
        num_partitions,
        scheme,
        float(alpha),
        seed,
        label_field,
        min_size,
    )
    if key in _CACHE:
        _CACHE.move_to_end(key)
        return [list(p) for p in _CACHE[key]]
    if scheme == "dirichlet" and label_field not in ds.column_names:
        raise ValueError(f"label column {label_field!r} not in {ds.column_names}")
    if scheme == "iid":
        from flwr_datasets.partitioner import IidPartitioner

        rows = datasets.Dataset.from_dict({_INDEX: list(range(len(ds)))}).shuffle(seed=seed)
        iid = IidPartitioner(num_partitions)
        iid.dataset = rows.with_format("arrow")
        parts = [iid.load_partition(i)[_INDEX].to_pylist() for i in range(num_partitions)]
    else:
        indexed = ds.select_columns([label_field]).add_column(_INDEX, list(range(len(ds))))
        # Arrow format: flwr's np.array(dataset[column]) is then a bulk copy, not a row loop.
        indexed = indexed.with_format("arrow")
        parts = _dirichlet(indexed, num_partitions, alpha, seed, label_field, min_size)
        parts = _top_up(parts, min_size)
    _CACHE[key] = parts
    if len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return [list(p) for p in parts]


def partition_dataset(
    ds: datasets.Dataset,
    num_partitions: int,
    partition_id: int,
    scheme: Scheme = "dirichlet",
    alpha: float = 0.5,
    seed: int = 42,
    label_field: str = "label",
    min_partition_size: int = 1,
) -> datasets.Dataset:
    """The ``partition_id``-th of ``num_partitions`` client shards of ``ds``."""
    if not 0 <= partition_id < max(num_partitions, 0):
        raise ValueError(f"partition_id {partition_id} not in [0, {num_partitions})")
    parts = partition_indices(
        ds, num_partitions, scheme, alpha, seed, label_field, min_partition_size
    )
    return ds.select(parts[partition_id])
