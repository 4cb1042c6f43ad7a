"""Synthetic assets built on the spot, offline: a tiny random BERT and a small sentiment task.

For smoke runs, benchmarks and the tests (``tests/conftest.py`` wraps them in fixtures): a
2-layer BERT (hidden 32) with a word-level vocabulary, and a ``train.jsonl`` /
``validation.jsonl`` task whose label says whether the sentence holds positive or negative
words. Both are deterministic for a given seed. Nothing is downloaded.

    from florg_tools.synthetic import make_sentiment_task, make_tiny_bert

    model = make_tiny_bert(Path("work/tiny-model"))      # --set model=<model>
    task = make_sentiment_task(Path("work/tiny-task"))   # task=local data-path=<task>
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

POSITIVE = ["good", "great", "fine", "happy", "nice", "love", "best", "warm"]
NEGATIVE = ["bad", "awful", "poor", "sad", "nasty", "hate", "worst", "cold"]
NEUTRAL = ["the", "a", "movie", "film", "plot", "actor", "was", "is", "very", "quite", "and"]
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
VOCAB = SPECIAL + POSITIVE + NEGATIVE + NEUTRAL


def tiny_bert_config(num_labels: int = 2, **overrides: Any):
    """The tiny BERT's ``BertConfig``: 2 layers, hidden 32, 2 heads, intermediate 64, a
    vocabulary of ``len(VOCAB)`` words; ``overrides`` replace any of these fields."""
    from transformers import BertConfig

    settings: dict[str, Any] = {
        "vocab_size": len(VOCAB),
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "max_position_embeddings": 64,
        "num_labels": num_labels,
    }
    return BertConfig(**{**settings, **overrides})


def make_tiny_bert(directory: Path, num_labels: int = 2, seed: int = 0) -> Path:
    """A randomly initialised tiny BERT (``tiny_bert_config``) and its word-level tokenizer,
    saved in ``directory`` (created); returns ``directory``."""
    import torch
    from transformers import BertForSequenceClassification, BertTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    vocab = directory / "vocab.txt"
    vocab.write_text("\n".join(VOCAB) + "\n")
    tokenizer = BertTokenizerFast(vocab_file=str(vocab), do_lower_case=True)
    tokenizer.save_pretrained(directory)
    torch.manual_seed(seed)
    BertForSequenceClassification(tiny_bert_config(num_labels)).save_pretrained(directory)
    return directory


def make_sentiment_task(
    directory: Path, n_train: int = 240, n_eval: int = 80, seed: int = 0, n_test: int = 40
) -> Path:
    """train.jsonl / validation.jsonl / test.jsonl (none with ``n_test=0``) with 'sentence'
    and 'label' (1 = more positive words)."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)

    def example() -> dict:
        label = rng.randint(0, 1)
        strong = POSITIVE if label else NEGATIVE
        words = rng.sample(NEUTRAL, 4) + rng.sample(strong, 2)
        rng.shuffle(words)
        return {"sentence": " ".join(words), "label": label}

    for split, n in (("train", n_train), ("validation", n_eval), ("test", n_test)):
        if n == 0:
            continue
        with (directory / f"{split}.jsonl").open("w") as f:
            for _ in range(n):
                f.write(json.dumps(example()) + "\n")
    return directory


def tiny_causal_lm_config(**overrides: Any):
    """The tiny decoder's ``LlamaConfig``: 2 layers, hidden 32, 2 heads, intermediate 64,
    the word-level vocabulary (BOS ``[CLS]``, EOS ``[SEP]``, padding ``[PAD]``); its
    attention projections are ``q_proj`` / ``k_proj`` / ``v_proj`` / ``o_proj`` as in Llama."""
    from transformers import LlamaConfig

    settings: dict[str, Any] = {
        "vocab_size": len(VOCAB),
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "intermediate_size": 64,
        "max_position_embeddings": 128,
        "bos_token_id": VOCAB.index("[CLS]"),
        "eos_token_id": VOCAB.index("[SEP]"),
        "pad_token_id": VOCAB.index("[PAD]"),
        "tie_word_embeddings": True,
    }
    return LlamaConfig(**{**settings, **overrides})


def make_tiny_causal_lm(directory: Path, seed: int = 0) -> Path:
    """A randomly initialised tiny Llama-architecture causal LM (``tiny_causal_lm_config``)
    and its word-level tokenizer, saved in ``directory`` (created); returns ``directory``."""
    import torch
    from transformers import BertTokenizerFast, LlamaForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    vocab = directory / "vocab.txt"
    vocab.write_text("\n".join(VOCAB) + "\n")
    # transformers 5's BertTokenizerFast ignores vocab_file=: pass the vocabulary as vocab=.
    tokenizer = BertTokenizerFast(
        vocab=str(vocab), do_lower_case=True, bos_token="[CLS]", eos_token="[SEP]"
    )
    tokenizer.save_pretrained(directory)
    torch.manual_seed(seed)
    LlamaForCausalLM(tiny_causal_lm_config()).save_pretrained(directory)
    return directory


def make_generative_qa_task(
    directory: Path, n_train: int = 120, n_eval: int = 24, seed: int = 0
) -> Path:
    """train.jsonl / validation.jsonl in the SQuAD schema over the tiny vocabulary: the
    context is a sentiment sentence, the question asks for its strong word, the answer is
    the first one (``task=local data-path=<dir> task-kind=causal-lm text-fields=question,context
    label-field=answers``: generative QA for the tiny causal LM)."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)

    def example(i: int) -> dict:
        strong = rng.sample(POSITIVE if rng.randint(0, 1) else NEGATIVE, 2)
        words = rng.sample(NEUTRAL, 4) + strong
        rng.shuffle(words)
        context = " ".join(words)
        answer = next(w for w in words if w in strong)
        start = context.index(answer)
        return {
            "id": f"g{i}",
            "title": f"topic-{i % 4}",
            "context": context,
            "question": "what is the word",
            "answers": {"text": [answer], "answer_start": [start]},
        }

    for split, n, offset in (("train", n_train, 0), ("validation", n_eval, n_train)):
        with (directory / f"{split}.jsonl").open("w") as f:
            for i in range(n):
                f.write(json.dumps(example(offset + i)) + "\n")
    return directory
