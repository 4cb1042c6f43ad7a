"""Fed-SB's own run settings: its federated round 0, which sets the fixed B and A from the
clients' gradients (``FedSBSettings``; strategies/fed_sb/gradient.py and, under dp=example,
private_gradient.py)."""

from __future__ import annotations

from dataclasses import dataclass

from flower_app.settings import setting
from flower_app.settings.checks import non_negative, positive, positive_finite


@dataclass(frozen=True)
class FedSBSettings:
    """Settings: Fed-SB's round 0 (``FedSB``, strategies/fed_sb/method.py)."""

    fed_sb_init_examples: int = setting(
        64,
        "LoRA-SB's round 0: each client's training examples whose summed gradient of every "
        "adapted W0 sets the fixed B and A",
        check=positive,
        affects=(),
    )
    fed_sb_init_lr: float = setting(
        0.0,
        "LoRA-SB's round 0: lr of the sign step -lr sign(G) that B R A starts as the rank-r "
        "truncation of (0 = learning-rate)",
        check=non_negative,
        affects=(),
    )
    fed_sb_init_noise_multiplier: float = setting(
        1.0,
        "LoRA-SB's round 0 under dp=example: noise multiplier z0 of each client's gradient "
        "estimate (per-example gradients clipped to dp-sgd-clipping-norm C, each example in "
        "with probability fed-sb-init-examples / n, noise std z0 C on the sum), one release "
        "composed into the client's epsilon before training; 1.0 as dp-sgd-noise-multiplier: "
        "larger costs less epsilon and gives a noisier, more random B and A",
        check=positive_finite,
        affects=(),
    )
