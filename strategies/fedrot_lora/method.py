"""FedRot-LoRA: each client's LoRA pair is rotated in its rank space toward the round's global
factors by orthogonal Procrustes, then B and A are averaged separately (``rule.py``). Up and
down: B and A. ``fedrot-rotation`` (settings.py): 'orthogonal', the authors' default, the best
Rₙ in O(r), a reflection kept; 'proper', the best Rₙ in SO(r) (the determinant fix, Kabsch's).

The authors' clients rotate after training, against the global model they were sent. Here the
server computes the same Rₙ from the reply's Bₙ, Aₙ and the global state it sent: Rₙ depends
on nothing else, and (Bₙ Rₙ)(Rₙᵀ Aₙ) = Bₙ Aₙ whoever applies it, so no client code runs; the
strategy (``strategy.py``) passes the round, which picks the aligned factor, and the rotation.
Under secure aggregation the clients rotate, as the authors' do (``secure_contribution``), and
the server averages the summed rotated factors with no rotation of its own (``aggregate_secure``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from flower_app.methods.contract import stacked
from strategies.fedrot_lora.settings import FedRotLoRASettings
from strategies.shared.base_method import BaseMethod
from strategies.shared.per_layer import LORA_PARTS, layer_keys

if TYPE_CHECKING:
    from flower_app.settings.run_settings import RunSettings

    class FedRotLoRAConfig(RunSettings, FedRotLoRASettings):
        """What FedRot-LoRA reads: the core's settings and its own."""


# Why round-mode=async is refused: which factor aligns, and to what, is the round a reply
# trained in and the global state it was sent then; a buffered update applies replies
# trained from older models, which the authors' synchronous rounds never see.
ASYNC_REFUSAL = (
    "its rotation aligns each reply with the global factors it was trained from and picks "
    "the aligned factor by round; the authors run synchronous rounds only"
)


