"""The per-process tokenizer cache, shared by the data side (tokenisation,
flower_app/task_data.py) and the model side (the pad token, flower_app/cache/per_process.py), so
neither imports the other."""

from __future__ import annotations

from functools import lru_cache

from flower_app.modeling import load_tokenizer

__all__ = ["cached_tokenizer"]


@lru_cache(maxsize=4)
def cached_tokenizer(model_name: str):
    return load_tokenizer(model_name)
