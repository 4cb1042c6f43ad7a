"""Extractive-QA features: question + context windows with start/end token positions.

The standard Hugging Face preprocessing: the question and the context are tokenised as a pair,
truncating only the context (``only_second``) to ``max_length`` tokens; a long context becomes
several windows (features) that overlap by ``doc_stride`` tokens. Each feature gets the token
positions of its example's first answer, or the CLS index (0 when the tokenizer has no CLS
token) when the answer is not wholly inside the window. For evaluation every feature also keeps
``example_index`` (its row in the examples) and ``context_offsets`` (each token's (start, end)
character span in the context, (-1, -1) outside it). Questions longer than
``max_question_tokens(max_length)`` tokens are cut (as BERT's ``max_query_length``) so that
every window has room for context and stride."""

from __future__ import annotations

from typing import Any

import datasets

from flower_app.data.tokenize import MODEL_INPUTS

POSITIONS = ("start_positions", "end_positions")
EXAMPLE_INDEX = "example_index"
CONTEXT_OFFSETS = "context_offsets"
NO_OFFSET = (-1, -1)


def max_question_tokens(max_length: int) -> int:
    """Question budget in tokens: BERT's 64, at most a quarter of the window."""
    return max(1, min(64, max_length // 4))


def check_window(tokenizer: Any, max_length: int, doc_stride: int) -> None:
    """Raise ValueError unless every window keeps room for more than ``doc_stride``
    context tokens after the longest allowed question and the special tokens."""
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            f"extractive QA needs a fast tokenizer (offset mappings); "
            f"{type(tokenizer).__name__} is not one"
        )
    if doc_stride < 0:
        raise ValueError(f"doc-stride must be >= 0, got {doc_stride}")
    room = max_length - max_question_tokens(max_length) - tokenizer.num_special_tokens_to_add(True)
    if room <= doc_stride:
        raise ValueError(
            f"doc-stride {doc_stride} leaves no new context per window: with max-seq-length "
            f"{max_length} a window has room for {room} context tokens; use doc-stride < {room} "
            "or a larger max-seq-length"
        )


def _cut_questions(questions: list[str], tokenizer: Any, limit: int) -> list[str]:
    """Questions without leading spaces, cut to at most ``limit`` tokens (at a token end)."""
    questions = [q.lstrip() for q in questions]
    enc = tokenizer(questions, add_special_tokens=False, return_offsets_mapping=True)
    out = []
    for question, offsets in zip(questions, enc["offset_mapping"], strict=True):
        out.append(question if len(offsets) <= limit else question[: offsets[limit - 1][1]])
    return out


def _answer_span(
    offsets: list[tuple[int, int]], context_tokens: tuple[int, int], start: int, end: int
) -> tuple[int, int] | None:
    """Token positions (first, last) covering characters [start, end), or None when the
    answer is not wholly inside the window's context tokens."""
    first, last = context_tokens
    if not (offsets[first][0] <= start and offsets[last][1] >= end):
        return None
    token_start = first
    while token_start <= last and offsets[token_start][0] <= start:
        token_start += 1
    token_end = last
    while token_end >= first and offsets[token_end][1] >= end:
        token_end -= 1
    return token_start - 1, token_end + 1


def qa_features(
    examples: datasets.Dataset,
    tokenizer: Any,
    max_length: int,
    doc_stride: int,
    *,
    keep_mapping: bool = False,
    question_field: str = "question",
    context_field: str = "context",
    answers_field: str = "answers",
) -> datasets.Dataset:
    """Features of ``examples`` (one or more per example) with the model inputs padded to
    ``max_length``, ``start_positions``/``end_positions`` and, with ``keep_mapping``,
    ``example_index`` and ``context_offsets``; plain lists (no tensor format)."""
    check_window(tokenizer, max_length, doc_stride)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError("tokenizer has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    question_first = tokenizer.padding_side == "right"
    context_seq = 1 if question_first else 0
    limit = max_question_tokens(max_length)

    def encode(batch: dict[str, list[Any]], indices: list[int]) -> dict[str, list[Any]]:
        questions = _cut_questions(batch[question_field], tokenizer, limit)
        contexts = batch[context_field]
        pair = (questions, contexts) if question_first else (contexts, questions)
        enc = tokenizer(
            *pair,
            truncation="only_second" if question_first else "only_first",
            max_length=max_length,
            stride=doc_stride,
            return_overflowing_tokens=True,
            return_offsets_mapping=True,
            padding="max_length",
        )
        sample_map = enc.pop("overflow_to_sample_mapping")
        out: dict[str, list[Any]] = {k: enc[k] for k in MODEL_INPUTS if k in enc}
        starts, ends, example_index, context_offsets = [], [], [], []
        for i, offsets in enumerate(enc["offset_mapping"]):
            ids = enc["input_ids"][i]
            cls_index = ids.index(tokenizer.cls_token_id) if tokenizer.cls_token_id in ids else 0
            sequence_ids = enc.sequence_ids(i)
            context_tokens = [k for k, s in enumerate(sequence_ids) if s == context_seq]
            sample = sample_map[i]
            gold = batch[answers_field][sample]
            span = None
            if context_tokens and gold["text"]:
                start = int(gold["answer_start"][0])
                end = start + len(gold["text"][0])
                span = _answer_span(offsets, (context_tokens[0], context_tokens[-1]), start, end)
            starts.append(cls_index if span is None else span[0])
            ends.append(cls_index if span is None else span[1])
            if keep_mapping:
                example_index.append(indices[sample])
                context_offsets.append(
                    [
                        tuple(o) if s == context_seq else NO_OFFSET
                        for o, s in zip(offsets, sequence_ids, strict=True)
                    ]
                )
        out["start_positions"], out["end_positions"] = starts, ends
        if keep_mapping:
            out[EXAMPLE_INDEX] = example_index
            out[CONTEXT_OFFSETS] = context_offsets
        return out

    return examples.map(
        encode,
        batched=True,
        batch_size=256,
        with_indices=True,
        remove_columns=examples.column_names,
        desc="QA features",
    )
