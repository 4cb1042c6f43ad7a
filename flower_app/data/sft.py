"""Instruction data for causal-LM fine-tuning: (prompt, response) examples and their features,
the loss on response tokens only.

``sft_examples`` gives rows ``prompt``, ``response``, ``answers`` (the gold answers generation is
scored against; empty when the task has no short answers) and ``bucket`` (the pseudo-label a
Dirichlet partition skews over) from three sources: the SQuAD schema (e.g. ``squad-gen``), a
classification task (e.g. ``snli-gen``: the label's name) and instructions (Alpaca / FlowerTune,
``prompt_format`` ``alpaca`` or ``flowertune``). ``sft_features`` tokenises the prompt (``plain``
or ``chat``), the response and EOS, padded to ``max_length``; ``labels`` are -100 on the prompt
and the padding. docs/usage.md, "Causal-LM fine-tuning", has each source's prompt and bucket."""

from __future__ import annotations

import zlib
from typing import Any

import datasets

IGNORE = -100  # label of a token the loss skips (the prompt, the padding)
PROMPT, RESPONSE, ANSWERS, BUCKET = "prompt", "response", "answers", "bucket"
BUCKETS = 10
TEMPLATES = ("plain", "chat")


def squad_prompt(context: str, question: str) -> str:
    return f"Context: {context}\nQuestion: {question.strip()}\nAnswer:"


def choice_prompt(texts: list[str], fields: tuple[str, ...], names: list[str]) -> str:
    lines = [f"{field.capitalize()}: {text}" for field, text in zip(fields, texts, strict=True)]
    return "\n".join([*lines, f"Answer with one of: {', '.join(names)}.", "Answer:"])


def alpaca_prompt(instruction: str, given: str) -> str:
    """The Alpaca template (with or without its input section)."""
    if given.strip():
        return f"### Instruction:\n{instruction}\n\n### Input:\n{given}\n\n### Response:\n"
    return f"### Instruction:\n{instruction}\n\n### Response:\n"


# The FlowerTune LLM templates' prompt (examples/flowertune-llm-*/*/dataset.py in
# flwrlabs/flower): a fixed preamble, the instruction, then the response after
# "### Response:", the tag their completion-only collator starts the loss after.
FLOWERTUNE_PREAMBLE = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request."
)
PROMPT_FORMATS = ("alpaca", "flowertune")


def flowertune_prompt(instruction: str) -> str:
    """The FlowerTune templates' prompt up to the response tag; the response follows it
    after one space (``### Response: {output}``)."""
    return f"{FLOWERTUNE_PREAMBLE}\n### Instruction:\n{instruction}\n### Response:"


def _bucket(text: str) -> int:
    return zlib.crc32(text.encode("utf-8")) % BUCKETS


