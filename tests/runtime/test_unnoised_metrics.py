"""``dp-unnoised-metrics``: with DP on, what a client computes from its data without noise
(train loss, timing, DP-SGD's clipped fraction and gradient norms) is sent by default and
kept on the node with ``withhold``; the update itself is the same bit for bit, and the
settings that would undo or not need it are refused naming the key."""

from __future__ import annotations

import numpy as np
import pytest

from flower_app.cache.per_process import cached_adapted_model
from flower_app.client.round import UNNOISED_METRICS, receive, train_round
from flower_app.privacy.dp_sgd import ClientAccountant
from flower_app.privacy.dp_sgd_mechanism import DATA_DEPENDENT_KEYS
from flower_app.settings.config import ConfigError, resolve_config


@pytest.fixture(scope="module")
def client_settings(tiny_client_settings):
    return {**tiny_client_settings, "method": "florg", "dp": "example", "dp-sgd-seeded-noise": True}


def one_round(settings: dict, choice: str):
    config = resolve_config({}, {**settings, "dp-unnoised-metrics": choice})
    adapted = cached_adapted_model(config, 2)
    receive(adapted, adapted.shared_state())
    reply = train_round(
        config,
        adapted,
        server_round=1,
        partition_id=0,
        num_partitions=2,
        accountant=ClientAccountant(),
    )
    return reply


def test_withhold_keeps_the_unnoised_metrics_on_the_node_and_the_update_unchanged(
    client_settings,
):
    sent = one_round(client_settings, "send")
    kept = one_round(client_settings, "withhold")
    # sent by default: every unnoised key this round computed (a round that drew examples)
    assert set(UNNOISED_METRICS) <= set(sent.metrics)
    assert not set(UNNOISED_METRICS) & set(kept.metrics)
    # what the privacy record and the server's noise report need still travels
    for key in ("dp-sgd-epsilon", "dp-sgd-noise-multiplier", "dp-sgd-sum-noise-std",
                "dp-sgd-expected-batch", "dp-sgd-trained-params", "num-examples"):  # fmt: skip
        assert kept.metrics[key] == sent.metrics[key], key
    assert set(sent.metrics) - set(kept.metrics) == set(UNNOISED_METRICS)
    # the mechanism's data-dependent statistics are among what is withheld
    assert set(DATA_DEPENDENT_KEYS) <= set(UNNOISED_METRICS)
    for key, value in sent.shared.items():
        np.testing.assert_array_equal(kept.shared[key], value, err_msg=key)


def test_withhold_without_dp_is_refused_naming_the_key(client_settings):
    with pytest.raises(ConfigError, match="dp-unnoised-metrics"):
        resolve_config({}, {**client_settings, "dp": "off", "dp-unnoised-metrics": "withhold"})


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"method": "fedsa-lora"}, "personal parts"),
        ({"method": "florg", "client-eval": "on"}, "client-eval=on"),
    ],
)
def test_withhold_refuses_client_evaluation(client_settings, overrides, reason):
    settings = {**client_settings, "dp": "central", "dp-unnoised-metrics": "withhold"}
    with pytest.raises(ConfigError, match="client-eval") as err:
        resolve_config({}, {**settings, **overrides})
    assert reason in str(err.value)
    # with the clients' evaluation off the same run is accepted
    config = resolve_config({}, {**settings, **overrides, "client-eval": "off"})
    assert config.dp_unnoised_metrics == "withhold"
