"""docs/architecture.md's round walk held to a traced round: one FLoRG round of a real
two-round run (the ServerApp's ``main``, each ClientApp's ``train`` called in process on the
tiny BERT) runs no project file the walk does not name, and every numbered file runs."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest
from flwr.app import Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

import client_app.client_app as client_app
import server_app.server_app as server_app
from strategies.server.strategy import AdapterStrategy

ROOT = Path(__file__).resolve().parents[2]
MAX_STATIONS = 15
TRACED_ROUND = 2  # round 1 also builds the model, the data and the strategy


def walk_section() -> str:
    text = (ROOT / "docs" / "architecture.md").read_text()
    return text.split("## One FLoRG round, end to end", 1)[1].split("\n## ", 1)[0]


def stations(section: str) -> list[str]:
    """The walk's numbered files, in order."""
    return re.findall(r"^\d+\. `([\w/]+\.py)`", section, re.MULTILINE)


def named_files(section: str) -> set[str]:
    """Every project file the section names."""
    return set(re.findall(r"`((?:[\w]+/)+[\w]+\.py)`", section))


@pytest.fixture
def task_identity(monkeypatch) -> None:
    """What a SuperLink sets before a ServerApp builds its messages."""
    for name in ("_run_id", "_task_id", "_node_id"):
        monkeypatch.setattr(TaskIdentity, name, 1)


class InProcessGrid:
    """Two nodes whose ClientApp handles each message in this process, in turn."""

    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = settings
        self.partitions = {101: 0, 102: 1}

    def get_node_ids(self) -> list[int]:
        return list(self.partitions)

    def send_and_receive(self, messages, *, timeout=None) -> list[Message]:
        replies = []
        for message in messages:
            node = message.metadata.dst_node_id
            context = Context(
                run_id=1, node_id=node, state=RecordDict(), run_config=dict(self.settings),
                node_config={"partition-id": self.partitions[node], "num-partitions": 2},
            )  # fmt: skip
            handler = client_app.train if message.metadata.message_type == "train" else None
            assert handler is not None, message.metadata.message_type  # clients don't evaluate
            replies.append(handler(message, context))
        return replies


def traced_round(settings: dict[str, Any], monkeypatch) -> set[str]:
    """The project files whose functions run in round ``TRACED_ROUND`` of a run with
    ``settings``: from that round's ``configure_train`` to the run's final save."""
    ran: set[str] = set()
    prefix = f"{ROOT}/"

    def profile(frame, event, arg):
        if event == "call":
            name = frame.f_code.co_filename
            if name.startswith(prefix) and "/.venv/" not in name and "/tests/" not in name:
                ran.add(name.removeprefix(prefix))

    configure_train = AdapterStrategy.configure_train
    save_final = server_app.save_final

    def traced_configure(self, server_round, *args, **kwargs):
        if server_round == TRACED_ROUND:
            sys.setprofile(profile)
        return configure_train(self, server_round, *args, **kwargs)

    def untraced_save(*args, **kwargs):
        sys.setprofile(None)
        return save_final(*args, **kwargs)

    monkeypatch.setattr(AdapterStrategy, "configure_train", traced_configure)
    monkeypatch.setattr(server_app, "save_final", untraced_save)
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                      run_config=dict(settings))  # fmt: skip
    try:
        server_app.main(InProcessGrid(settings), context)
    finally:
        sys.setprofile(None)
    return ran


def test_the_walk_names_every_file_a_florg_round_runs(
    tiny_client_settings, task_identity, tmp_path, monkeypatch
):
    section = walk_section()
    numbered = stations(section)
    assert 8 <= len(numbered) <= MAX_STATIONS and len(set(numbered)) == len(numbered), numbered
    named = named_files(section)
    assert not [f for f in named if not (ROOT / f).is_file()], "the walk names a missing file"

    monkeypatch.setenv("FLORG_OUTPUT_ROOT", str(tmp_path))
    settings = {**tiny_client_settings, "method": "florg", "num-server-rounds": TRACED_ROUND,
                "min-available-nodes": 2, "min-train-nodes": 2}  # fmt: skip
    ran = traced_round(settings, monkeypatch)
    assert "strategies/florg/rule_torch.py" in ran  # the trace saw the round's aggregation
    assert sorted(ran - named) == [], "files the round runs that the walk does not name"
    assert sorted(set(numbered) - ran) == [], "numbered files the round does not run"


def test_the_walk_parsers_read_numbered_and_named_files():
    section = "intro `a/b.py`\n\n1. `x/y.py`: calls `x/z.py` and `p/q/r.py`.\n2. `u/v.py`\n"
    assert stations(section) == ["x/y.py", "u/v.py"]
    assert named_files(section) == {"a/b.py", "x/y.py", "x/z.py", "p/q/r.py", "u/v.py"}
