"""Test assets built on the spot, offline: a tiny random BERT and a small local text task."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

POSITIVE = ["good", "great", "fine", "happy", "nice", "love", "best", "warm"]
NEGATIVE = ["bad", "awful", "poor", "sad", "nasty", "hate", "worst", "cold"]
NEUTRAL = ["the", "a", "movie", "film", "plot", "actor", "was", "is", "very", "quite", "and"]
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def make_tiny_bert(directory: Path, num_labels: int = 2, seed: int = 0) -> Path:
    """A randomly initialised 2-layer BERT (hidden 32) with a word-level vocabulary."""
    directory.mkdir(parents=True, exist_ok=True)
    vocab = directory / "vocab.txt"
    vocab.write_text("\n".join(SPECIAL + POSITIVE + NEGATIVE + NEUTRAL) + "\n")
    tokenizer = BertTokenizerFast(vocab_file=str(vocab), do_lower_case=True)
    tokenizer.save_pretrained(directory)
    config = BertConfig(
        vocab_size=len(SPECIAL + POSITIVE + NEGATIVE + NEUTRAL),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        num_labels=num_labels,
    )
    torch.manual_seed(seed)
    BertForSequenceClassification(config).save_pretrained(directory)
    return directory


def make_sentiment_task(
    directory: Path, n_train: int = 240, n_eval: int = 80, seed: int = 0
) -> Path:
    """train.jsonl / validation.jsonl with 'sentence' and 'label' (1 = more positive words)."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)

    def example() -> dict:
        label = rng.randint(0, 1)
        strong = POSITIVE if label else NEGATIVE
        words = rng.sample(NEUTRAL, 4) + rng.sample(strong, 2)
        rng.shuffle(words)
        return {"sentence": " ".join(words), "label": label}

    for split, n in (("train", n_train), ("validation", n_eval)):
        with (directory / f"{split}.jsonl").open("w") as f:
            for _ in range(n):
                f.write(json.dumps(example()) + "\n")
    return directory
