"""FoldingStrategy: the common strategy plus the folds into W0 (``strategies/shared/folds.py``).

Every client folds every round's update exactly once, rounds it missed included: with its
next training message a node is sent the folds after the last round it reported as folded
(its ``residual-round`` metric). The server keeps a base, C_h = the float64 sum of the folds
of rounds 1..h as a client sums them (``fold_messages.add_sent_folds``), and the folds after
h only; recording round t's folds adds round t - 1's to the base (h = t - 1). It holds, and
checkpoints, per layer one dense base, one round's folds and the float64 cumulative fold it
evaluates with (W0 + s (sum of folds) + s B A). A node behind h is sent the base, then the
later folds, and replaces its cumulative with the base. A method's strategy subclasses this
one and returns the round's folds from ``aggregate_adapter`` through ``record_folds``. Why a
base, and what a lagging node receives: docs/architecture.md, "The math" (folding methods).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
from flwr.app import Message, RecordDict

from strategies.server.fold_messages import add_sent_folds, residuals_record
from strategies.server.strategy import AdapterStrategy
from strategies.shared.folds import Residual


class FoldingStrategy(AdapterStrategy):
    def __init__(self, *args, fold_prefix: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fold_prefix = fold_prefix  # the checkpoint's keys: '<prefix>/cumulative/<layer>'
        self.residuals: dict[int, dict[str, Residual]] = {}  # the rounds after base_round
        self.base: dict[str, np.ndarray] = {}  # C_h, float64, as a client sums rounds 1..h
        self.base_round = 0  # h: the last round added to the base
        self.cumulative: dict[str, np.ndarray] = {}
        self.node_synced: dict[int, int] = {}

    def extend_train_message(self, server_round: int, message: Message) -> Message:
        node = message.metadata.dst_node_id
        since = self.node_synced.get(node, 0)
        content = RecordDict(dict(message.content.items()))
        base = (self.base_round, self.base) if since < self.base_round else None
        content["residuals"] = residuals_record(self.residuals, since, base)
        return Message(
            content=content, message_type=message.metadata.message_type, dst_node_id=node
        )

    def aggregate_train(self, server_round, replies):
        replies = list(replies)
        self.observe_replies(replies)
        return super().aggregate_train(server_round, replies)

    def observe_replies(self, replies: Iterable[Message]) -> None:
        """Each node's last folded round, from its reply's clear ``residual-round`` metric
        (a round number, not private): the plain round reads it here, and a secure round
        (``SecureRounds``) hands it the collect stage's replies, whose metrics travel
        beside the masked vector, so both keep ``node_synced`` the same way."""
        for msg in replies:
            if not msg.has_error() and "metrics" in msg.content.metric_records:
                folded = msg.content["metrics"].get("residual-round", 0)
                if isinstance(folded, int | float) and math.isfinite(folded):
                    # a node that claims more than the server has only starves itself
                    self.node_synced[msg.metadata.src_node_id] = int(folded)

    def record_folds(self, server_round: int, residuals: dict[str, Residual]) -> float:
        """Keep round ``server_round``'s folds, add them to the cumulative fold and the
        earlier rounds' to the base; returns their mean Frobenius norm over the layers."""
        for layer, residual in residuals.items():
            self.cumulative[layer] = self.cumulative.get(layer, 0.0) + residual.to_dense()
        self.residuals[server_round] = residuals
        self._advance_base(server_round)
        return float(np.mean([np.linalg.norm(r.to_dense()) for r in residuals.values()]))

    def _advance_base(self, latest: int) -> None:
        """Add the kept folds of the rounds before ``latest`` to the base, in round order
        (the order a client adds them in), and drop them."""
        for t in sorted(r for r in self.residuals if r < latest):
            add_sent_folds(self.base, self.residuals.pop(t))
            self.base_round = t

    # -- checkpoint and resume: the base, the kept folds and the server's cumulative fold --
    def state_arrays(self) -> dict[str, np.ndarray]:
        arrays = super().state_arrays()
        prefix = self.fold_prefix
        arrays.update({f"{prefix}/cumulative/{k}": v for k, v in self.cumulative.items()})
        # the base's round is in its keys: '<prefix>/base/<h>/<layer>'
        arrays.update({f"{prefix}/base/{self.base_round}/{k}": v for k, v in self.base.items()})
        for t, layers in self.residuals.items():
            for layer, res in layers.items():
                parts = {"dense": res.dense} if res.dense is not None else {"P": res.P, "Q": res.Q}
                arrays.update({f"{prefix}/residual/{t}/{layer}/{k}": v for k, v in parts.items()})
        return arrays

    def restore(self, arrays, state) -> None:
        """Resume: the base, the folds kept after it and the cumulative fold (a resumed run
        is a new Flower run, so its clients start with nothing folded and are sent the base
        and the kept folds with their first training message: ``node_synced`` starts
        empty). A checkpoint written before the base (every round's fold, no base) is read
        too: the base is rebuilt from its rounds, as the uninterrupted run built it."""
        super().restore(arrays, state)
        self.cumulative, self.residuals, self.node_synced = {}, {}, {}
        self.base, self.base_round = {}, 0
        prefix = self.fold_prefix
        cumulative, base, residual = (
            f"{prefix}/cumulative/",
            f"{prefix}/base/",
            f"{prefix}/residual/",
        )
        parts: dict[int, dict[str, dict[str, np.ndarray]]] = {}
        for key, value in arrays.items():
            if key.startswith(cumulative):
                self.cumulative[key[len(cumulative) :]] = np.asarray(value, np.float64)
            elif key.startswith(base):
                h, layer = key[len(base) :].split("/", 1)
                self.base_round, self.base[layer] = int(h), np.asarray(value, np.float64)
            elif key.startswith(residual):
                t, rest = key[len(residual) :].split("/", 1)
                layer, kind = rest.rsplit("/", 1)
                parts.setdefault(int(t), {}).setdefault(layer, {})[kind] = value
        for t, layers in parts.items():
            self.residuals[t] = {
                layer: Residual(dense=p.get("dense"), P=p.get("P"), Q=p.get("Q"))
                for layer, p in layers.items()
            }
        if self.residuals:  # the old format's rounds before the last go into the base
            self._advance_base(max(self.residuals))
