"""The server side every method of this package shares unless it overrides it: the common
Flower strategy (``strategies/server/strategy.py``) built from the run's settings, central
differential privacy's mean mechanism and its settings' checks.

Each method folder's ``method.py`` defines its methods as ``BaseMethod`` objects (or of a
subclass); the contract itself, what the core reads of a method, is
``flower_app/methods/contract.py``. The server-side hooks below import the server's parts
inside themselves: a ClientApp loads this module (its methods' client hooks) and never
runs them.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from flower_app.methods.contract import Method
from flower_app.privacy.checks import check_dp_settings

if TYPE_CHECKING:
    from flower_app.settings.run_settings import RunSettings
    from strategies.server.strategy import AdapterStrategy


class BaseMethod(Method):
    """A method run by the common strategy, with the mean mechanism under dp=central."""

    # -- settings -----------------------------------------------------------------------
    def check_settings(self, config: RunSettings) -> None:
        """The contract's checks, and with ``dp=central``: a method with a mechanism
        (``dp_mechanism``), C > 0, z > 0, 0 < delta < 1, uniform weights
        (``flower_app.privacy.checks.check_dp_settings``), no saved client updates, and the
        accountant's package installed."""
        super().check_settings(config)
        if config.dp != "central":
            return
        from importlib.util import find_spec

        self.check_dp_supported()
        check_dp_settings(
            clipping_norm=config.dp_clipping_norm,
            noise_multiplier=config.dp_noise_multiplier,
            delta=config.dp_delta,
            aggregation_weights=config.aggregation_weights,
        )
        if config.save_client_updates:
            raise ValueError(
                "save-client-updates: refused under dp=central (the files would hold every "
                "client's update before clipping and noise; docs/privacy.md)"
            )
        if find_spec("dp_accounting") is None:
            raise ValueError('dp: dp=central needs dp-accounting: pip install "flwr[dp]"')

    def check_dp_supported(self) -> str:
        """The mechanism's name, or ValueError saying why the method has none."""
        if self.dp_mechanism is None:
            raise ValueError(
                self.dp_refusal
                or f"dp: dp=central is not supported for method {self.name!r}: it declares no "
                "differential-privacy mechanism (docs/privacy.md)"
            )
        return self.dp_mechanism

    def central_dp(self, config: RunSettings) -> Any:
        """The strategy's ``dp`` (a ``strategies.server.central_dp.CentralDP``, noise from OS
        entropy), or None with ``dp=off``."""
        if config.dp != "central":
            return None
        from strategies.server.central_dp import CentralDP

        return CentralDP(
            self.check_dp_supported(),
            config.dp_clipping_norm,
            config.dp_noise_multiplier,
            config.dp_delta,
            # Poisson sampling at q = fraction-train is what amplification assumes; a fixed
            # sample size is accounted at q = 1 (strategies/server/client_sampling.py)
            sample_rate=config.fraction_train if config.client_sampling == "poisson" else 1.0,
        )

    # -- server side --------------------------------------------------------------------
    def build_strategy(
        self,
        config: RunSettings,
        initial_state: Mapping[str, np.ndarray],
        *,
        fingerprint: int | None = None,
        run_dir: Path | None = None,
    ) -> AdapterStrategy:
        """The common strategy running this method's ``aggregate`` and ``aggregate_private``
        (a method with a strategy of its own overrides this and adds its own options, each
        read from ``config``); the arguments as the contract's."""
        from strategies.server.strategy import AdapterStrategy

        return AdapterStrategy(
            initial_state, method=self, **self.strategy_settings(config, run_dir=run_dir)
        )

    def aggregate_private(
        self,
        dp: Any,
        sent: Mapping[str, np.ndarray],
        payloads: list[dict[str, np.ndarray]],
        num_sampled: float,
    ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """One round under dp=central (``dp``: a ``strategies.server.central_dp.CentralDP``):
        the whole new state and the round's metrics; ``num_sampled`` is the public divisor
        m (the count sampled, an int, or q N under Poisson sampling, a float). By default
        the mean mechanism, right for every method whose rule averages the shared arrays."""
        from strategies.server.central_dp import mean_mechanism

        # the parts the clients trained this round (``trained_parts``); the others stay
        uplink = {k: v for k, v in sent.items() if k in payloads[0]}
        new_state, info = mean_mechanism(dp, uplink, payloads, num_sampled)
        return {**sent, **new_state}, info

    def aggregate_secure(
        self,
        strategy: AdapterStrategy,
        server_round: int,
        mean: dict[str, np.ndarray],
        clients: int,
    ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """One round under secure aggregation, from ``mean``, the weighted mean contribution
        (``secure_contribution``) of ``clients`` survivors: the whole new state and the
        round's diagnostics. 'mean': the strategy's rule over ``mean`` as one reply of
        weight 1, which is its rule over the replies when the rule is linear in them
        (tests: every such method); the head is the mean head."""
        new_state, info = strategy.aggregate_adapter(server_round, [mean], np.ones(1))
        new_state.update({key: mean[key] for key in strategy.head_keys()})
        return {**strategy.global_state, **new_state}, info

    def secure_private_contribution(
        self, arrays, received, clipping_norm, server_round, *, config=None
    ):
        """The mean mechanism's client side: the update over every uploaded array, head
        included, clipped jointly to C (``clip_update``)."""
        from strategies.server.central_dp import clip_update, flat_norm

        update = {
            key: np.asarray(value, np.float64) - np.asarray(received[key], np.float64)
            for key, value in arrays.items()
        }
        return clip_update(update, clipping_norm), flat_norm(update) > clipping_norm

    def aggregate_secure_private(
        self,
        strategy: AdapterStrategy,
        server_round: int,
        sums: dict[str, np.ndarray],
        clients: int,
    ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """dp=central on the masked sum (the mean mechanism, docs/privacy.md section 2): the
        survivors' clipped updates ``sums`` = Σ uₙ plus N(0, (zC)² I) drawn on the server,
        divided by the public m (``private_divisor``), added to the sent state; then the
        method's rule over that release (``aggregate_secure``: post-processing)."""
        dp = strategy.dp
        m, sampled = strategy.private_divisor(server_round, clients)
        std = dp.noise_multiplier * dp.clipping_norm
        released = {
            key: origin + (sums[key] + dp.rng.normal(0.0, std, origin.shape)) / m
            for key, origin in self.secure_release_origin(strategy, server_round).items()
        }
        new_state, info = self.aggregate_secure(strategy, server_round, released, clients)
        return new_state, {**info, "dp-noise-std": std / m, **sampled}

    def secure_release_origin(
        self, strategy: AdapterStrategy, server_round: int
    ) -> dict[str, np.ndarray]:
        """What each released mean update is added to, in the order the noise is drawn (the
        plain mechanism's): the sent state's uplink arrays (float64)."""
        return {
            key: np.asarray(value, np.float64)
            for key, value in strategy.uplink_state(server_round).items()
        }

    def strategy_settings(
        self, config: RunSettings, *, run_dir: Path | None = None
    ) -> dict[str, Any]:
        """The ``AdapterStrategy`` arguments every method takes from the settings:
        sampling (fixed-size or Poisson, seeded from the run's ``seed`` without DP),
        weighting, whether clients evaluate, where client updates are saved,
        screening, central differential privacy, encodings, asynchronous rounds,
        over-selected synchronous ones, secure aggregation, the virtual clock and the
        product-gap diagnostic."""
        from flower_app.secure.settings import secaggplus_settings
        from strategies.server.buffered_update import AsyncSettings
        from strategies.server.example_dp import example_dp_record
        from strategies.server.overselected_rounds import OverselectSettings
        from strategies.server.secure_rounds import SecureRoundSettings
        from strategies.server.virtual_clock import ClockSettings

        save = run_dir is not None and config.save_client_updates
        async_rounds = (
            AsyncSettings(
                concurrency=config.async_concurrency,
                buffer_size=config.async_buffer_size,
                staleness_exponent=config.async_staleness_exponent,
                max_staleness=config.async_max_staleness,
                seed=config.seed,
                server_lr=config.async_server_lr,
            )
            if config.round_mode == "async"
            else None
        )
        overselected_rounds = (
            OverselectSettings(
                fraction=config.overselect_fraction,
                deadline=config.round_deadline,
                seed=config.seed,
            )
            if config.round_mode == "sync-overselect"
            else None
        )
        return {
            "fraction_train": config.fraction_train,
            "min_train_nodes": config.min_train_nodes,
            "min_available_nodes": config.min_available_nodes,
            "weighting": config.aggregation_weights,
            "clients_evaluate": self.evaluates_on_clients(config),
            "updates_dir": Path(run_dir) / "updates" if save else None,
            "screen_updates": config.screen_updates,
            "screen_kappa": config.screen_kappa,
            "dp": self.central_dp(config),
            "example_dp": example_dp_record(config),
            "client_sampling": config.client_sampling,
            "sampling_seed": config.seed,
            "uplink_encoding": config.uplink_encoding,
            "downlink_encoding": config.downlink_encoding,
            "encoding_seed": config.seed,
            "product_gap": config.product_gap,
            "async_rounds": async_rounds,
            "overselected_rounds": overselected_rounds,
            "secure": SecureRoundSettings(
                secaggplus_settings(config), int(config.secure_uplink_limit_mb * 2**20)
            )
            if config.secure_aggregation == "secaggplus"
            else None,
            "virtual_clock": ClockSettings(
                config.local_steps, config.local_epochs, config.batch_size
            )
            if config.virtual_clock
            else None,
        }
