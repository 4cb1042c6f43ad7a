"""Local training (AdamW over the trainable parameters) and evaluation loops.

The optimiser has two parameter groups when the task head's learning rate differs from the
adapter's (the run setting ``head-learning-rate``): the adapter matrices (FLoRG's ``A``,
LoRA's ``lora_A`` / ``lora_B``) train at ``lr``, every other trained parameter (the task
head, and anything else a method leaves trainable) at ``head_lr``. With equal rates (the
default) there is one group of every trained parameter."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.utils.data import DataLoader

from flower_app.privacy.dp_sgd import DpSgd, PrivateTraining, private_training
from flower_app.training.precision import MixedPrecision


@dataclass(frozen=True)
class TrainResult:
    """A local training's mean loss, examples and steps; under ``dp=example`` also what
    DP-SGD's mechanism did (``dp_mechanism``: flower_app/privacy/dp_sgd_mechanism.py's metrics)."""

    loss: float
    num_examples: int
    steps: int
    dp_mechanism: dict[str, float] | None = None


@dataclass(frozen=True)
class EvalResult:
    loss: float
    accuracy: float
    num_examples: int


# The loss of a training step: (model, batch) -> scalar tensor. Each task kind has its own
# (flower_app/task_kinds/: ``TaskKind.training_loss``); the default is the model's own loss.
LossFn = Callable[[nn.Module, Mapping[str, torch.Tensor]], torch.Tensor]


def model_loss(model: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The model's own loss: the batch carries its targets."""
    return model(**batch).loss


def _batch_to(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in batch.items()}


def is_adapter_parameter(name: str) -> bool:
    """Whether the parameter called ``name`` (``model.named_parameters()``) is an adapter
    matrix: FLoRG's ``<layer>.A``, PEFT's ``<layer>.lora_A.<adapter>.weight`` /
    ``lora_B`` or LoRA-SB's ``<layer>.R``; the rest of what trains is the task head."""
    return (
        name in ("A", "R")
        or name.endswith((".A", ".R"))
        or ".lora_A." in name
        or ".lora_B." in name
    )


def make_optimizer(
    model: nn.Module, *, lr: float, head_lr: float | None = None, weight_decay: float
) -> torch.optim.AdamW:
    """AdamW over the trainable parameters of ``model``: the adapter at ``lr``, everything
    else at ``head_lr`` (``None``: ``lr``). Equal rates give one parameter group."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("the model has no trainable parameters")
    if head_lr is None or head_lr == lr:
        return torch.optim.AdamW([p for _, p in named], lr=lr, weight_decay=weight_decay)
    adapter = [p for n, p in named if is_adapter_parameter(n)]
    rest = [p for n, p in named if not is_adapter_parameter(n)]
    groups = [
        {"params": params, "lr": rate}
        for params, rate in ((adapter, lr), (rest, head_lr))
        if params
    ]
    return torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay)


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: dict[str, torch.Tensor],
    step: int = 0,
    loss_fn: LossFn = model_loss,
    mixed: MixedPrecision | None = None,
) -> torch.Tensor:
    """One optimiser step on ``batch`` (on the model's device already) minimising
    ``loss_fn(model, batch)``; returns the detached loss. A non-finite loss raises
    FloatingPointError before anything is updated.

    ``mixed`` (the setting ``precision``, flower_app/training/precision.py): the forward (the loss)
    under its autocast and, for fp16, backward and step through its GradScaler; None:
    plain float32."""
    with mixed.autocast() if mixed is not None else contextlib.nullcontext():
        loss = loss_fn(model, batch)
    if not torch.isfinite(loss):
        raise FloatingPointError(f"non-finite training loss at step {step}")
    optimizer.zero_grad(set_to_none=True)
    if mixed is not None:
        mixed.backward_and_step(loss, optimizer)
    else:
        loss.backward()
        optimizer.step()
    return loss.detach()


def train_local(
    model: nn.Module,
    loader: DataLoader,
    *,
    epochs: int,
    max_steps: int,
    lr: float,
    weight_decay: float,
    device: torch.device,
    head_lr: float | None = None,
    progress: bool = False,
    description: str = "local training",
    loss_fn: LossFn = model_loss,
    mixed: MixedPrecision | None = None,
    dp_sgd: DpSgd | None = None,
) -> TrainResult:
    """``epochs`` passes over ``loader`` (or exactly ``max_steps`` steps when > 0), with a
    fresh AdamW (``make_optimizer``: the adapter at ``lr``, the head at ``head_lr``).

    Each step minimises ``loss_fn(model, batch)``, the task kind's training loss; the
    default is the model's own (the batches carry its targets: ``labels``, or
    ``start_positions`` / ``end_positions`` for extractive QA). ``mixed``: the run's
    ``precision`` (``train_step``). ``dp_sgd`` (``dp=example``, flower_app/privacy/dp_sgd.py): every
    step a DP-SGD step of Opacus on a Poisson batch of ``loader``'s dataset (an epoch is 1/q
    of them); an empty batch takes the noise-only step."""
    optimizer = make_optimizer(model, lr=lr, head_lr=head_lr, weight_decay=weight_decay)
    model.to(device).train()
    with private_training(dp_sgd, model, optimizer, loader) as private:
        if private is not None:
            optimizer, loader = private.optimizer, private.loader
        result = _train_loop(
            model, loader, optimizer, epochs, max_steps, device, progress, description,
            loss_fn, mixed, private,
        )  # fmt: skip
        if private is not None and private.stats is not None:
            result = replace(result, dp_mechanism=private.stats.metrics())
        return result


def _train_loop(
    model: nn.Module,
    loader: DataLoader,
    optimizer: torch.optim.Optimizer,
    epochs: int,
    max_steps: int,
    device: torch.device,
    progress: bool,
    description: str,
    loss_fn: LossFn,
    mixed: MixedPrecision | None,
    private: PrivateTraining | None,
) -> TrainResult:
    total = max_steps if max_steps > 0 else epochs * len(loader)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc=description, leave=False, mininterval=5.0)
    loss_sum, examples, steps = 0.0, 0, 0
    while steps < total:
        for batch in loader:
            if private is not None and private.empty(batch):
                private.noise_step()
                steps += 1
                if steps >= total:
                    break
                continue
            batch = _batch_to(batch, device)
            loss = train_step(model, optimizer, batch, step=steps, loss_fn=loss_fn, mixed=mixed)
            n = int(batch["input_ids"].shape[0])  # examples, or QA features (windows)
            loss_sum += float(loss) * n
            examples += n
            steps += 1
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss_sum / examples:.4f}")
            if steps >= total:
                break
    if bar is not None:
        bar.close()
    model.eval()
    return TrainResult(loss_sum / max(examples, 1), examples, steps)


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader, device: torch.device) -> EvalResult:
    """Mean cross-entropy and accuracy over ``loader``."""
    model.to(device).eval()
    loss_sum, correct, examples = 0.0, 0, 0
    for batch in loader:
        batch = _batch_to(batch, device)
        out = model(**batch)
        n = int(batch["labels"].shape[0])
        loss_sum += float(out.loss) * n
        correct += int((out.logits.argmax(dim=-1) == batch["labels"]).sum())
        examples += n
    if examples == 0:
        return EvalResult(math.nan, math.nan, 0)
    return EvalResult(loss_sum / examples, correct / examples, examples)
