"""round-mode=async's settings: what it refuses before launch, each with the key named and
the reason (flower_app/settings/cross_checks.py), and a straggler's slowdown
(flower_app/client/node_config.py)."""

from __future__ import annotations

import pytest

import strategies.registry  # noqa: F401  (the methods register)
from flower_app.client.node_config import node_delay, node_slowdown
from flower_app.settings.config import ConfigError, resolve_config

ASYNC = {"round-mode": "async"}


@pytest.mark.parametrize("method", ["florg", "florg-no-procrustes", "fedit", "ffa-lora"])
def test_the_methods_with_an_exact_buffered_update_run_async(method):
    config = resolve_config({**ASYNC, "method": method})
    assert config.round_mode == "async"


def test_dp_sgd_on_the_clients_runs_async():
    """A node trains at most once from each version (buffered_rounds._eligible), so at most
    num-server-rounds tasks: the rounds its DP-SGD noise is calibrated for."""
    config = resolve_config({**ASYNC, "dp": "example", "dp-sgd-target-epsilon": 8.0})
    assert config.round_mode == "async" and config.dp == "example"


@pytest.mark.parametrize(
    ("settings", "key", "reason"),
    [
        ({"method": "fedex-lora"}, "round-mode", "no exact place in its update"),
        ({"method": "federa"}, "round-mode", "async runs florg"),
        ({"dp": "central", "dp-clipping-norm": 1.0, "dp-noise-multiplier": 1.0}, "dp",
         "uniform sample"),
        ({"client-sampling": "poisson", "fraction-train": 0.5}, "client-sampling", "per-round"),
        ({"client-ranks": "2,4"}, "client-ranks", "one rank"),
        ({"client-eval": "on"}, "client-eval", "no client evaluation"),
        ({"async-concurrency": 2, "async-buffer-size": 3}, "async-buffer-size", "cannot come"),
    ],
)  # fmt: skip
def test_what_async_cannot_run_is_refused_naming_the_key(settings, key, reason):
    with pytest.raises(ConfigError, match=key) as err:
        resolve_config({**ASYNC, **settings})
    assert reason in str(err.value)


def test_the_async_settings_are_refused_in_a_synchronous_run():
    with pytest.raises(ConfigError, match="only with round-mode=async"):
        resolve_config({"async-buffer-size": 4})


def test_a_straggler_is_its_node_config_s_or_the_run_s_slow_partition():
    config = resolve_config({"slow-partitions": "0,3", "slowdown": 5.0})
    assert node_slowdown(config, {}, 3) == 5.0 and node_slowdown(config, {}, 1) == 1.0
    assert node_slowdown(config, {"slowdown": "2.5"}, 1) == 2.5  # the node's own wins
    for bad in ("0.5", "inf", "fast"):
        with pytest.raises(ConfigError, match="slowdown"):
            node_slowdown(config, {"slowdown": bad}, 1)
    with pytest.raises(ConfigError, match="slowdown"):
        resolve_config({"slowdown": float("inf")})


def test_a_stragglers_fixed_delay_is_its_node_config_s_or_the_run_s():
    config = resolve_config({"slow-partitions": "0,3", "slow-delay": 12.5})
    assert [node_delay(config, {}, p) for p in (0, 1, 3)] == [12.5, 0.0, 12.5]
    assert node_delay(config, {"delay-seconds": "4"}, 1) == 4.0  # the node's own wins
    assert node_delay(resolve_config({}), {}, 0) == 0.0
    for bad in ("-1", "inf", "slow"):
        with pytest.raises(ConfigError, match="delay-seconds"):
            node_delay(config, {"delay-seconds": bad}, 1)
    with pytest.raises(ConfigError, match="slow-delay"):
        resolve_config({"slow-delay": 3.0})  # no slow partition to wait
