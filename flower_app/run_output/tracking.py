"""Optional TensorBoard event files: every numeric field of each metrics.jsonl row.

``<run folder>/tensorboard/`` gets one scalar per numeric field of the row (the same names
as metrics.jsonl: ``score``, ``accuracy``, ``loss``, ``test-*``, ``cum-up-bytes``, FLoRG's
diagnostics, ...) with step = round, so ``tensorboard --logdir outputs/`` shows every run.
It needs the ``tensorboard`` package (``pip install -e ".[tracking]"``); setting
``tensorboard``: ``auto`` writes when it is installed and otherwise logs one line and goes
on, ``on`` fails before training without it, ``off`` writes nothing.
"""

from __future__ import annotations

import numbers
from pathlib import Path
from typing import Any

from flwr.common.logger import log as flwr_log

from flower_app.settings.config import ConfigError

INFO = 20
TENSORBOARD_MODES = ("auto", "on", "off")
TENSORBOARD_DIR = "tensorboard"
INSTALL_HINT = 'pip install -e ".[tracking]" (or pip install "tensorboard>=2.14")'


def _summary_writer() -> Any:
    """torch's SummaryWriter class; ImportError when the tensorboard package is missing."""
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The row's numeric fields (not ``round``, the step; not booleans or None)."""
    out: dict[str, float] = {}
    for key, value in row.items():
        if key == "round" or isinstance(value, bool):
            continue
        if hasattr(value, "item") and not isinstance(value, numbers.Real):
            try:
                value = value.item()  # 0-d numpy / torch values
            except (TypeError, ValueError):
                continue
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            out[key] = float(value)
    return out


class TensorBoardTracker:
    """Writes each row's scalars to ``<run_dir>/tensorboard`` and flushes every round."""

    def __init__(self, run_dir: Path, writer_cls: Any, purge_step: int | None = None) -> None:
        """``purge_step`` (a resumed run: the first round after the checkpoint) hides
        events the interrupted run had written for that round and later."""
        self.logdir = run_dir / TENSORBOARD_DIR
        self.writer = writer_cls(log_dir=str(self.logdir), purge_step=purge_step)

    def log_row(self, row: dict[str, Any]) -> None:
        step = int(row["round"])
        for key, value in scalars(row).items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def open_tracker(
    mode: str, run_dir: Path, purge_step: int | None = None
) -> TensorBoardTracker | None:
    """The run's tracker per setting ``tensorboard`` (see module doc), or None."""
    if mode not in TENSORBOARD_MODES:
        raise ConfigError(f"tensorboard: bad value {mode!r} (must be one of auto, on, off)")
    if mode == "off":
        return None
    try:
        writer_cls = _summary_writer()
    except ImportError as err:
        if mode == "on":
            raise ConfigError(
                f"tensorboard=on, but TensorBoard is not installed ({err}); {INSTALL_HINT}, "
                "or set tensorboard=auto/off"
            ) from None
        flwr_log(
            INFO,
            "[florg] TensorBoard not installed: no tensorboard/ events for this run "
            "(metrics.jsonl has every round); to get them: %s",
            INSTALL_HINT,
        )
        return None
    return TensorBoardTracker(run_dir, writer_cls, purge_step=purge_step)
