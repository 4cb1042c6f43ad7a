"""Load a task's train and eval splits with ``datasets.load_dataset``, cleaned and subset."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.compute as pc

from flower_app.data.tasks import FILE_FORMATS, TaskSpec

HOLDOUT_SEED = 0  # fixed: the held-out eval split does not move with the training seed
TEST_SEED = 1  # fixed: the carved test split and its subset do not move with the run seed
FETCH_HINT = "run `python -m florg_tools.assets fetch` (or check the path)"


def _split_file(directory: Path, split: str) -> Path:
    for ext in FILE_FORMATS:
        if (path := directory / f"{split}{ext}").is_file():
            return path
    tried = ", ".join(f"{split}{ext}" for ext in FILE_FORMATS)
    raise FileNotFoundError(f"no {tried} in {directory}; {FETCH_HINT}")


def _source(spec: TaskSpec) -> tuple[str, str | None, dict[str, str] | None]:
    """(path, config name, data_files) for ``datasets.load_dataset``."""
    if spec.hub_path is not None:
        return spec.hub_path, spec.hub_config, None
    if spec.data_file is not None:
        files = {spec.train_split: Path(spec.data_file)}
    elif spec.local_dir is not None:
        directory = Path(spec.local_dir)
        if not directory.is_dir():
            raise FileNotFoundError(f"data folder {directory} not found; {FETCH_HINT}")
        splits = [spec.train_split] + ([spec.eval_split] if spec.eval_split else [])
        splits += [spec.test_split] if spec.test_split else []
        files = {s: _split_file(directory, s) for s in splits}
    else:
        raise ValueError(f"{spec.name}: unresolved spec; call resolve_task() first")
    for path in files.values():
        if not path.is_file():
            raise FileNotFoundError(f"data file {path} not found; {FETCH_HINT}")
    formats = {FILE_FORMATS.get(p.suffix) for p in files.values()}
    if len(formats) != 1 or None in formats:
        raise ValueError(f"{spec.name}: split files must share one of {', '.join(FILE_FORMATS)}")
    return formats.pop(), None, {s: str(p) for s, p in files.items()}  # type: ignore[return-value]


def _load_raw(spec: TaskSpec) -> datasets.DatasetDict:
    path, name, data_files = _source(spec)
    try:
        return datasets.load_dataset(path, name, data_files=data_files)
    except ConnectionError as exc:
        raise ConnectionError(
            f"{spec.name}: cannot load {path}/{name} from the Hugging Face "
            f"Hub ({exc}); give a local copy as data-path"
        ) from exc


def _label_to_int(value: Any, names: dict[str, int] | None) -> int:
    """Integer label; -1 for a missing one (None, "", -1)."""
    if value is None or value == "":
        return -1
    if isinstance(value, str):
        if names is not None:
            if value not in names:
                raise ValueError(f"label {value!r} is not one of {list(names)}")
            return names[value]
        value = value.strip()
    number = float(value)
    if not number.is_integer() or number < -1:
        raise ValueError(f"label {value!r} is not -1 or a class index")
    return int(number)


def _label_names(spec: TaskSpec, train: datasets.Dataset) -> dict[str, int] | None:
    """Name → id mapping when labels are strings that are not integers."""
    column = train.data.column(spec.label_field)
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        return None
    if spec.label_names is not None:
        return {n: i for i, n in enumerate(spec.label_names)}
    values = {v for v in column.to_pylist() if v not in (None, "")}
    if all(v.strip().lstrip("-").isdigit() for v in values):
        return None
    return {n: i for i, n in enumerate(sorted(values))}


def _clean(
    ds: datasets.Dataset, spec: TaskSpec, names: dict[str, int] | None, split: str
) -> datasets.Dataset:
    """Keep the text and label columns; labels to int; drop unlabeled rows and missing texts."""
    columns = [*spec.text_fields, spec.label_field]
    missing = [c for c in columns if c not in ds.column_names]
    if missing:
        raise ValueError(
            f"{spec.name}/{split}: missing column(s) {missing}; available: {ds.column_names}"
        )
    ds = ds.select_columns(columns)
    label = spec.label_field
    features = ds.features.copy()
    features[label] = datasets.Value("int64")
    for field in spec.text_fields:
        features[field] = datasets.Value("string")

    def convert(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        labels = [_label_to_int(v, names) for v in batch[label]]
        keep = [
            i
            for i, lab in enumerate(labels)
            if lab >= 0 and all(batch[f][i] is not None for f in spec.text_fields)
        ]
        out = {f: [str(batch[f][i]) for i in keep] for f in spec.text_fields}
        out[label] = [labels[i] for i in keep]
        return out

    # One batched pass that may drop rows: the result has no indices mapping.
    return ds.map(
        convert,
        batched=True,
        features=features,
        remove_columns=columns,
        desc=f"{spec.name}/{split} labels",
    )


def _subset(ds: datasets.Dataset, limit: int | None, seed: int) -> datasets.Dataset:
    if limit is None or limit >= len(ds):
        return ds
    if limit < 0:
        raise ValueError(f"max rows must be >= 0, got {limit}")
    return ds.shuffle(seed=seed).select(range(limit))


def _carve(
    ds: datasets.Dataset, size: int, where: str
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """(rest, carved): ``size`` rows of ``ds`` drawn with the fixed TEST_SEED."""
    if len(ds) < 2 * size:
        raise ValueError(f"{where}: {len(ds)} rows are too few to carve a test split of {size}")
    parts = ds.train_test_split(test_size=size, seed=TEST_SEED)
    return parts["train"], parts["test"]


def held_out_splits(
    spec: TaskSpec,
    train: datasets.Dataset,
    evaluation: datasets.Dataset | None,
    test: datasets.Dataset | None,
) -> tuple[datasets.Dataset, datasets.Dataset, datasets.Dataset | None]:
    """(train, eval, test): the test rows set aside first (``test`` is the task's own test
    split, or ``test_size`` rows carved from train or eval with the fixed TEST_SEED), then
    the eval split held out of train when the task has none."""
    if spec.test_from == "train":
        train, test = _carve(train, spec.test_size, f"{spec.name}/{spec.train_split}")
    elif spec.test_from == "eval":
        if evaluation is None:
            raise ValueError(f"{spec.name}: test_from='eval' needs an eval split")
        evaluation, test = _carve(evaluation, spec.test_size, f"{spec.name}/{spec.eval_split}")
    train, evaluation = with_eval_split(spec, train, evaluation)
    return train, evaluation, test


def require_splits(spec: TaskSpec, raw: datasets.DatasetDict, *splits: str | None) -> None:
    """ValueError naming the first of ``splits`` (None: not wanted) that ``raw`` lacks."""
    for split in splits:
        if split is not None and split not in raw:
            raise ValueError(f"{spec.name}: no split {split!r}; available: {list(raw)}")


def with_eval_split(
    spec: TaskSpec, train: datasets.Dataset, evaluation: datasets.Dataset | None
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """(train, eval): the task's own eval split, or ``holdout_fraction`` of train held out
    with the fixed HOLDOUT_SEED (the eval rows do not move with the run's seed)."""
    if evaluation is not None:
        return train, evaluation
    parts = train.train_test_split(test_size=spec.holdout_fraction, seed=HOLDOUT_SEED)
    return parts["train"], parts["test"]


def _cleaned_splits(
    spec: TaskSpec,
) -> tuple[datasets.Dataset, datasets.Dataset, datasets.Dataset | None, datasets.ClassLabel]:
    """(train, eval, test or None, class label), cleaned, disjoint, before any subsetting.

    The test rows are set aside first (their own split, or carved from train or eval with
    a fixed seed), then the eval split is held out of train when the task has none."""
    raw = _load_raw(spec)
    require_splits(spec, raw, spec.train_split, spec.eval_split, spec.test_split)
    names = _label_names(spec, raw[spec.train_split])
    train = _clean(raw[spec.train_split], spec, names, spec.train_split)
    evaluation = None
    if spec.eval_split is not None:
        evaluation = _clean(raw[spec.eval_split], spec, names, spec.eval_split)
    test = None
    if spec.test_split is not None:
        test = _clean(raw[spec.test_split], spec, names, spec.test_split)
    num_labels = spec.num_labels
    if num_labels is None:
        num_labels = len(names) if names else _max_label(train, spec.label_field) + 1
    for split, ds in (
        (spec.train_split, train), (spec.eval_split, evaluation), (spec.test_split, test)
    ):  # fmt: skip
        if ds is not None and _max_label(ds, spec.label_field) >= num_labels:
            raise ValueError(
                f"{spec.name}/{split}: label {_max_label(ds, spec.label_field)} "
                f"outside [0, {num_labels})"
            )
    train, evaluation, test = held_out_splits(spec, train, evaluation, test)
    label_names = list(names) if names else spec.label_names
    if label_names is not None and len(label_names) != num_labels:
        raise ValueError(f"{spec.name}: {len(label_names)} label names for {num_labels} labels")
    class_label = datasets.ClassLabel(num_classes=num_labels, names=label_names)
    return train, evaluation, test, class_label


def load_task_splits(
    spec: TaskSpec, max_train: int | None = None, max_eval: int | None = None, seed: int = 0
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """(train, eval) datasets with only the text columns and an int ClassLabel column.

    The number of classes is ``ds.features[spec.label_field].num_classes`` (inferred from
    the training labels when ``spec.num_labels`` is None). Subsets are seeded shuffles.
    Rows of the task's test split (``load_task_test``) are in neither.
    """
    train, evaluation, _, class_label = _cleaned_splits(spec)
    train = _subset(train, max_train, seed).cast_column(spec.label_field, class_label)
    evaluation = _subset(evaluation, max_eval, seed).cast_column(spec.label_field, class_label)
    return train, evaluation


def require_test_split(spec: TaskSpec) -> None:
    """ValueError when the task has no held-out test split."""
    if spec.test_split is None and spec.test_from is None:
        raise ValueError(
            f"{spec.name}: no held-out test split (the task names neither test_split nor "
            "test_from; a local folder needs a test.<ext> file)"
        )


def load_task_test(spec: TaskSpec, max_test: int | None = None) -> datasets.Dataset:
    """The held-out test split (a subset of ``max_test`` rows drawn with a fixed seed, so
    every run seed and every method is scored on the same examples)."""
    require_test_split(spec)
    _, _, test, class_label = _cleaned_splits(spec)
    assert test is not None
    return _subset(test, max_test, TEST_SEED).cast_column(spec.label_field, class_label)


def _max_label(ds: datasets.Dataset, label_field: str) -> int:
    """Largest label of a cleaned (index-free) dataset; -1 when empty."""
    top = pc.max(ds.data.column(label_field)).as_py()
    return -1 if top is None else int(top)
