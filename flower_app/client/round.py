"""What one client does in one round, written once: the ClientApp (client_app/client_app.py)
runs it for every training message, and the benchmarks that replay rounds outside Flower
(benchmarks/overhead/loop.py; benchmarks/centralised/training.py: ``train_steps``) run it as is.

1. **receive**: the global arrays and the client's own parts into the adapted model (``receive``);
2. **seed**: the partition's loader and torch's global generator (dropout) with ``round_seed`` =
   run seed + 1000 x round + partition id, so a round trains the same wherever it runs;
3. **train** the round's parts (``Method.trained_parts``) with the run's settings
   (``train_steps``; DP-SGD steps under ``dp=example``, flower_app/privacy/dp_sgd.py);
4. **reply**: the trained shared arrays and the metrics (``RoundReply``), and the own parts kept.

Fault injection is no part of a round: it is a client mod (flower_app/client/faults.py)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from flower_app.modeling import pick_device
from flower_app.privacy.dp_sgd import ClientAccountant, DpSgd, plan_round
from flower_app.privacy.dp_sgd_mechanism import DATA_DEPENDENT_KEYS
from flower_app.settings.config import RunConfig
from flower_app.task_data import load_task_data, make_loader, tokenized_split
from flower_app.training.loop import TrainResult, train_local
from flower_app.training.lr_schedule import round_lr_factor
from flower_app.training.precision import MixedPrecision

if TYPE_CHECKING:
    import datasets
    from flwr.app import RecordDict
    from torch import nn
    from torch.utils.data import DataLoader

    from flower_app.adapted import AdaptedModel


def round_seed(config: RunConfig, server_round: int, partition_id: int) -> int:
    """The seed of a partition's round: its loader's shuffle and torch's generator."""
    return config.seed + 1000 * server_round + partition_id


def _round_loader(
    config: RunConfig, partition_id: int, num_partitions: int, server_round: int
) -> tuple[datasets.Dataset, DataLoader, int]:
    """A partition's training split in ``server_round``: the dataset, its loader shuffled
    with ``round_seed``, and that seed."""
    dataset = tokenized_split(config, "train", partition_id, num_partitions)
    seed = round_seed(config, server_round, partition_id)
    return dataset, make_loader(dataset, config.batch_size, shuffle=True, seed=seed), seed


@dataclass(frozen=True)
class LocalBatches:
    """A client's training data as a method's query before training reads it
    (``Method.answer_query``): its partition's loader shuffled with the round's seed
    (``seed``, also for torch's generator), the task kind's training loss, the run's
    precision and device."""

    loader: Any
    loss_fn: Any
    mixed: MixedPrecision
    device: torch.device
    seed: int


def local_batches(
    config: RunConfig, partition_id: int, num_partitions: int, server_round: int = 0
) -> LocalBatches:
    """The ``LocalBatches`` of a partition in ``server_round`` (0: before training)."""
    _, loader, seed = _round_loader(config, partition_id, num_partitions, server_round)
    device = pick_device(config.device)
    return LocalBatches(
        loader,
        load_task_data(config).kind.training_loss,
        MixedPrecision.for_run(config.precision, device),
        device,
        seed,
    )


def receive(
    adapted: AdaptedModel,
    shared: Mapping[str, np.ndarray],
    local: Mapping[str, np.ndarray] | None = None,
) -> None:
    """Load the global arrays and the client's own parts (``Method.local``; ``None``: their
    zero initialisation) into ``adapted``."""
    adapted.load_shared_state(shared)
    adapted.load_local_state(local)


def train_steps(
    config: RunConfig,
    model: nn.Module,
    loader: DataLoader,
    *,
    max_steps: int | None = None,
    description: str = "local training",
    lr_factor: float = 1.0,
    dp_sgd: DpSgd | None = None,
) -> TrainResult:
    """Train ``model`` on ``loader`` with the run's settings: a fresh AdamW (the adapter at
    ``learning-rate``, the head at ``RunConfig.head_lr``, ``weight-decay``) for
    ``local-epochs`` passes or ``local-steps`` steps (``max_steps`` overrides both: that
    many steps), on ``device``, with the ``progress-bar``, minimising the task kind's
    training loss (flower_app/task_kinds/), the forward under the run's ``precision``
    (``flower_app.training.precision.MixedPrecision``). ``lr_factor`` multiplies both rates (the
    round's ``lr-schedule`` factor: flower_app/training/lr_schedule.py)."""
    device = pick_device(config.device)
    return train_local(
        model,
        loader,
        epochs=config.local_epochs,
        max_steps=config.local_steps if max_steps is None else max_steps,
        lr=config.learning_rate * lr_factor,
        head_lr=config.head_lr * lr_factor,
        weight_decay=config.weight_decay,
        device=device,
        progress=config.progress_bar,
        description=description,
        loss_fn=load_task_data(config).kind.training_loss,
        mixed=MixedPrecision.for_run(config.precision, device),
        dp_sgd=dp_sgd,
    )


