"""The reply gate: what a client's reply must pass before it is aggregated (docs/faults.md).

1. Validation (``ReplyGate.check``, ``strategies.server.replies.check_reply``): other records,
   missing or extra keys, a dtype other than float32/float64, a mis-shaped array (at the rank
   the reply declares, ``RankRouter.expected_state``), an array whose serialised size exceeds
   its expected size, NaN/Inf, a ``num-examples`` / ``partition-id`` / ``train-loss`` that is
   not a finite number of the right kind: rejected with the reason, never aggregated.
2. Screening (``ReplyGate.screen``, ``strategies.server.screening``; ``screen-updates``, on by
   default): an update whose distance from the state it started from exceeds kappa times the
   round's median distance is rejected, and a claimed ``num-examples`` above kappa times the
   median claim is clipped to it. Off under dp=central (``turn_off_screening_for_dp``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace

import numpy as np
from flwr.app import Message

from strategies.server import replies as _replies
from strategies.server import screening as _screening
from strategies.server.rank_router import RankRouter
from strategies.server.replies import Reply
from strategies.server.screening import DEFAULT_KAPPA

log = logging.getLogger("flwr.florg")  # propagates to Flower's console handler


class ReplyGate:
    """Validation and screening of one run's replies."""

    def __init__(self, *, screen_updates: bool = True, screen_kappa: float = DEFAULT_KAPPA):
        if not screen_kappa >= 1:
            raise ValueError(f"screen_kappa must be >= 1, got {screen_kappa!r}")
        self.screen_updates = bool(screen_updates)
        self.screen_kappa = float(screen_kappa)

    def turn_off_screening_for_dp(self) -> None:
        """Under dp=central whether a client is kept must not depend on the other clients
        (the privacy analysis does not cover it); clipping bounds what one client moves."""
        if self.screen_updates:
            log.info("dp=central: the median-ratio screening is off (docs/privacy.md)")
        self.screen_updates = False

    def check(
        self,
        message: Message,
        global_state: Mapping[str, np.ndarray],
        router: RankRouter,
        *,
        method_name: str,
        heterogeneous: bool,
        private: bool,
    ) -> Reply:
        """The checked reply, or ReplyRejected with the reason (never aggregated)."""
        metrics = message.content["metrics"] if "metrics" in message.content.metric_records else {}
        rank, expected = router.expected_state(
            metrics, global_state, method_name=method_name, heterogeneous=heterogeneous,
            private=private,
        )  # fmt: skip
        reply = _replies.check_reply(message, expected)
        return replace(reply, rank=rank)

    def screen(
        self,
        server_round: int,
        replies: list[Reply],
        global_state: Mapping[str, np.ndarray],
        starts: list[dict[str, np.ndarray]] | None = None,
    ) -> tuple[list[Reply], list[float], dict]:
        """The kept replies, their (clipped) example counts and the screening metrics;
        ``starts``: the state each reply started from (mixed ranks), else the global one."""
        return _screening.screen(
            server_round,
            replies,
            global_state,
            kappa=self.screen_kappa,
            enabled=self.screen_updates,
            starts=starts,
        )
