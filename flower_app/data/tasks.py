"""Task specifications (where a task's data lives, its columns and its kind): the Hub,
fetched assets, local files. What a kind does with them: flower_app/task_kinds/."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

from flower_app.cache import assets as asset_registry

FILE_FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


@dataclass(frozen=True)
class TaskSpec:
    """Where a task's data lives and which columns hold texts and labels.

    Exactly one source: ``hub_path`` (+ ``hub_config``), ``local_dir`` (files named
    ``<split>.<ext>``), ``data_file`` (one file; a seeded holdout becomes the eval split),
    or ``asset`` (a fetched dataset, resolved to ``local_dir`` by ``resolve_task``; when it
    is not fetched, ``hub_fallback`` names the Hub dataset to read instead).

    ``kind`` names its task kind (flower_app/task_kinds/, which checks the spec fits):
    ``classification`` (texts + an integer label) or ``extractive-qa`` (SQuAD schema:
    ``text_fields`` = (question, context) and ``label_field`` = the answers column
    ``{"text": [...], "answer_start": [...]}``; ``num_labels`` is unused).

    The held-out test split (reported scores; never trained on, never used for tuning):
    ``test_split`` names a labelled split of its own (SNLI's ``test``); otherwise
    ``test_from`` (``"train"`` or ``"eval"``) names the split that ``test_size`` rows are
    carved from, with a fixed seed, before anything else is drawn from it, so the test
    rows never reach training or validation. A task with neither has no test split.
    """

    name: str
    text_fields: tuple[str, ...]
    label_field: str = "label"
    num_labels: int | None = 2  # None: inferred from the training labels
    train_split: str = "train"
    eval_split: str | None = "validation"  # None: hold out ``holdout_fraction`` of train
    hub_path: str | None = None
    hub_config: str | None = None
    local_dir: str | None = None
    data_file: str | None = None
    asset: str | None = None
    label_names: tuple[str, ...] | None = None
    holdout_fraction: float = 0.1
    kind: str = "classification"
    hub_fallback: str | None = None
    test_split: str | None = None
    test_from: str | None = None  # "train" or "eval": carve the test split from it
    test_size: int = 2000
    prompt_format: str = "alpaca"  # instruction data's prompt (flower_app/data/sft.py)

    def __post_init__(self) -> None:
        if not 1 <= len(self.text_fields) <= 2:
            raise ValueError(f"{self.name}: text-fields must name one or two columns")
        if self.test_from not in (None, "train", "eval"):
            raise ValueError(f"{self.name}: test_from must be 'train' or 'eval'")
        if self.test_split is not None and self.test_from is not None:
            raise ValueError(f"{self.name}: give test_split or test_from, not both")
        sources = [self.hub_path, self.local_dir, self.data_file, self.asset]
        if sum(s is not None for s in sources) != 1:
            raise ValueError(
                f"{self.name}: give exactly one of hub_path, local_dir, data_file, asset"
            )


def _glue(
    name: str, text_fields: tuple[str, ...], num_labels: int = 2, eval_split: str = "validation"
) -> TaskSpec:
    return TaskSpec(
        name,
        text_fields,
        num_labels=num_labels,
        eval_split=eval_split,
        hub_path="nyu-mll/glue",
        hub_config=name,
    )


def _squad(name: str, **source: str) -> TaskSpec:
    """SQuAD v1.1 (HF ``squad`` schema: id, title, context, question, answers)."""
    return TaskSpec(
        name,
        ("question", "context"),
        label_field="answers",
        num_labels=None,
        kind="extractive-qa",
        **source,  # type: ignore[arg-type]
    )


# (Hub path, the text fields the FlowerTune template of its track joins into the
# instruction; the prompt's layout is the setting prompt-format, 'flowertune' in the presets)
FLOWERTUNE_DATA = (
    ("flwrlabs/alpaca-gpt4", ("instruction",)),
    ("flwrlabs/fingpt-sentiment-train", ("instruction", "input")),
    ("flwrlabs/medical-meadow-medical-flashcards", ("input",)),
    ("flwrlabs/code-alpaca-20k", ("instruction", "input")),
)


def _flowertune(hub_path: str, text_fields: tuple[str, ...]) -> TaskSpec:
    """A FlowerTune data set: train only, and all of it trains (as in the leaderboard), so
    the server's validation reads rows of the training split itself (``eval_split``
    ``train``: an in-sample response loss; the leaderboard's scores are its own scripts')."""
    return TaskSpec(
        hub_path,
        text_fields,
        label_field="output",
        num_labels=None,
        eval_split="train",
        hub_path=hub_path,
        kind="causal-lm",
    )


TASKS: dict[str, TaskSpec] = {
    t.name: t
    for t in (
        _glue("mrpc", ("sentence1", "sentence2")),
        _glue("qqp", ("question1", "question2")),
        _glue("mnli", ("premise", "hypothesis"), 3, "validation_matched"),
        _glue("qnli", ("question", "sentence")),
        _glue("wnli", ("sentence1", "sentence2")),
        _glue("rte", ("sentence1", "sentence2")),
        TaskSpec(
            "snli",
            ("premise", "hypothesis"),
            num_labels=3,
            asset="snli",
            test_split="test",
            label_names=("entailment", "neutral", "contradiction"),
        ),
        TaskSpec(
            "squad-qnli",
            ("question", "sentence"),
            asset="squad-qnli",
            test_from="eval",  # SQuAD dev articles: disjoint from the training articles
            label_names=("entailment", "not_entailment"),
        ),
        TaskSpec(
            "movie-sentiment",
            ("sentence",),
            asset="movie-sentiment",
            test_from="train",
            label_names=("negative", "positive"),
        ),
        _squad("squad", asset="squad", hub_fallback="rajpurkar/squad"),
        # Causal-LM (generative) versions: flower_app/task_kinds/causal_lm.py.
        # squad-gen's held-out test: 2,000 questions carved from SQuAD's dev split (seeded,
        # before validation draws from the rest), so its articles never reach training; test
        # and validation questions may share a dev article's context.
        replace(
            _squad("squad-gen", asset="squad", hub_fallback="rajpurkar/squad"),
            kind="causal-lm",
            test_from="eval",
        ),
        TaskSpec(
            "snli-gen",
            ("premise", "hypothesis"),
            num_labels=3,
            asset="snli",
            test_split="test",
            label_names=("entailment", "neutral", "contradiction"),
            kind="causal-lm",
        ),
        # FlowerTune's general-NLP instruction data (the Hub): instruction, input, output.
        TaskSpec(
            "vicgalle/alpaca-gpt4",
            ("instruction", "input"),
            label_field="output",
            num_labels=None,
            eval_split=None,  # train only: a seeded holdout_fraction becomes the eval split
            hub_path="vicgalle/alpaca-gpt4",
            kind="causal-lm",
        ),
        _squad("rajpurkar/squad", hub_path="rajpurkar/squad"),
        # The FlowerTune LLM leaderboard's four data sets (the Hub;
        # flower_app/preflight/leaderboard.py):
        # instruction, input, output. Which columns make the instruction is the run's
        # text-fields (its presets, conf/flowertune-*.toml, set the templates' mapping).
        *(_flowertune(path, fields) for path, fields in FLOWERTUNE_DATA),
    )
}


def _local_spec(
    name: str,
    path: Path,
    text_fields: tuple[str, ...] | None,
    label_field: str | None,
    base: TaskSpec | None,
    **overrides: object,
) -> TaskSpec:
    if not path.exists():
        raise FileNotFoundError(f"data path {path} does not exist")
    if path.is_file() and path.suffix not in FILE_FORMATS:
        raise ValueError(f"{path}: unsupported file type; use one of {', '.join(FILE_FORMATS)}")
    fields = text_fields or (base.text_fields if base else None)
    if not fields:
        raise ValueError(
            f"{path}: set text-fields to its text column, or two: text-fields=column_a,column_b"
        )
    location: dict[str, object] = (
        {"local_dir": str(path)} if path.is_dir() else {"data_file": str(path)}
    )
    # Local data has a test split only when a folder holds a test.<ext> file (no carving).
    has_test = path.is_dir() and any((path / f"test{ext}").is_file() for ext in FILE_FORMATS)
    location |= {"test_split": "test" if has_test else None, "test_from": None}
    if base is None:
        kwargs = (
            {
                "label_field": label_field or "label",
                "num_labels": None,
                "eval_split": None if path.is_file() else "validation",
            }
            | location
            | overrides
        )
        return TaskSpec(name, tuple(fields), **kwargs)  # type: ignore[arg-type]
    if path.is_file():
        overrides.setdefault("eval_split", None)
    cleared = dict.fromkeys(
        ("hub_path", "hub_config", "asset", "local_dir", "data_file", "hub_fallback")
    )
    changes = (
        cleared
        | location
        | {"text_fields": tuple(fields), "label_field": label_field or base.label_field}
        | overrides
    )
    return replace(base, **changes)  # type: ignore[arg-type]


def resolve_task(
    name: str,
    data_path: str | os.PathLike[str] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    text_fields: tuple[str, ...] | list[str] | str | None = None,
    label_field: str | None = None,
    **overrides: object,
) -> TaskSpec:
    """Spec of a known task, or of local data (a folder of ``<split>.<ext>`` files or one
    json/jsonl/csv/parquet file) given as ``data_path`` or as ``name`` itself.

    ``overrides`` are TaskSpec fields (num_labels, train_split, eval_split, label_names, ...).
    A known task with ``data_path`` keeps its columns but reads the local data.
    """
    if isinstance(text_fields, str):
        text_fields = (text_fields,)
    fields = tuple(text_fields) if text_fields else None
    base = TASKS.get(name)
    if data_path is None and base is None and Path(name).exists():
        data_path, name = name, Path(name).stem
    if data_path is not None:
        return _local_spec(
            name, Path(data_path).expanduser(), fields, label_field, base, **overrides
        )
    if base is None:
        raise ValueError(
            f"unknown task {name!r}; known tasks: {', '.join(TASKS)} "
            "(or pass a local folder/file as data_path)"
        )
    spec = replace(base, **overrides) if overrides else base  # type: ignore[arg-type]
    if fields or label_field:
        spec = replace(
            spec,
            text_fields=fields or spec.text_fields,
            label_field=label_field or spec.label_field,
        )
    if spec.asset is not None:
        try:
            directory = asset_registry.task_info(spec.asset, cache_dir)["path"]
        except FileNotFoundError:
            if spec.hub_fallback is None or os.environ.get("HF_HUB_OFFLINE") == "1":
                raise
            return replace(spec, asset=None, hub_path=spec.hub_fallback, hub_fallback=None)
        spec = replace(spec, asset=None, local_dir=directory, hub_fallback=None)
    return spec
