"""What a federated method is to the core: ``Method``, its client side, its server side and its
flags in one object. The core reads methods only through this contract and the registry
(``registry.py``) and never imports a method; the method folders (``strategies/<name>/``)
register objects of ``strategies.shared.base_method.BaseMethod``, which adds the shared server side.

- client side: the adapter kind (``adapter``), which parts travel (``shared``), stay on the
  client (``local``) or stay frozen (``frozen``), ``lora_init``, hooks for received messages;
- server side: its strategy (``build_strategy``) and rule (``aggregate``; under ``dp=central``
  ``aggregate_private``), called only by the server;
- flags the core reads, never a method's name (``heterogeneous_ranks``, ``dp_mechanism``,
  ``async_update``, ...), the communication hooks and the method's own ``settings``.
docs/architecture.md, "Adding a method", says what each declares and why."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, is_dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from flower_app.adapters.registry import AdapterKind, adapter_kind_names, get_adapter_kind

if TYPE_CHECKING:  # types only: the dependency runs settings -> methods, never back
    from flwr.serverapp.strategy import Strategy

    from flower_app.settings.run_settings import RunSettings

# The model carrying a method's adapter (flower_app.adapted.AdaptedModel, built from the
# settings and the method): read by attribute, never imported (it imports the methods).
AdaptedModel = Any


@dataclass(frozen=True)
class Method:
    """One federated method; subclass it to override a hook (see the module docstring)."""

    name: str
    summary: str
    adapter: str
    shared: tuple[str, ...]
    local: tuple[str, ...] = ()
    frozen: tuple[str, ...] = ()
    # Its own run settings: a frozen dataclass of ``setting(...)`` fields (None: it has
    # none); the run config reads them as attributes, ``config.<field>``.
    settings: type | None = None
    # -- flags the common strategy and the settings' checks read ----------------------
    # Whether its clients may train at different ranks (``client-ranks``, a node's
    # ``rank``); its rule then aggregates them.
    heterogeneous_ranks: bool = False
    # Its central-DP mechanism ('mean', 'product-mean', 'gram'; docs/privacy.md), which
    # ``aggregate_private`` implements; None: dp=central is refused, with ``dp_refusal``.
    dp_mechanism: str | None = None
    dp_refusal: str = ""
    # Releases under dp=central before round 1 (a round 0 whose replies the server noises,
    # such as a federated initialisation), at the run's q: a run of T rounds composes
    # T + this many in its accountant, which a z sized for a target epsilon must count.
    dp_initial_releases: int = 0
    # Why dp=example (DP-SGD on each client) cannot run it; '' (every method so far): it can,
    # since DP-SGD protects whatever the client computes from its trained parameters.
    example_dp_refusal: str = ""
    # Whether it writes into the frozen base weights W0 during the run (e.g. a
    # residual fold): refused with a half-precision or quantised W0.
    writes_base_weights: bool = False
    # How a buffered asynchronous update (``round-mode=async``) takes replies trained from
    # an older model (strategies/server/buffered_rounds.py): 'mean' (its rule is a weighted
    # mean of each shared part, so the update is the current model plus the mean of the
    # replies' staleness-scaled deltas), 'gram' (FLoRG's Gram average, moved by each
    # reply's Aₙᵀ Aₙ − A_τᵀ A_τ); None: refused, with ``async_refusal``.
    async_update: str | None = None
    async_refusal: str = ""
    # What its clients add up under ``secure-aggregation`` (docs/secure-aggregation.md):
    # 'mean' (the uploaded arrays: its rule is linear in the replies, so the rule over their
    # weighted mean is the rule over them), 'gram' (FLoRG: each layer's Gram AₙᵀAₙ, or one
    # per block of A's rows where its server step splits A, which that step decomposes),
    # 'product' (each LoRA layer's product BₙAₙ, whose mean its server step re-factors by
    # truncated SVD), 'mean-and-product' (the uploaded arrays and each layer's BₙAₙ: a rule
    # of their means that is not linear in the replies, such as a residual Σ wₙBₙAₙ − B̄Ā);
    # None: refused, with ``secure_refusal``.
    secure_sum: str | None = None
    secure_refusal: str = ""

    def __post_init__(self) -> None:
        if self.adapter not in adapter_kind_names():
            raise ValueError(f"method {self.name!r}: adapter must be one of {adapter_kind_names()}")
        self.kind.check_method(self)
        if set(self.shared) & (set(self.local) | set(self.frozen)):
            raise ValueError(f"method {self.name!r}: a shared part cannot be local or frozen")
        if self.settings is not None and not (
            is_dataclass(self.settings) and self.settings.__dataclass_params__.frozen
        ):
            raise TypeError(f"method {self.name!r}: settings must be a frozen dataclass")

    @property
    def kind(self) -> AdapterKind:
        """Its adapter kind (``flower_app/adapters/``): parts, shapes, the model side."""
        return get_adapter_kind(self.adapter)

    # -- client side --------------------------------------------------------------------
    def trained_parts(self, server_round: int) -> tuple[str, ...]:
        """The shared parts its clients train and send up in round ``server_round`` (all of
        ``shared`` for most methods; an alternating method trains one part a round, and a
        method whose server re-factorises a part sends it down without training it). The
        other shared parts still travel down: a client may have missed the last round."""
        return self.shared

    def uplink(
        self, state: Mapping[str, np.ndarray], server_round: int
    ) -> Mapping[str, np.ndarray]:
        """What of a state (a client's or the global one) travels up in ``server_round``: the
        head and the ``trained_parts``; ``state`` itself when every shared part trains."""
        parts = self.trained_parts(server_round)
        if set(parts) == set(self.shared):
            return state
        left_out = tuple(f".{self.kind.part_key(p)}" for p in self.shared if p not in parts)
        return {k: v for k, v in state.items() if not k.endswith(left_out)}

    @property
    def personal(self) -> bool:
        """Whether clients keep parts of their own (then they evaluate by default)."""
        return bool(self.local)

    def evaluates_on_clients(self, config: RunSettings) -> bool:
        """Whether clients evaluate every round (``client-eval``: 'on', 'off', or 'auto':
        when the method has personal parts)."""
        return config.client_eval == "on" or (config.client_eval == "auto" and self.personal)

    def lora_init(self, config: RunSettings) -> str:
        """The LoRA initialisation its clients use, one of ``LORA_INITS``
        (``flower_app/adapters/lora/layer.py``): 'default' or 'svd'."""
        return "default"

    def adapter_alpha(self, config: RunSettings) -> float:
        """The scaling numerator of its adapter, s = alpha / rank: the ``alpha`` setting,
        unless the method's authors fix the scale (LoRA-SB's: s = 1)."""
        return float(config.alpha)

    def florg_signs(self, rank: int) -> tuple[float, ...] | None:
        """A FLoRG adapter's row signs D in ``s L AᵀDA R`` (None: the paper's D = I)."""
        return None

    def prepare_model(self, adapted: AdaptedModel) -> None:
        """Called once after the adapter is injected (e.g. to keep a copy of W0)."""

    def receive_on_client(self, msg: Any, context: Any, adapted: AdaptedModel) -> dict[str, float]:
        """Called on the client after the global arrays are loaded, before training or
        evaluating; returns metrics to add to the reply."""
        return {}

    def receive_on_server(self, adapted: AdaptedModel, strategy: Strategy) -> None:
        """Called by the server's evaluator after it loads the global arrays."""

    def answer_query(
        self, config: RunSettings, adapted: AdaptedModel, batches: Any, accountant: Any = None
    ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """The client's reply (arrays, metrics) to a query message, which only a method whose
        strategy runs a round 0 before training sends (``init_round_params``); ``batches``:
        the client's data (``flower_app.client.round.LocalBatches``); ``accountant``: under
        ``dp=example`` the node's DP-SGD ledger (``flower_app.privacy.dp_sgd.ClientAccountant``),
        into which the reply's release must be composed (the caller keeps it), else None."""
        raise NotImplementedError(f"method {self.name!r} sends no query to its clients")

    def secure_contribution(
        self,
        arrays: Mapping[str, np.ndarray],
        server_round: int,
        *,
        received: Mapping[str, np.ndarray] | None = None,
        config: RunSettings | None = None,
    ) -> dict[str, np.ndarray]:
        """What a client adds to the secure sum of ``server_round`` from the ``arrays`` it
        would upload (the caller weights it): the arrays themselves ('mean'); a method that
        sums something else overrides this and ``secure_shapes``. ``received``: the decoded
        state the server sent, ``config``: the run's settings (the client mod passes both;
        a method whose contribution reads them, a rotation toward the state sent, requires them)."""
        return {key: np.asarray(value, np.float64) for key, value in arrays.items()}

    def secure_shapes(self, uplink: Mapping[str, np.ndarray]) -> dict[str, tuple[int, ...]]:
        """The shapes of ``secure_contribution`` for a reply shaped as ``uplink``."""
        return {key: tuple(np.shape(value)) for key, value in uplink.items()}

    def secure_private_contribution(
        self,
        arrays: Mapping[str, np.ndarray],
        received: Mapping[str, np.ndarray],
        clipping_norm: float,
        server_round: int,
        *,
        config: RunSettings | None = None,
    ) -> tuple[dict[str, np.ndarray], bool]:
        """Under ``dp=central``: the contribution made from the update ``arrays`` −
        ``received``, clipped on the client as the server clips a plain private round's,
        and whether it was scaled down (``strategies.shared.base_method`` has the mean
        mechanism's; FLoRG its own). ``config``: the run's settings, as
        ``secure_contribution``'s."""
        raise NotImplementedError(f"method {self.name!r} has no private secure contribution")

    # -- settings -----------------------------------------------------------------------
    def check_settings(self, config: RunSettings) -> None:
        """The checks of the run's settings that depend on the method, each ValueError
        naming its key (``resolve_config`` raises it as a ConfigError): with
        ``client-ranks``, a method whose clients may train at different ranks and no
        dp=central; its adapter kind's checks (``AdapterKind.check_settings``); with
        ``dp=example``, a method that does not refuse it. A method adds its own
        (``strategies.shared.base_method`` adds dp=central's)."""
        if config.client_ranks.strip():
            if not self.heterogeneous_ranks:
                raise ValueError(
                    f"client-ranks: method {self.name!r} aggregates one common rank; "
                    "per-client ranks need a method that aggregates them (heterogeneous_ranks; "
                    "docs/architecture.md lists them)"
                )
            if config.dp == "central":
                raise ValueError("client-ranks: dp=central needs one common rank")
        self.kind.check_settings(config, self)
        if config.dp == "example" and self.example_dp_refusal:
            raise ValueError(
                f"dp: dp=example refused for method {self.name!r}: {self.example_dp_refusal}"
            )

    # -- server side --------------------------------------------------------------------
    def build_strategy(
        self,
        config: RunSettings,
        initial_state: Mapping[str, np.ndarray],
        *,
        fingerprint: int | None = None,
        run_dir: Path | None = None,
    ) -> Strategy:
        """The method's Flower strategy for a run with the settings ``config``, starting
        from ``initial_state``. ``fingerprint``: the L/R fingerprint of the server's model
        (FLoRG checks the clients' against it); ``run_dir``: the run folder
        (``save-client-updates`` writes there). The methods of ``strategies/`` build the
        common strategy by default (``strategies.shared.base_method.BaseMethod``)."""
        raise NotImplementedError(f"method {self.name!r} builds no strategy")

    def aggregate(
        self,
        sent: Mapping[str, np.ndarray],
        payloads: list[dict[str, np.ndarray]],
        weights: np.ndarray,
    ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """The method's server rule: the new adapter arrays (the head is FedAvg'd by the
        strategy) and the round's diagnostics, from the global state ``sent`` (float64) and
        the checked replies ``payloads`` with their normalised ``weights``."""
        raise NotImplementedError(f"method {self.name!r} has no server rule")

    # -- communication (parameters per client, round and adapted layer) -----------------
    def adapter_params(self, d_out: int, d_in: int, r: int) -> int:
        """The shared adapter parameters of one layer: received down every round."""
        return self.kind.part_params(self.shared, d_out, d_in, r)

    def up_adapter_params(self, d_out: int, d_in: int, r: int, server_round: int = 1) -> int:
        """The adapter parameters of one layer a client sends up in ``server_round``: its
        trained parts (``trained_parts``)."""
        return self.kind.part_params(self.trained_parts(server_round), d_out, d_in, r)

    def adapter_rows(self, d_out: int, d_in: int, r: int, server_round: int | None = None) -> int:
        """The rows of one layer's shared parts (``server_round``: of those sent up that
        round; None: every shared part, as sent down)."""
        parts = self.shared if server_round is None else self.trained_parts(server_round)
        return self.kind.part_rows(parts, d_out, d_in, r)

    def extra_down_params(
        self, d_out: int, d_in: int, r: int, num_clients: int, config: RunSettings | None
    ) -> int:
        """Whatever else one layer sends down per client and round (0 for most methods);
        ``config``: the run's settings (None: the method's own at their defaults)."""
        return 0

    def extra_down_in_round(self, server_round: int) -> bool:
        """Whether ``extra_down_params`` travels in ``server_round`` (every round for most
        methods; a method that sends a node something once, with its first training
        message, counts it in round 1, when every node of a full-participation run gets it)."""
        return True

    def init_round_params(self, d_out: int, d_in: int, r: int) -> tuple[int, int]:
        """(up, down) parameters of one layer per client in round 0, before training: (0, 0)
        for most methods, whose round 0 only evaluates the initial model."""
        return 0, 0


def adapter_layers(state: Mapping[str, np.ndarray]) -> list[str]:
    """The adapted layers of a state, in its order (``flower_app.wire.records.split_state``)."""
    from flower_app.wire.records import split_state

    return list(split_state(state)[0])


def stacked(payloads: list[dict[str, np.ndarray]], key: str) -> list[np.ndarray]:
    """Every client's array ``key``, in float64, in the order of ``payloads``."""
    return [np.asarray(p[key], np.float64) for p in payloads]
