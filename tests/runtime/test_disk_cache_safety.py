"""Issue 15, item 5: nothing in the on-disk caches is unpickled.

Whoever can write to the cache folder could, with ``torch.load(weights_only=False)``, run
code in every ClientApp. Entries are now safetensors + JSON (models) and Arrow + JSON
(tokenised data); a planted pickle is a damaged entry, rebuilt, never executed."""

from __future__ import annotations

import dataclasses
import os
import pickle
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from flower_app import task_data
from flower_app.cache import disk as disk_cache
from flower_app.cache import keys as cache_keys
from flower_app.cache.per_process import cached_adapted_model
from flower_app.methods.registry import method_sources
from flower_app.settings.config import DATA, MODEL, TOKENISATION, resolve_config, schema, to_attr
from flower_app.task_data import load_task_data, tokenized_split

MARKER_NAME = "pwned"
ROOT = Path(__file__).resolve().parents[2]


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


# -- issue 14: the keys derive from the settings' groups and the builders' code -----------


def _other_value(key: str, value: object) -> object:
    """A different value of the setting's type (the key is computed, never validated)."""
    spec = schema()[key]
    options = getattr(spec.check, "options", None)
    if options:
        return next(o for o in options if o != value)
    if spec.kind is bool:
        return not value
    if spec.kind in (int, float):
        return value + 1
    return f"{value}-other"


def _captured_keys(monkeypatch, tiny, tmp_path):
    """(model key, tokenised-split key) of a config, from the real decorated builders,
    with the entry lookup replaced by a recorder (nothing is built or read)."""
    monkeypatch.setenv(disk_cache.DIR_ENV_VAR, str(tmp_path))
    keys: list[str] = []
    monkeypatch.setattr(disk_cache, "_model_entry", lambda root, key, build: keys.append(key))
    monkeypatch.setattr(disk_cache, "_dataset_entry", lambda root, key, build: keys.append(key))
    monkeypatch.setattr(disk_cache, "_model_identity", lambda model: model)
    one_task = types.SimpleNamespace(local_dir=None, data_file=None)  # the key's source part
    monkeypatch.setattr(task_data, "task_spec", lambda config: one_task)

    def keys_of(config):
        keys.clear()
        cached_adapted_model.__wrapped__(config, 2)
        tokenized_split.__wrapped__(config, "train", 0, 2)
        return tuple(keys)

    return keys_of


@pytest.mark.parametrize("key", list(schema()))
def test_a_cache_key_changes_exactly_with_the_settings_of_its_groups(
    tiny, tmp_path, monkeypatch, key
):
    keys_of = _captured_keys(monkeypatch, tiny, tmp_path)
    config = _config(tiny)
    changed = dataclasses.replace(
        config, **{to_attr(key): _other_value(key, config.as_dict()[key])}
    )
    (model, data), (model2, data2) = keys_of(config), keys_of(changed)
    affects = schema()[key].affects
    assert (model != model2) == (MODEL in affects), affects
    assert (data != data2) == bool(affects & {DATA, TOKENISATION}), affects


def test_a_cache_key_covers_the_builder_code_it_imports(tmp_path, monkeypatch):
    """The code part of a key: the builder's module and every project module it imports,
    transitively, function-local ones included; nothing else."""
    pkg = tmp_path / "flower_app"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "builder.py").write_text("def build():\n    from flower_app.sub import helper\n")
    (pkg / "sub" / "helper.py").write_text("from . import deep\n")
    (pkg / "sub" / "deep.py").write_text("import torch\nX = 1\n")
    (pkg / "unrelated.py").write_text("Y = 1\n")
    monkeypatch.setattr(cache_keys, "_ROOT", tmp_path)

    def code_hash() -> str:
        cache_keys._code_hash.cache_clear()
        return cache_keys._code_hash("flower_app.builder")

    first = code_hash()
    (pkg / "unrelated.py").write_text("Y = 2\n")
    assert code_hash() == first
    (pkg / "sub" / "deep.py").write_text("import torch\nX = 2\n")  # two imports away
    second = code_hash()
    assert second != first
    (pkg / "sub" / "__init__.py").write_text("Z = 1\n")  # a parent package runs too
    assert code_hash() != second
    third = code_hash()
    # a registry importing by name: every module of its package counts
    (pkg / "sub" / "plugin.py").write_text("P = 1\n")
    assert code_hash() == third  # not imported by anything yet
    (pkg / "sub" / "helper.py").write_text(
        "from importlib import import_module\nfrom . import deep\nimport_module('x')\n"
    )
    fourth = code_hash()
    (pkg / "sub" / "plugin.py").write_text("P = 2\n")
    assert code_hash() != fourth
    cache_keys._code_hash.cache_clear()