def from_squad(ds: datasets.Dataset, bucket_column: str) -> datasets.Dataset:
    """SQuAD-schema rows (``qa_loading``'s, with their title bucket) as SFT examples."""

    def convert(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        golds = [list(a["text"]) for a in batch["answers"]]
        return {
            PROMPT: [
                squad_prompt(c, q) for c, q in zip(batch["context"], batch["question"], strict=True)
            ],
            RESPONSE: [" " + g[0] for g in golds],
            ANSWERS: golds,
            BUCKET: [int(b) for b in batch[bucket_column]],
        }

    return ds.map(convert, batched=True, remove_columns=ds.column_names, desc="squad -> sft")


def from_classification(
    ds: datasets.Dataset, text_fields: tuple[str, ...], label_field: str
) -> datasets.Dataset:
    """Labelled rows (an int ClassLabel with names) as SFT examples: the label as a word."""
    names = ds.features[label_field].names
    if not names or all(n == str(i) for i, n in enumerate(names)):
        raise ValueError(f"label column {label_field!r} has no label names to generate")

    def convert(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        rows = list(zip(*(batch[f] for f in text_fields), strict=True))
        labels = [int(y) for y in batch[label_field]]
        return {
            PROMPT: [choice_prompt(list(r), text_fields, names) for r in rows],
            RESPONSE: [" " + names[y] for y in labels],
            ANSWERS: [[names[y]] for y in labels],
            BUCKET: labels,
        }

    return ds.map(convert, batched=True, remove_columns=ds.column_names, desc="labels -> sft")


def from_instructions(
    ds: datasets.Dataset,
    text_fields: tuple[str, ...],
    output_field: str,
    prompt_format: str = "alpaca",
) -> datasets.Dataset:
    """Alpaca / FlowerTune rows (instruction[, input], output) as SFT examples, the prompt
    laid out by ``prompt_format`` (module docstring)."""
    if prompt_format not in PROMPT_FORMATS:
        raise ValueError(f"prompt format must be one of {PROMPT_FORMATS}, got {prompt_format!r}")
    missing = [c for c in (*text_fields, output_field) if c not in ds.column_names]
    if missing:
        raise ValueError(f"missing column(s) {missing}; available: {ds.column_names}")
    instruction = text_fields[0]
    given = text_fields[1] if len(text_fields) > 1 else None

    def convert(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        n = len(batch[instruction])
        inputs = [str(x or "") for x in batch[given]] if given else [""] * n
        pairs = list(zip(batch[instruction], inputs, strict=True))
        if prompt_format == "flowertune":
            # as the templates do: instruction + " " + input where the track uses both
            joined = [" ".join([str(i), x]) if given else str(i) for i, x in pairs]
            prompts = [flowertune_prompt(text) for text in joined]
            responses = [" " + str(o) for o in batch[output_field]]
        else:
            prompts = [alpaca_prompt(str(i), x) for i, x in pairs]
            responses = [str(o) for o in batch[output_field]]
        return {
            PROMPT: prompts,
            RESPONSE: responses,
            ANSWERS: [[] for _ in range(n)],
            BUCKET: [_bucket(str(i)) for i in batch[instruction]],
        }

    return ds.map(convert, batched=True, remove_columns=ds.column_names, desc="alpaca -> sft")


def prompt_ids(tokenizer: Any, prompt: str, template: str) -> list[int]:
    """The prompt's token ids under ``template``: ``plain`` (BOS where the tokenizer starts
    a text with it, then the text) or ``chat`` (the tokenizer's chat template, the prompt as
    the user's message, ending where the assistant's reply starts). ValueError for a chat
    template the tokenizer lacks."""
    if template == "chat":
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"the tokenizer ({type(tokenizer).__name__}) has no chat template; "
                "use prompt-template=plain"
            )
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt.strip()}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # a BatchEncoding
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    if template != "plain":
        raise ValueError(f"prompt template must be one of {TEMPLATES}, got {template!r}")
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    return ([tokenizer.bos_token_id] if adds_bos(tokenizer) else []) + list(ids)


def adds_bos(tokenizer: Any) -> bool:
    """Whether the tokenizer starts a text with its BOS token (Llama's ``<s>``, Llama 3's
    ``<|begin_of_text|>``; SmolLM2 and GPT-2 add none)."""
    bos = tokenizer.bos_token_id
    return bos is not None and tokenizer("a")["input_ids"][:1] == [bos]


def response_ids(tokenizer: Any, response: str, template: str) -> list[int]:
    """The response's token ids and EOS (a chat reply starts without the leading space)."""
    text = response.lstrip() if template == "chat" else response
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]


def pack_pair(
    prompt: list[int], response: list[int], max_length: int, pad_id: int
) -> dict[str, list[int]]:
    """input_ids, attention_mask and labels (-100 on the prompt and the padding) of one
    (prompt, response) pair, right-padded to ``max_length``; the response keeps at most half
    of the length, the prompt is cut from the left."""
    response = response[: max(1, max_length // 2)]
    prompt = prompt[max(0, len(prompt) - (max_length - len(response))) :]
    ids = prompt + response
    pad = max_length - len(ids)
    return {
        "input_ids": ids + [pad_id] * pad,
        "attention_mask": [1] * len(ids) + [0] * pad,
        "labels": [IGNORE] * len(prompt) + response + [IGNORE] * pad,
    }


def sft_features(
    examples: datasets.Dataset, tokenizer: Any, max_length: int, template: str
) -> datasets.Dataset:
    """The training features of SFT examples (module docstring), in torch format."""
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no EOS token to end a response with")
    pad_id = (
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    )

    def encode(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        rows = [
            pack_pair(
                prompt_ids(tokenizer, p, template),
                response_ids(tokenizer, r, template),
                max_length,
                pad_id,
            )
            for p, r in zip(batch[PROMPT], batch[RESPONSE], strict=True)
        ]
        return {k: [row[k] for row in rows] for k in ("input_ids", "attention_mask", "labels")}

    features = examples.map(
        encode, batched=True, remove_columns=examples.column_names, desc="sft features"
    )
    return features.with_format("torch")
