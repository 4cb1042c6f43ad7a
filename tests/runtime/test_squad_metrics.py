"""Hand-checked cases for the SQuAD v1.1 metrics."""

from __future__ import annotations

import pytest

from flower_app.task_kinds.squad_metrics import (
    evaluate_predictions,
    exact_match,
    f1_score,
    normalize_answer,
)


def test_normalize_lowercases_and_drops_articles() -> None:
    assert normalize_answer("The Cat") == "cat"
    assert normalize_answer("A dog and AN apple") == "dog and apple"


def test_normalize_articles_only_as_whole_words() -> None:
    assert normalize_answer("theatre anthem") == "theatre anthem"
    assert normalize_answer("Theory of a thing") == "theory of thing"


def test_normalize_punctuation_and_whitespace() -> None:
    assert normalize_answer("  Hello,   world!!  ") == "hello world"
    assert normalize_answer("U.S.A.\t(1776)\n") == "usa 1776"
    assert normalize_answer("rock-n-roll's") == "rocknrolls"


def test_exact_match_articles() -> None:
    assert exact_match("The Cat", ["cat"]) == 1.0
    assert exact_match("a cat.", ["The cat"]) == 1.0
    assert exact_match("cats", ["cat"]) == 0.0


def test_exact_match_takes_max_over_golds() -> None:
    assert exact_match("Paris", ["London", "paris", "Berlin"]) == 1.0
    assert exact_match("Rome", ["London", "paris"]) == 0.0


def test_f1_partial_overlap_by_hand() -> None:
    # [big, red, dog] vs [red, dog, house]: common 2, P = R = 2/3, F1 = 2/3.
    assert f1_score("the big red dog", ["red dog house"]) == pytest.approx(2 / 3)


def test_f1_unequal_lengths_by_hand() -> None:
    # [red, dog] vs [big, red, dog, house]: common 2, P = 1, R = 1/2, F1 = 2/3.
    assert f1_score("red dog", ["big red dog house"]) == pytest.approx(2 / 3)
    # Repeated tokens count by multiplicity: [dog, dog] vs [dog]: common 1,
    # P = 1/2, R = 1, F1 = 2/3.
    assert f1_score("dog dog", ["dog"]) == pytest.approx(2 / 3)


def test_f1_takes_max_over_golds() -> None:
    golds = ["house", "red dog house", "big red dog"]
    assert f1_score("the big red dog", golds) == pytest.approx(1.0)
    assert f1_score("big dog", ["dog", "cat"]) == pytest.approx(2 / 3)


def test_f1_no_overlap_is_zero() -> None:
    assert f1_score("blue whale", ["red dog"]) == 0.0


def test_empty_strings() -> None:
    assert f1_score("", ["red dog"]) == 0.0
    assert f1_score("red dog", [""]) == 0.0
    # As in the official v1.1 script: no common token means F1 = 0, even when both
    # sides are empty, while exact match compares the normalised strings.
    assert f1_score("", [""]) == 0.0
    assert f1_score("The!", ["a"]) == 0.0
    assert exact_match("", [""]) == 1.0
    assert exact_match("The!", [""]) == 1.0
    assert exact_match("", ["dog"]) == 0.0
    assert exact_match("dog", []) == 0.0
    assert f1_score("dog", []) == 0.0


def _row(row_id: str, texts: list[str]) -> dict[str, object]:
    return {
        "id": row_id,
        "title": "t",
        "context": "c",
        "question": "q",
        "answers": {"text": texts, "answer_start": [0] * len(texts)},
    }


def test_evaluate_predictions_three_rows_one_missing() -> None:
    rows = [
        _row("q1", ["The Cat", "a cat"]),  # exact: EM 1, F1 1
        _row("q2", ["red dog house"]),  # partial: EM 0, F1 2/3
        _row("q3", ["Paris"]),  # no prediction: 0, 0
    ]
    predictions = {"q1": "cat", "q2": "the big red dog", "unused": "x"}
    result = evaluate_predictions(rows, predictions)
    assert result["count"] == 3
    assert result["missing"] == 1
    assert result["exact_match"] == pytest.approx(100.0 / 3)
    assert result["f1"] == pytest.approx(100.0 * (1 + 2 / 3) / 3)


def test_evaluate_predictions_all_correct_and_empty() -> None:
    rows = [_row("a", ["one"]), _row("b", ["two", "2"])]
    result = evaluate_predictions(rows, {"a": "One.", "b": "2"})
    assert result == {"exact_match": 100.0, "f1": 100.0, "count": 2, "missing": 0}
    assert evaluate_predictions([], {}) == {
        "exact_match": 0.0,
        "f1": 0.0,
        "count": 0,
        "missing": 0,
    }