class FedRotLoRA(BaseMethod):
    def build_strategy(
        self, config: FedRotLoRAConfig, initial_state, *, fingerprint=None, run_dir=None
    ):
        from strategies.fedrot_lora.strategy import FedRotLoRAStrategy

        return FedRotLoRAStrategy(
            initial_state,
            method=self,
            rotation=config.fedrot_rotation,
            **self.strategy_settings(config, run_dir=run_dir),
        )

    def aligned(
        self,
        sent: Mapping[str, np.ndarray],
        payloads: list[dict[str, np.ndarray]],
        server_round: int,
        rotation: str = "orthogonal",
    ) -> list[dict[str, np.ndarray]]:
        """Each reply with every layer's (Bₙ, Aₙ) replaced by (Bₙ Rₙ, Rₙᵀ Aₙ), Rₙ aligning
        the round's factor to ``sent``'s in ``rotation``'s group (``rule.aligned_pair``);
        the head as it came."""
        from strategies.fedrot_lora.rule import aligned_pair, aligned_part

        part = aligned_part(server_round)
        out = [dict(p) for p in payloads]
        for kb, ka in layer_keys(sent, LORA_PARTS):
            for p in out:
                p[kb], p[ka], _ = aligned_pair(p[kb], p[ka], sent[kb], sent[ka], part, rotation)
        return out

    def aggregate(
        self,
        sent,
        payloads,
        weights,
        *,
        server_round: int | None = None,
        rotation: str = "orthogonal",
    ):
        """Per layer Σ wₙ Bₙ Rₙ and Σ wₙ Rₙᵀ Aₙ, each Rₙ in ``rotation``'s group (the run's
        ``fedrot-rotation``, which the strategy passes); ``rotation_norm``: the mean
        ‖Rₙ − I‖_F over clients and layers (0 in round 1, near 0 when the clients barely
        rotate)."""
        from strategies.fedrot_lora.rule import aggregate_fedrot_lora, aligned_part

        if server_round is None:
            raise ValueError(f"method {self.name!r} aligns by round: pass server_round")
        part = aligned_part(server_round)
        new: dict[str, np.ndarray] = {}
        moved = []
        for kb, ka in layer_keys(sent, LORA_PARTS):
            new[kb], new[ka], norm = aggregate_fedrot_lora(
                stacked(payloads, kb),
                stacked(payloads, ka),
                weights,
                sent[kb],
                sent[ka],
                part,
                rotation,
            )
            moved.append(norm)
        return new, {"rotation_norm": float(np.mean(moved)) if moved else 0.0}

    def aggregate_private(
        self, dp, sent, payloads, num_sampled, *, server_round=None, rotation="orthogonal"
    ):
        """The mean mechanism on the rotated replies: each Rₙ reads that client's reply and
        the public global state only, so it is the client's own step before clipping (as
        where the authors run it) and a client's clipped update still moves the sum by at
        most C. The rotation's diagnostic reads the raw replies and is not released."""
        if server_round is None:
            raise ValueError(f"method {self.name!r} aligns by round: pass server_round")
        aligned = self.aligned(sent, payloads, server_round, rotation)
        return super().aggregate_private(dp, sent, aligned, num_sampled)

    # -- secure aggregation (secure_sum='mean'): the clients rotate, the server averages --
    def rotated_reply(
        self,
        arrays: Mapping[str, np.ndarray],
        received: Mapping[str, np.ndarray] | None,
        server_round: int,
        config: FedRotLoRAConfig | None,
    ) -> dict[str, np.ndarray]:
        """``arrays`` (a client's reply) rotated on the client exactly as ``aligned`` rotates
        it on the server: each Rₙ from the reply and ``received``, the state the server sent,
        the factor by round, in the run's ``fedrot-rotation``; round 1 rotates nothing."""
        from strategies.fedrot_lora.rule import aligned_part

        if aligned_part(server_round) is None:
            return dict(arrays)
        if received is None or config is None:
            raise ValueError(
                f"method {self.name!r} rotates each reply against the state it was sent, in "
                "the run's fedrot-rotation: pass received and config"
            )
        return self.aligned(received, [dict(arrays)], server_round, config.fedrot_rotation)[0]

    def secure_contribution(self, arrays, server_round, *, received=None, config=None):
        """The reply's pair rotated as the server's ``aligned`` would (``rotated_reply``)
        and the head: their weighted mean is the plain round's mean of the aligned pairs."""
        rotated = self.rotated_reply(arrays, received, server_round, config)
        return super().secure_contribution(rotated, server_round)

    def secure_private_contribution(
        self, arrays, received, clipping_norm, server_round, *, config=None
    ):
        """dp=central: the rotated reply's update over ``received``, head included, clipped
        jointly to C (the mean mechanism's client side), as ``aggregate_private`` rotates,
        then clips, a plain round's replies."""
        rotated = self.rotated_reply(arrays, received, server_round, config)
        return super().secure_private_contribution(rotated, received, clipping_norm, server_round)

    def aggregate_secure(self, strategy, server_round, mean, clients):
        """``mean`` is already the weighted mean of the rotated pairs and the heads: the new
        state as it is, a factor-wise mean. Not the strategy's ``aggregate_adapter``, which would
        rotate the mean toward the global factor a second time (the identity on an exact
        mean of aligned pairs, not on a noised release). Under dp=central the base
        ``aggregate_secure_private`` releases the noised mean and calls this. No
        ``rotation_norm``: the server never sees an Rₙ."""
        new = {key: np.asarray(value, np.float64) for key, value in mean.items()}
        return {**strategy.global_state, **new}, {}


FEDROT_LORA = FedRotLoRA(
    name="fedrot-lora",
    summary="rotate each client's B, A toward the global factors (Procrustes), then average",
    adapter="lora",
    shared=("A", "B"),
    settings=FedRotLoRASettings,
    # one common rank, as the authors': Rₙ is r × r against the global factor of rank r
    heterogeneous_ranks=False,
    # rotate each reply, clip reply - sent over A, B and the head; noised mean
    dp_mechanism="mean",
    async_refusal=ASYNC_REFUSAL,
    # each client rotates its own pair (``secure_contribution``): A, B and the head weighted
    # means of the rotated replies, dp=central the mean mechanism on them
    secure_sum="mean",
)

METHODS = (FEDROT_LORA,)
