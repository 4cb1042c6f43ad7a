"""A node's own state on its disk, so that personal parts survive a resumed run.

A method's personal parts (``Method.local``) live in the node's Flower ``Context``, which
a resumed run (a new Flower run) starts empty. When the node operator sets
``$FLORG_NODE_STATE_DIR``, the ClientApp also writes them after each training round to
``<dir>/<run lineage>/partition-<id>/round-<t>.safetensors`` (atomically; the newest
``KEEP_ROUNDS`` kept) and reads the newest one back into a fresh context. The lineage id
comes from the server and is checked to be 32 hex digits, so a run setting cannot point
these writes elsewhere.
"""

from __future__ import annotations

import contextlib
import os
import re
import uuid
from pathlib import Path

import numpy as np
from flwr.app import Message
from flwr.common.logger import log as flwr_log

NODE_STATE_ENV = "FLORG_NODE_STATE_DIR"
KEEP_ROUNDS = 2
WARNING = 30
_LINEAGE_RE = re.compile(r"[0-9a-f]{32}")


def message_config(msg: Message) -> dict:
    """The message's ``config`` record as a dict ({} without one)."""
    return dict(msg.content["config"]) if "config" in msg.content.config_records else {}


def node_state_dir(msg: Message, partition_id: int) -> Path | None:
    """This node's folder for the run lineage's persisted state, or None (not configured,
    or the server sent no valid lineage id)."""
    root = os.environ.get(NODE_STATE_ENV, "").strip()
    lineage = message_config(msg).get("lineage")
    if not root or not isinstance(lineage, str) or not _LINEAGE_RE.fullmatch(lineage):
        return None
    if partition_id < 0:
        return None
    return Path(root).expanduser().resolve() / lineage / f"partition-{int(partition_id)}"


def persisted_rounds(folder: Path) -> list[tuple[int, Path]]:
    found = []
    for path in folder.glob("round-*.safetensors"):
        digits = path.name[len("round-") : -len(".safetensors")]
        if digits.isdigit():
            found.append((int(digits), path))
    return sorted(found)


def save_local_state(folder: Path, server_round: int, local: dict[str, np.ndarray]) -> None:
    """Atomically write this round's local state; keep the newest ``KEEP_ROUNDS``."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"round-{server_round:06d}.safetensors"
    tmp = folder / f".{final.name}.{uuid.uuid4().hex}"
    save_file({k: np.ascontiguousarray(v, np.float32) for k, v in local.items()}, str(tmp))
    os.replace(tmp, final)
    for _, old in persisted_rounds(folder)[:-KEEP_ROUNDS]:
        with contextlib.suppress(OSError):
            old.unlink()


def load_local_state(folder: Path, before_round: int) -> dict[str, np.ndarray] | None:
    """The newest persisted local state of a round < ``before_round`` (what the node held
    when that round's message arrived), or None."""
    from safetensors.numpy import load_file

    for t, path in reversed(persisted_rounds(folder)):
        if t < before_round:
            try:
                return load_file(str(path))
            except Exception as err:  # damaged (safetensors has its own error type)
                flwr_log(WARNING, "[florg] ignoring unreadable %s: %s", path, err)
    return None