# The reply's metrics computed from the client's data without noise, outside any DP
# guarantee (docs/privacy.md): with dp on and dp-unnoised-metrics=withhold they stay on the
# node. (train-seconds too: under DP-SGD's Poisson sampling a round's time tracks how many
# examples it drew.)
UNNOISED_METRICS = ("train-loss", "train-seconds", *DATA_DEPENDENT_KEYS)


def withholds_unnoised_metrics(config: RunConfig) -> bool:
    """Whether this run's clients keep ``UNNOISED_METRICS`` to themselves."""
    return config.dp != "off" and config.dp_unnoised_metrics == "withhold"


@dataclass
class RoundReply:
    """What a round produced: the ``shared`` arrays sent up, the ``local`` parts the client
    keeps, and ``metrics`` (the caller's first, then ``num-examples``, ``train-loss``,
    ``steps``, ``train-seconds``)."""

    shared: dict[str, np.ndarray]
    local: dict[str, np.ndarray]
    metrics: dict[str, float] = field(default_factory=dict)
    result: TrainResult | None = None

    def content(self) -> RecordDict:
        """The reply's Flower content: the shared arrays (float32) and the metrics."""
        from flwr.app import MetricRecord, RecordDict

        from flower_app.wire.records import to_array_record

        return RecordDict(
            {"arrays": to_array_record(self.shared), "metrics": MetricRecord(self.metrics)}
        )


def train_round(
    config: RunConfig,
    adapted: AdaptedModel,
    *,
    server_round: int,
    partition_id: int,
    num_partitions: int,
    metrics: Mapping[str, Any] | None = None,
    accountant: ClientAccountant | None = None,
) -> RoundReply:
    """One client's training in round ``server_round``, after ``receive``: its partition
    of the training split shuffled and torch seeded with ``round_seed``, ``train_steps``,
    and the reply (``metrics`` come first in the reply's metrics).

    ``accountant`` (``dp=example``, flower_app/privacy/dp_sgd.py): the client's privacy ledger; the
    round trains with DP-SGD (refused with ``DpBudgetExceeded`` past ``dp-max-epsilon``),
    is composed into it, and the reply adds ``dp-sgd-epsilon`` (after this round),
    ``dp-sgd-noise-multiplier``, ``dp-sgd-delta`` and what the mechanism did (clipped
    fraction, norms, noise: flower_app/privacy/dp_sgd_mechanism.py); ``num-examples`` is then the
    partition's size n (the count of Poisson-sampled examples would reveal the sampling).
    With dp on and ``dp-unnoised-metrics=withhold`` the reply leaves out
    ``UNNOISED_METRICS``."""
    dataset, loader, seed = _round_loader(config, partition_id, num_partitions, server_round)
    dp_sgd = None
    if accountant is not None:
        dp_sgd = private_round(config, accountant, len(dataset), seed, server_round, partition_id)
    # Dropout draws from torch's global generator: seeded per (run seed, round, partition).
    torch.manual_seed(seed)
    adapted.train_parts_of_round(server_round)  # Method.trained_parts: may change by round
    t0 = time.perf_counter()
    result = train_steps(
        config,
        adapted.model,
        loader,
        description=f"round {server_round} partition {partition_id}",
        lr_factor=round_lr_factor(config, server_round),
        dp_sgd=dp_sgd,
    )
    adapted.model.to("cpu")
    reply = RoundReply(
        adapted.uplink_state(server_round), adapted.local_state(), dict(metrics or {}), result
    )
    reply.metrics.update(
        {
            "num-examples": result.num_examples,
            "train-loss": result.loss,
            "steps": result.steps,
            "train-seconds": time.perf_counter() - t0,
        }
    )
    if accountant is not None and dp_sgd is not None:
        accountant.record(dp_sgd.plan)
        reply.metrics.update(
            {
                "num-examples": len(dataset),
                "dp-sgd-epsilon": accountant.epsilon(),
                "dp-sgd-noise-multiplier": dp_sgd.plan.noise_multiplier,
                "dp-sgd-delta": dp_sgd.plan.delta,
                **(result.dp_mechanism or {}),  # what the mechanism did (dp_sgd_mechanism.py)
            }
        )
    if withholds_unnoised_metrics(config):
        for key in UNNOISED_METRICS:
            reply.metrics.pop(key, None)
    return reply


def private_round(
    config: RunConfig,
    accountant: ClientAccountant,
    num_examples: int,
    seed: int,
    server_round: int,
    partition_id: int,
) -> DpSgd:
    """The round's DP-SGD: the task kind must allow it, the plan within ``dp-max-epsilon``,
    the generators from OS entropy (or ``seed`` with ``dp-sgd-seeded-noise``)."""
    kind = load_task_data(config).kind
    if kind.example_dp_refusal:
        raise ValueError(
            f"dp: dp=example refused for task kind {kind.name!r}: {kind.example_dp_refusal}"
        )
    where = f"partition {partition_id} in round {server_round}"
    plan = plan_round(config, accountant, num_examples, where=where)
    return DpSgd(plan, seed if config.dp_sgd_seeded_noise else None)
