"""A held-out test split for SQuAD-schema data (flower_app/data/qa_loading.py): carved with
a fixed seed before validation draws from the rest, so ``squad-gen`` gets test scores whose
questions no run trains or tunes on."""

from __future__ import annotations

from dataclasses import replace

import pytest

from florg_tools.synthetic import make_generative_qa_task
from flower_app.data import sft
from flower_app.data.qa_loading import load_qa_splits, load_qa_test
from flower_app.data.tasks import TASKS
from flower_app.task_kinds import get_kind

N_TRAIN, N_EVAL, TEST_SIZE = 40, 20, 6


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    """squad-gen's spec (test carved from the eval split) over a small local copy."""
    folder = make_generative_qa_task(tmp_path_factory.mktemp("qa"), N_TRAIN, N_EVAL)
    return replace(
        TASKS["squad-gen"], asset=None, hub_fallback=None, local_dir=str(folder),
        test_size=TEST_SIZE,
    )  # fmt: skip


def ids(ds) -> set[str]:
    return set(ds["id"])


def test_squad_gen_carves_its_test_from_squads_dev_split():
    assert TASKS["squad-gen"].test_from == "eval"
    assert TASKS["squad"].test_from is None  # extractive QA is unchanged


def test_the_test_questions_are_in_neither_training_nor_validation(spec):
    test = load_qa_test(spec)
    assert len(test) == TEST_SIZE
    for seed in (0, 1):
        train, evaluation = load_qa_splits(spec, seed=seed)
        assert len(train) == N_TRAIN and len(evaluation) == N_EVAL - TEST_SIZE
        assert not ids(test) & (ids(train) | ids(evaluation))
        assert ids(test) | ids(evaluation) == {f"g{N_TRAIN + i}" for i in range(N_EVAL)}


def test_the_test_subset_is_the_same_for_every_run_seed(spec):
    first = load_qa_test(spec, max_test=4)
    assert len(first) == 4 and ids(first) <= ids(load_qa_test(spec))
    assert first["id"] == load_qa_test(spec, max_test=4)["id"]


def test_causal_lm_scores_the_test_questions_as_sft_examples(spec):
    examples = get_kind("causal-lm").load_test(spec, max_test=None)
    assert len(examples) == TEST_SIZE
    golds = load_qa_test(spec)["answers"]
    assert examples[sft.ANSWERS] == [list(a["text"]) for a in golds]
    assert all(p.rstrip().endswith("Answer:") for p in examples[sft.PROMPT])


def test_a_task_without_a_test_split_says_so(spec):
    plain = replace(spec, test_from=None)
    with pytest.raises(ValueError, match="no held-out test split"):
        load_qa_test(plain)
    with pytest.raises(ValueError, match="no held-out test split"):
        get_kind("causal-lm").load_test(plain, max_test=10)


def test_too_few_rows_to_carve_is_a_clear_error(spec):
    with pytest.raises(ValueError, match="too few to carve"):
        load_qa_test(replace(spec, test_size=N_EVAL))
