"""Per-round checkpoints of the ServerApp, and what a resumed run needs from them.

After every round (and round 0's evaluation) the ServerApp writes
``<run_dir>/checkpoint/round-<t>/``: ``arrays.safetensors`` (the global arrays as the clients
receive them), ``strategy.safetensors`` (``AdapterStrategy.state_arrays``) and ``state.json``
(the round, the settings, the strategy's JSON state, Python's ``random`` state, the metrics
rows, the run's lineage id), written under a temporary name and renamed into place; the two
newest are kept, and nothing is pickled. ``resume=<run folder>`` loads the newest complete round
t, checks that the settings equal the checkpoint's (up to ``RESUMABLE_KEYS``), rewrites
``metrics.jsonl`` with rounds 0..t and runs rounds t+1..num-server-rounds (docs/faults.md,
section 1)."""

from __future__ import annotations

import json
import os
import random
import shutil
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from flower_app.settings.config import ConfigError, RunConfig

CHECKPOINT_DIR = "checkpoint"
FORMAT = 1
KEEP = 2
# Settings a resumed run may change: where and how it is run, not what it computes.
RESUMABLE_KEYS = frozenset(
    {
        "resume",
        "preset",  # the resolved values are compared, not how they were layered
        "num-server-rounds",
        "progress-bar",
        "device",
        "fault-server-round",
        "test-every",
        "eval-every",
        "log-level",  # what the console and run folder show, not what is computed
        "tensorboard",
    }
)


@dataclass
class Checkpoint:
    """One complete round's checkpoint."""

    round: int
    path: Path
    arrays: dict[str, np.ndarray]
    strategy_arrays: dict[str, np.ndarray]
    state: dict[str, Any] = field(default_factory=dict)

    @property
    def lineage(self) -> str:
        return str(self.state["lineage"])


def new_lineage() -> str:
    """A fresh run-lineage id (32 hex digits), kept across resumes."""
    return uuid.uuid4().hex


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_arrays(arrays: Mapping[str, np.ndarray], path: Path) -> None:
    from safetensors.numpy import save_file

    save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, str(path))


def random_state_json() -> list[Any]:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def restore_random_state(state: list[Any]) -> None:
    version, internal, gauss = state
    random.setstate((int(version), tuple(int(x) for x in internal), gauss))


def save_checkpoint(
    run_dir: Path,
    server_round: int,
    arrays: Mapping[str, np.ndarray],
    strategy_arrays: Mapping[str, np.ndarray],
    state: Mapping[str, Any],
) -> Path:
    """Write round ``server_round``'s checkpoint atomically; its folder."""
    root = Path(run_dir) / CHECKPOINT_DIR
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{server_round}-{uuid.uuid4().hex}"
    tmp.mkdir()
    try:
        _save_arrays(arrays, tmp / "arrays.safetensors")
        _save_arrays(strategy_arrays, tmp / "strategy.safetensors")
        payload = {**state, "format": FORMAT, "round": int(server_round)}
        (tmp / "state.json").write_text(json.dumps(payload, default=_json_default) + "\n")
        for name in ("arrays.safetensors", "strategy.safetensors", "state.json"):
            _fsync(tmp / name)
        _fsync(tmp)
        final = root / f"round-{server_round:06d}"
        if final.exists():  # a leftover of an earlier attempt at this very round
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in _round_dirs(root)[KEEP:]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".tmp-*"):  # a crash mid-write left it; never read
        if stale != tmp:
            shutil.rmtree(stale, ignore_errors=True)
    return final


def _round_dirs(root: Path) -> list[Path]:
    """Complete round folders, newest first."""
    found = []
    for path in root.glob("round-*"):
        suffix = path.name[len("round-") :]
        if path.is_dir() and suffix.isdigit():
            found.append((int(suffix), path))
    return [p for _, p in sorted(found, reverse=True)]


def load_checkpoint(run_dir: Path) -> Checkpoint | None:
    """The newest readable checkpoint of ``run_dir``, or None."""
    from safetensors.numpy import load_file

    for path in _round_dirs(Path(run_dir) / CHECKPOINT_DIR):
        try:
            state = json.loads((path / "state.json").read_text())
            if state.get("format") != FORMAT or f"round-{state['round']:06d}" != path.name:
                continue
            return Checkpoint(
                round=int(state["round"]),
                path=path,
                arrays=load_file(str(path / "arrays.safetensors")),
                strategy_arrays=load_file(str(path / "strategy.safetensors")),
                state=state,
            )
        except Exception:  # damaged (safetensors raises its own error type): try the older one
            continue
    return None


def check_resumable(config: RunConfig, checkpoint: Checkpoint) -> None:
    """ConfigError naming the settings in which the run differs from the checkpoint's (the
    clients compute with the run's settings, so they must be the same)."""
    saved = checkpoint.state.get("config", {})
    now = config.as_dict()
    differ = sorted(k for k in now if k not in RESUMABLE_KEYS and saved.get(k) != now[k])
    if differ:
        shown = ", ".join(f"{k}={now[k]!r} (checkpoint: {saved.get(k)!r})" for k in differ[:5])
        raise ConfigError(
            f"resume: the run's settings differ from the checkpoint's in {shown}; resume with "
            f"the settings of {checkpoint.path.parent.parent / 'config.json'} "
            "(python -m florg_tools.launch --resume RUN_DIR does)"
        )
    if config.num_server_rounds < checkpoint.round:
        raise ConfigError(
            f"num-server-rounds: {config.num_server_rounds} < the {checkpoint.round} rounds "
            "already done"
        )


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"not JSON serialisable: {type(value)}")
