"""Pieces of the deployment work that need no Flower processes: the on-disk caches a fresh
ClientApp process relies on, a node's own data-path, the lost-node ledger on hand-built
messages (as the SuperLink answers for a dead node), the device choice, the TLS
connection writer and the demo certificates."""

from __future__ import annotations

import os
import ssl
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Message, MessageType, MetricRecord, RecordDict
from flwr.server.superlink.linkstate.utils import (
    NODE_UNAVAILABLE_ERROR_REASON,
    create_message_error_unavailable_res_message,
)
from flwr.supercore.task_identity import TaskIdentity

from florg_tools.deploy.certs import certificate_sans, generate_certificates, generate_node_keys
from florg_tools.deploy.commands import DeployConfigError
from florg_tools.flwr_home import write_tls_connection
from florg_tools.synthetic import make_sentiment_task
from flower_app.adapters.florg.model import florg_layers
from flower_app.cache import disk as disk_cache
from flower_app.cache import eviction as cache_eviction
from flower_app.cache.per_process import cached_adapted_model
from flower_app.client.node_config import use_node_data
from flower_app.modeling import pick_device
from flower_app.settings.config import ConfigError, resolve_config
from flower_app.task_data import load_task_data, tokenized_split
from strategies.server.ledger import NodeLedger

TaskIdentity.run_id = 1
TaskIdentity.task_id = 1
TaskIdentity.node_id = 1


@pytest.fixture(scope="module")
def tiny(tiny_bert_dir, sentiment_task_dir):
    return tiny_bert_dir, sentiment_task_dir


def _config(tiny, **extra):
    model, task = tiny
    settings = {"model": str(model), "task": "local", "data-path": str(task)}
    return resolve_config({}, {**settings, "text-fields": "sentence", "rank": 2, **extra})


def test_model_cache_hits_with_identical_model_and_misses_on_a_relevant_change(
    tiny, tmp_path, monkeypatch
):
    monkeypatch.setenv(disk_cache.DIR_ENV_VAR, str(tmp_path))
    build = cached_adapted_model.__wrapped__  # the disk-cached builder, below lru_cache
    config = _config(tiny)
    labels = load_task_data(config).num_labels
    before = dict(disk_cache.STATS)
    first, second = build(config, labels), build(config, labels)
    assert disk_cache.STATS["misses"] - before["misses"] == 1
    assert disk_cache.STATS["hits"] - before["hits"] == 1
    assert first is not second and first.fingerprint() == second.fingerprint()
    a, b = first.model.state_dict(), second.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # A learning rate does not change the model; a rank does.
    build(_config(tiny, **{"learning-rate": 0.1}), labels)
    assert disk_cache.STATS["hits"] - before["hits"] == 2
    other = build(_config(tiny, rank=3), labels)
    assert disk_cache.STATS["misses"] - before["misses"] == 2
    assert next(iter(other.shared_state().values())).shape[0] == 3
    # The server step's device and rank policy do not change the model; L/R sharing does.
    build(_config(tiny, **{"server-device": "cpu", "rank-mismatch": "truncate"}), labels)
    assert disk_cache.STATS["hits"] - before["hits"] == 3
    per_module = build(_config(tiny, **{"projection-sharing": "module"}), labels)
    assert disk_cache.STATS["misses"] - before["misses"] == 3
    assert per_module.fingerprint() != first.fingerprint()
    # The copy loaded from disk still shares one L, R pair between same-shape layers.
    holders = {id(m.projections) for m in florg_layers(second.model).values()}
    assert len(florg_layers(second.model)) > len(holders) == 1


