"""The communication a run will use, projected before it starts from its base model's config
alone (``project``; the model is built on the meta device: no weights are read).

Per round each sampled client receives and sends its method's shared parts
(``flower_app.methods.communication.round_communication``, every registered method read
generically); the clients per round are Flower FedAvg's, max(⌊N · fraction-train⌋,
min-train-nodes) of the N SuperNodes (``clients_per_round``), over ``num-server-rounds``
rounds after a method's round 0 where it has one. Bytes are the arrays' entries under the
run's ``uplink-encoding`` / ``downlink-encoding``
(``flower_app.methods.communication.RoundCommunication.encoded``); MB are the FlowerTune
templates' (bytes / 1024²). docs/flowertune.md, "The rules, checked before launch".
"""

from __future__ import annotations

from dataclasses import dataclass

from flower_app.preflight.leaderboard import megabytes
from flower_app.settings.config import ConfigError, RunConfig


@dataclass(frozen=True)
class Projection:
    """One method's projected communication for a run's settings."""

    method: str
    clients_per_round: int
    up_params: int  # one client, round 1
    down_params: int
    rounds: int
    run_up_params: int = 0  # one client, every round (a method's uplink may change by round)
    run_down_params: int = 0  # one client, every round and round 0 (a one-off download)
    round_bytes_per_client: int = 0  # down and up, round 1, under the run's encodings
    run_bytes_per_client: int = 0  # down and up, every round and round 0

    @property
    def round_params(self) -> int:
        """Every sampled client's down and up, one round (round 1)."""
        return self.clients_per_round * (self.up_params + self.down_params)

    @property
    def round_mb(self) -> float:
        if self.round_bytes_per_client:
            return megabytes(self.clients_per_round * self.round_bytes_per_client, 1)
        return megabytes(self.round_params)

    @property
    def total_mb(self) -> float:
        if self.run_bytes_per_client:
            return megabytes(self.clients_per_round * self.run_bytes_per_client, 1)
        up = self.run_up_params or self.up_params * self.rounds
        down = self.run_down_params or self.down_params * self.rounds
        return megabytes(self.clients_per_round * (up + down))


def clients_per_round(config: RunConfig, num_supernodes: int) -> int:
    """The nodes Flower's FedAvg samples each round out of ``num_supernodes``."""
    if config.fraction_train == 0.0:
        return 0
    return max(int(num_supernodes * config.fraction_train), config.min_train_nodes)


def adapted_layer_shapes(config: RunConfig, kind: str) -> dict[str, tuple[int, int]]:
    """(d_out, d_in) of every module the run adapts (``target-modules``, or the task kind's
    own), from the base model's config on the meta device. A model whose config cannot be
    read (a Hub name this machine cannot reach) is a ConfigError naming ``model``."""
    import torch
    from transformers import AutoConfig, AutoModel

    from flower_app.adapters.targets import find_target_linears
    from flower_app.modeling import resolve_model_source
    from flower_app.preflight.hub import hub_problem
    from flower_app.task_kinds import get_kind

    source = resolve_model_source(config.model)
    if source == config.model and not _is_local(source):
        problem = hub_problem(source, "model")
        if problem is not None:
            raise ConfigError(f"model: cannot read its config to project communication: {problem}")
    try:
        model_config = AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as err:
        raise ConfigError(f"model: cannot read the config of {config.model!r}: {err}") from None
    with torch.device("meta"):
        model = AutoModel.from_config(model_config)
    names = get_kind(kind).target_modules(config).split(",")
    targets = tuple(t.strip() for t in names if t.strip())
    linears = find_target_linears(model, targets)
    return {name: (int(m.out_features), int(m.in_features)) for name, m in linears.items()}


def _is_local(source: str) -> bool:
    from pathlib import Path

    return Path(source).expanduser().exists()


def project(
    config: RunConfig,
    layer_shapes: dict[str, tuple[int, int]],
    num_supernodes: int,
    methods: tuple[str, ...] | None = None,
) -> list[Projection]:
    """Each of ``methods`` (default: every registered one) at the run's rank, sampling,
    rounds and the methods' own settings (what a method sends down may depend on them). A
    method the shapes do not admit is left out."""
    from flower_app.methods.communication import round_communication
    from flower_app.methods.registry import method_names

    clients = clients_per_round(config, num_supernodes)
    out: list[Projection] = []
    for method in methods or tuple(method_names()):
        rounds = config.num_server_rounds
        try:
            by_round = [
                round_communication(
                    method,
                    layer_shapes,
                    config.rank,
                    0,
                    max(clients, 1),
                    config=config,
                    server_round=t,
                )  # fmt: skip
                for t in range(max(rounds, 1) + 1)  # round 0 (a method's initialisation),
            ]  # then each round: a method's uplink may change by round, a download be one-off
        except ValueError:
            continue
        zeroth, first = by_round[0], by_round[1]
        run_up = zeroth.up_params + sum(c.up_params for c in by_round[1 : rounds + 1])
        run_down = zeroth.down_params + sum(c.down_params for c in by_round[1 : rounds + 1])
        encodings = (config.uplink_encoding, config.downlink_encoding)
        # round 0's gradients travel float32 (a query, not a training message)
        run_bytes = 4 * (zeroth.up_params + zeroth.down_params) + sum(
            sum(c.encoded(*encodings)) for c in by_round[1 : rounds + 1]
        )
        out.append(
            Projection(
                method,
                clients,
                first.up_params,
                first.down_params,
                rounds,
                run_up,
                run_down,
                sum(first.encoded(*encodings)),
                run_bytes,
            )  # fmt: skip
        )
    return out
