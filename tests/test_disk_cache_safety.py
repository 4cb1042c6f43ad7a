"""Issue 15, item 5: nothing in the on-disk caches is unpickled.

Whoever can write to the cache folder could, with ``torch.load(weights_only=False)``, run
code in every ClientApp. Entries are now safetensors + JSON (models) and Arrow + JSON
(tokenised data); a planted pickle is a damaged entry, rebuilt, never executed."""

from __future__ import annotations

import pickle

import pytest
import torch

from flower_app import disk_cache
from flower_app.config import resolve_config
from flower_app.runtime import cached_adapted_model
from flower_app.task_data import load_task_data, tokenized_split

MARKER_NAME = "pwned"


class _Payload:
    """Unpickling this creates a marker file: proof that cache content ran as code."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture(scope="module")
def tiny(tiny_bert_dir, sentiment_task_dir):
    return tiny_bert_dir, sentiment_task_dir


def _config(tiny, **extra):
    model, task = tiny
    settings = {"model": str(model), "task": "local", "data-path": str(task)}
    return resolve_config({}, {**settings, "text-fields": "sentence", "rank": 2, **extra})


def _all_tensors(adapted):
    tensors = dict(adapted.model.named_parameters())
    tensors.update(adapted.model.named_buffers())
    return tensors


@pytest.mark.parametrize("method", ["florg", "fedex-lora"])
def test_model_cache_holds_only_safetensors_and_json_and_restores_every_tensor(
    tiny, tmp_path, monkeypatch, method
):
    monkeypatch.setenv(disk_cache.DIR_ENV_VAR, str(tmp_path))
    build = cached_adapted_model.__wrapped__  # the disk-cached builder, below lru_cache
    config = _config(tiny, method=method, **{"subtract-init": method == "florg"})
    labels = load_task_data(config).num_labels
    before = dict(disk_cache.STATS)
    fresh, hit = build(config, labels), build(config, labels)
    assert disk_cache.STATS["hits"] - before["hits"] == 1
    files = sorted(p.name for p in (tmp_path / "models").rglob("*") if p.is_file())
    assert files == ["meta.json", "tensors.safetensors"]
    a, b = _all_tensors(fresh), _all_tensors(hit)
    assert a.keys() == b.keys()
    for name in a:  # parameters and buffers, FLoRG's L and R (non-persistent) included
        assert torch.equal(a[name], b[name]), name
    assert fresh.fingerprint() == hit.fingerprint()
    assert fresh.held_tensors.keys() == hit.held_tensors.keys()
    for group, held in fresh.held_tensors.items():  # FedEx-LoRA's pristine base weights
        for name, w0 in held.items():
            assert torch.equal(w0, hit.held_tensors[group][name]), (group, name)


def test_a_planted_pickle_is_never_executed(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv(disk_cache.DIR_ENV_VAR, str(tmp_path / "cache"))
    marker = tmp_path / MARKER_NAME
    build = cached_adapted_model.__wrapped__
    config = _config(tiny)
    labels = load_task_data(config).num_labels
    reference = build(config, labels)
    tokenized_split.__wrapped__(config, "train", 0, 2)
    # An attacker with write access replaces every cached file by a malicious pickle.
    planted = 0
    for path in (tmp_path / "cache").rglob("*"):
        if path.is_file():
            path.write_bytes(pickle.dumps(_Payload(str(marker))))
            planted += 1
    assert planted >= 3
    before = dict(disk_cache.STATS)
    rebuilt = build(config, labels)
    data = tokenized_split.__wrapped__(config, "train", 0, 2)
    assert not marker.exists(), "cache content was unpickled and ran"
    assert disk_cache.STATS["errors"] - before["errors"] >= 1
    assert len(data) == 120
    a, b = _all_tensors(reference), _all_tensors(rebuilt)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # and the entry was rewritten cleanly: the next call is a hit
    build(config, labels)
    assert disk_cache.STATS["hits"] - before["hits"] >= 1
    assert not marker.exists()
