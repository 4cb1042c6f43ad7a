"""The synthetic test assets now live in ``florg_tools.synthetic`` (benchmarks and smoke runs
use them too); tests get them through the fixtures in ``tests/conftest.py``. This module only
re-exports them for helpers that import ``tests.fixtures`` (``tests/deploy_harness.py``)."""

from florg_tools.synthetic import (
    NEGATIVE,
    NEUTRAL,
    POSITIVE,
    SPECIAL,
    VOCAB,
    make_sentiment_task,
    make_tiny_bert,
    tiny_bert_config,
)

__all__ = [
    "NEGATIVE",
    "NEUTRAL",
    "POSITIVE",
    "SPECIAL",
    "VOCAB",
    "make_sentiment_task",
    "make_tiny_bert",
    "tiny_bert_config",
]