def test_dataset_cache_round_trips_and_can_be_disabled(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv(disk_cache.DIR_ENV_VAR, str(tmp_path / "on"))
    split = tokenized_split.__wrapped__
    config = _config(tiny)
    fresh, cached = split(config, "train", 1, 3), split(config, "train", 1, 3)
    assert cached.format == fresh.format and len(cached) == len(fresh) == 80
    for key in ("input_ids", "attention_mask", "labels"):
        assert torch.equal(cached[:][key], fresh[:][key])
    assert len(split(config, "train", 2, 3)) == 80
    assert len(list((tmp_path / "on" / "tokenized").iterdir())) == 2
    monkeypatch.setenv(disk_cache.DISABLE_ENV_VAR, "0")
    monkeypatch.setenv(disk_cache.DIR_ENV_VAR, str(tmp_path / "off"))
    split(config, "train", 0, 3)
    assert not (tmp_path / "off").exists()


def test_cache_evicts_least_recently_used_entries_beyond_its_limit(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv(disk_cache.DIR_ENV_VAR, str(tmp_path))
    build = cached_adapted_model.__wrapped__
    labels = load_task_data(_config(tiny)).num_labels
    build(_config(tiny), labels)
    (entry,) = (tmp_path / "models").iterdir()
    size = cache_eviction._entry_size(entry)  # an entry is a folder (safetensors + JSON)
    monkeypatch.setenv(disk_cache.MAX_MB_ENV_VAR, str(1.5 * size / 1e6))
    build(_config(tiny, rank=3), labels)  # two entries exceed 1.5 entries: the older goes
    assert [p.name for p in (tmp_path / "models").iterdir()] != [entry.name]
    assert len(list((tmp_path / "models").iterdir())) == 1


def test_eviction_walks_each_cache_entry_once(tiny, tmp_path, monkeypatch):
    """An entry never changes once in place, so the scan after each store measures only
    the entries it has not seen (a hit's touch needs no new measure), and forgets the
    ones it deletes."""
    monkeypatch.setenv(disk_cache.DIR_ENV_VAR, str(tmp_path))
    monkeypatch.setattr(cache_eviction, "_SIZES", {})
    walked: list[str] = []
    real = cache_eviction._entry_size
    monkeypatch.setattr(cache_eviction, "_entry_size", lambda p: walked.append(p.name) or real(p))
    split = tokenized_split.__wrapped__
    config = _config(tiny)
    for pid in range(3):
        split(config, "train", pid, 3)
    assert len(walked) == len(set(walked)) == 3  # three stores, three entries, each once
    split(config, "train", 0, 3)  # a hit touches its entry: no walk
    assert len(walked) == 3
    one_entry = cache_eviction._SIZES[tmp_path / "tokenized" / walked[0]]
    monkeypatch.setenv(disk_cache.MAX_MB_ENV_VAR, str(1.5 * one_entry / 1e6))
    split(config, "train", 1, 4)  # a fourth store; the three least recently used go
    assert len(walked) == 4
    assert list(cache_eviction._SIZES) == [tmp_path / "tokenized" / walked[-1]]


def test_eviction_scans_only_when_the_cache_may_be_past_its_limit(tmp_path, monkeypatch):
    """A store within the limit by this process's last scan (plus what it stored since)
    scans nothing; past the limit, or once the last scan is stale, the scan deletes the
    least recently used entries down to 90% of the limit."""

    monkeypatch.setattr(cache_eviction, "_SIZES", {})
    monkeypatch.setattr(cache_eviction, "_SCANNED", {})
    monkeypatch.setenv(disk_cache.MAX_MB_ENV_VAR, str(1000 / 1e6))  # 1,000 bytes
    clock = [0.0]
    monkeypatch.setattr(cache_eviction.time, "monotonic", lambda: clock[0])
    folder = tmp_path / "tokenized"
    folder.mkdir()

    def store(name: str, size: int, age: float) -> Path:
        entry = folder / name
        entry.write_bytes(b"x" * size)
        os.utime(entry, (1e9 + age, 1e9 + age))  # mtime: least recently used first
        return entry

    cache_eviction.evict(tmp_path, store("a", 100, 1))  # first store: a scan, 100 bytes
    store("foreign", 900, 0)  # another process's store, unseen until the next scan
    cache_eviction.evict(tmp_path, store("b", 100, 2))  # 100 + 100 <= 1,000: no scan
    assert sorted(p.name for p in folder.iterdir()) == ["a", "b", "foreign"]
    clock[0] = cache_eviction._SCAN_TTL_SECONDS + 1  # the last scan is stale: scan again
    cache_eviction.evict(tmp_path, store("c", 100, 3))  # 1,200 bytes: down to <= 900
    assert sorted(p.name for p in folder.iterdir()) == ["a", "b", "c"]
    cache_eviction.evict(tmp_path, store("d", 800, 4))  # 300 + 800 > 1,000: a scan
    assert sorted(p.name for p in folder.iterdir()) == ["c", "d"]  # 900 <= 900


def test_node_data_path_replaces_the_run_data(tiny, tmp_path):
    config = _config(tiny)
    assert use_node_data(config, {"partition-id": 1}, 3) == (config, 3)
    own = make_sentiment_task(tmp_path / "own", n_train=30)
    mine, parts = use_node_data(config, {"partition-id": 1, "data-path": str(own)}, 3)
    assert parts == 1 and mine.data_path == str(own.resolve())
    assert len(tokenized_split.__wrapped__.__wrapped__(mine, "train", 1, parts)) == 30
    with pytest.raises(ConfigError, match=r"data-path: .*nowhere does not exist on this node"):
        use_node_data(config, {"partition-id": 1, "data-path": str(tmp_path / "nowhere")}, 3)


def _train(node: int) -> Message:
    msg = Message(content=RecordDict(), dst_node_id=node, message_type=MessageType.TRAIN)
    msg.metadata.__dict__["_message_id"] = msg.object_id  # what the Grid does on push
    return msg


def _reply(instruction: Message, pid: int) -> Message:
    content = RecordDict({"metrics": MetricRecord({"partition-id": pid, "num-examples": 5})})
    return Message(content=content, reply_to=instruction)


def _unavailable(instruction: Message) -> Message:
    """The error reply the SuperLink itself sends for a node whose heartbeats stopped."""
    return create_message_error_unavailable_res_message(instruction.metadata, "node_unavail")


def test_ledger_names_a_lost_node_by_its_earlier_partition(caplog):
    ledger = NodeLedger()
    round1 = [_train(n) for n in (11, 22, 33)]
    ledger.sent(1, round1)
    first = ledger.settle(1, [_reply(m, pid) for m, pid in zip(round1, (0, 1, 2), strict=True)])
    assert first.metrics() == {"partitions": [0, 1, 2], "lost-partitions": [], "lost-nodes": 0}
    round2 = [_train(n) for n in (11, 22, 33)]
    ledger.sent(2, round2)
    second = ledger.settle(2, [_reply(round2[0], 0), _unavailable(round2[1])])
    assert second.metrics() == {"partitions": [0], "lost-partitions": [1, 2], "lost-nodes": 2}
    reasons = {n.node_id: n.reason for n in second.lost}
    assert reasons == {22: NODE_UNAVAILABLE_ERROR_REASON, 33: "no reply before timeout"}
    assert "round 2: lost node 22 (partition 1): Error: Node Unavailable" in caplog.text


def test_client_picks_cuda_when_present_else_cpu():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert pick_device("auto").type == expected
    assert pick_device("cpu").type == "cpu"


def test_tls_connection_and_certificates(tmp_path):
    certs = generate_certificates(tmp_path / "c", ["10.200.3.1", "superlink"])
    assert {"127.0.0.1", "::1", "localhost", "10.200.3.1", "superlink"} <= set(
        certificate_sans(certs.server_cert)
    )
    ctx = ssl.create_default_context(cafile=str(certs.ca_cert))
    ctx.load_cert_chain(certs.server_cert, certs.server_key)  # key matches the certificate
    assert oct(certs.server_key.stat().st_mode & 0o777) == "0o600"
    key = generate_node_keys(tmp_path / "k", 1)[0]
    assert key.public_key.read_text().startswith("ecdsa-sha2-nistp384 ")
    with pytest.raises(DeployConfigError, match="not valid for 10.9.9.9"):
        generate_certificates(tmp_path / "c", ["10.9.9.9"])

    path = write_tls_connection(
        tmp_path / "home", "lan", "10.0.0.5:9093", root_certificates=certs.ca_cert
    )
    conn = tomllib.loads(path.read_text())["superlink"]
    assert conn["lan"] == {"address": "10.0.0.5:9093", "root-certificates": str(certs.ca_cert)}
    assert conn["default"] == "lan" and "local" in conn  # flwr's own entries are kept
    with pytest.raises(ValueError, match="not a loopback address"):
        write_tls_connection(tmp_path / "home", "x", "10.0.0.5:9093", root_certificates=None,
                             insecure=True)  # fmt: skip
    with pytest.raises(ValueError, match="does not exist"):
        write_tls_connection(tmp_path / "home", "x", "10.0.0.5:9093",
                             root_certificates=tmp_path / "missing.crt")  # fmt: skip
    np.testing.assert_equal(
        tomllib.loads(write_tls_connection(tmp_path / "home", "lo", "127.0.0.1:1",
                                           root_certificates=None, insecure=True).read_text()
                      )["superlink"]["lo"],
        {"address": "127.0.0.1:1", "insecure": True},
    )  # fmt: skip