def test_the_real_builders_code_hashes_cover_their_modules():
    files = cache_keys._code_files
    model = {str(p.relative_to(ROOT)) for p in files("flower_app.cache.per_process").values()}
    data = {str(p.relative_to(ROOT)) for p in files("flower_app.task_data").values()}
    assert {
        "flower_app/adapters/lora/layer.py",
        "flower_app/modeling.py",
        "flower_app/settings/config.py",
    } <= model
    assert {"flower_app/data/qa_features.py", "flower_app/cache/tokenizer.py"} <= data
    assert "flower_app/cache/assets.py" in data  # (the old hand-written list named assets.py)
    # the core imports no method; a model's key adds the code of the modules that registered
    # the methods, and the registry imports its modules by name (importlib): all of them count
    assert not any(f.startswith("strategies/") for f in model | data)
    methods = {
        str(p.relative_to(ROOT)) for source in method_sources() for p in files(source).values()
    }
    assert "strategies/fedex_lora/method.py" in methods
    assert not any(f.startswith(("florg_tools/", "tests/", "client_app/")) for f in model | data)


def _racing_parse(monkeypatch, path: Path, failures: int, message: str) -> list[int]:
    """Make ``ast.parse`` of ``path`` fail ``failures`` times with ``message``, as the
    CPython 3.11 race does, then parse for real (other files, pytest's own included, parse
    as ever); returns the count of parses of ``path`` (one element)."""
    real_parse = cache_keys.ast.parse
    calls = [0]

    def parse(source, filename="<unknown>", *args, **kwargs):
        if filename == str(path):
            calls[0] += 1
            if calls[0] <= failures:
                raise SystemError(message)
        return real_parse(source, filename, *args, **kwargs)

    monkeypatch.setattr(cache_keys.ast, "parse", parse)
    return calls


RACE = "AST constructor recursion depth mismatch (before=45, after=379)"


def test_a_parse_failed_by_another_threads_ast_race_is_parsed_again(monkeypatch):
    path = ROOT / "flower_app" / "cache" / "per_process.py"
    expected = cache_keys._imports("flower_app.cache.per_process", path)
    calls = _racing_parse(monkeypatch, path, cache_keys._PARSE_TRIES - 1, RACE)
    assert cache_keys._imports("flower_app.cache.per_process", path) == expected
    assert calls[0] == cache_keys._PARSE_TRIES


def test_a_persistent_race_or_another_system_error_is_raised(monkeypatch):
    path = ROOT / "flower_app" / "cache" / "per_process.py"
    _racing_parse(monkeypatch, path, cache_keys._PARSE_TRIES, RACE)
    with pytest.raises(SystemError, match="recursion depth mismatch"):
        cache_keys._imports("flower_app.cache.per_process", path)
    calls = _racing_parse(monkeypatch, path, 1, "some other interpreter error")
    with pytest.raises(SystemError, match="some other"):
        cache_keys._imports("flower_app.cache.per_process", path)
    assert calls[0] == 1


def test_a_florg_process_keys_its_cache_without_importing_peft(tiny, tmp_path):
    """The cache key names the library versions (``_versions``) from package metadata: a
    FLoRG ClientApp or ServerApp never uses PEFT, and importing it only to read its version
    cost each such process seconds of CPU. FedIT's standard LoRA does load it."""
    model, task = tiny
    probe = (
        "import sys\n"
        "import strategies.registry\n"
        "from flower_app.settings.config import resolve_config\n"
        "from flower_app.cache.per_process import cached_adapted_model\n"
        "from flower_app.task_data import load_task_data, tokenized_split\n"
        "def build(method):\n"
        f"    settings = {{'model': {str(model)!r}, 'task': 'local', 'data-path': {str(task)!r},\n"
        "                'text-fields': 'sentence', 'rank': 2, 'method': method}\n"
        "    config = resolve_config({}, settings)\n"
        "    tokenized_split(config, 'train')\n"
        "    cached_adapted_model.__wrapped__(config, load_task_data(config).num_labels)\n"
        "    return 'peft' in sys.modules\n"
        "print(build('florg'), build('florg'), build('fedit'))\n"
    )
    env = {**os.environ, disk_cache.DIR_ENV_VAR: str(tmp_path / "cache")}
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr[-3000:]
    # a miss, then a hit, without PEFT; FedIT's model is PEFT's LoRA
    assert out.stdout.split()[-3:] == ["False", "False", "True"], out.stdout + out.stderr
    assert len(list((tmp_path / "cache" / "models").iterdir())) == 2
