"""Settings: privacy: central differential privacy and example-level DP-SGD (docs/privacy.md)."""

from __future__ import annotations

from dataclasses import dataclass

from flower_app.settings import setting
from flower_app.settings.checks import (
    non_negative_finite,
    one_of,
    open_unit_interval,
    positive,
    positive_finite,
    zero_or_below_one,
)


@dataclass(frozen=True)
class PrivacySettings:
    """Settings: privacy: central differential privacy and example-level DP-SGD
    (docs/privacy.md)."""

    dp: str = setting(
        "off",
        "differential privacy: 'central' = the server clips each client's update and noises "
        "the aggregate, user-level (epsilon, delta) in metrics.jsonl's dp-epsilon; 'example' "
        "= each client trains with DP-SGD (Opacus), example-level, its epsilon per client "
        "(metrics.jsonl's dp-sgd-epsilon-max)",
        check=one_of("off", "central", "example"),
        affects=(),
    )
    dp_clipping_norm: float = setting(
        1.0,
        "dp=central: L2 bound C on each client's update per round (adapter and head jointly)",
        check=positive,
        affects=(),
    )
    dp_noise_multiplier: float = setting(
        1.0,
        "dp=central: noise multiplier z (Gaussian noise std z x the sensitivity, on the sum)",
        check=positive,
        affects=(),
    )
    dp_delta: float = setting(
        1e-5,
        "dp=central: the delta epsilon is reported at; set it well below 1 / the number of clients",
        check=open_unit_interval,
        affects=(),
    )
    dp_sgd_clipping_norm: float = setting(
        1.0,
        "dp=example: L2 bound C on each example's gradient of everything a client trains "
        "(adapter and head jointly)",
        check=positive_finite,
        affects=(),
    )
    dp_sgd_noise_multiplier: float = setting(
        1.0,
        "dp=example: noise multiplier z of every local step (noise std z C on the clipped "
        "sum); unused where dp-sgd-target-epsilon is set",
        check=positive_finite,
        affects=(),
    )
    dp_sgd_target_epsilon: float = setting(
        0.0,
        "dp=example: each client's z is calibrated to end the run at this epsilon if it trains "
        "in every round (0: use dp-sgd-noise-multiplier)",
        check=non_negative_finite,
        affects=(),
    )
    dp_sgd_delta: float = setting(
        0.0,
        "dp=example: each client's delta (0: 1 / (10 n), n the client's training examples)",
        check=zero_or_below_one,
        affects=(),
    )
    dp_max_epsilon: float = setting(
        0.0,
        "dp=example: a client whose epsilon would exceed this after a round refuses to train "
        "in it, a failed reply (0: no limit)",
        check=non_negative_finite,
        affects=(),
    )
    dp_unnoised_metrics: str = setting(
        "send",
        "with dp on, the clients' metrics computed from their data without noise (train-loss, "
        "train-seconds, dp=example's clipped fraction and gradient norms), outside (epsilon, "
        "delta): 'send' them (diagnostics in metrics.jsonl) or 'withhold' them on the node "
        "(client evaluation is then refused)",
        check=one_of("send", "withhold"),
        affects=(),
    )
    dp_sgd_seeded_noise: bool = setting(
        False,
        "dp=example, tests only: draw the Poisson sampling and the noise from the round's seed "
        "(reproducible, NOT private; default: OS entropy)",
        affects=(),
    )
