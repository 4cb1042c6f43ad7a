"""Example-level DP-SGD on a client (``dp=example``, docs/privacy.md section 9), with Opacus.

Every local step is a DP-SGD step (Abadi et al., CCS 2016): a Poisson batch at rate
q = batch-size / n (``poisson_loader``), the per-example gradients of everything the client
trains (Opacus' ``GradSampleModule``; FLoRG's A and LoRA-SB's R by the samplers in
flower_app/adapters/) clipped jointly to L2 norm C, N(0, (zC)^2 I) added to their sum, divided
by q n (``DPOptimizer``), then AdamW. ``ClientAccountant`` composes the steps, after a method's
round-0 release (``record_release``), with the RDP accountant of central DP
(flower_app/privacy/accounting.py), calibrates z for a target epsilon
(``noise_multiplier_after``) and lives in the node's state (flower_app/client/dp_state.py).
Sampling and noise draw from OS entropy; ``dp-sgd-seeded-noise=true`` (tests) is not private."""

from __future__ import annotations

import contextlib
import functools
import secrets
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from flower_app.privacy.accounting import (
    DpAccountant,
    noise_multiplier_after,
    noise_multiplier_for,
)
from flower_app.privacy.dp_sgd_mechanism import MechanismStats

# the rule for dp-sgd-delta = 0: delta = 1 / (DELTA_DIVISOR n), below 1 / n as DP-SGD needs
DELTA_DIVISOR = 10


class DpBudgetExceeded(RuntimeError):
    """A client refuses a round: its epsilon would exceed ``dp-max-epsilon``."""


def client_delta(config: Any, num_examples: int) -> float:
    """The client's delta: ``dp-sgd-delta``, or 1 / (10 n) where that is 0."""
    if config.dp_sgd_delta > 0:
        return float(config.dp_sgd_delta)
    return 1.0 / (DELTA_DIVISOR * max(int(num_examples), 1))


def sample_rate(config: Any, num_examples: int) -> float:
    """q = batch-size / n (1 when the batch is the whole partition)."""
    return min(1.0, config.batch_size / max(int(num_examples), 1))


def steps_per_round(config: Any, rate: float) -> int:
    """The DP-SGD steps of one round: ``local-steps``, or ``local-epochs`` x 1/q (the
    length of Opacus' Poisson loader)."""
    return config.local_steps if config.local_steps > 0 else config.local_epochs * int(1 / rate)


@dataclass(frozen=True)
class DpSgdPlan:
    """One client's DP-SGD in one round."""

    noise_multiplier: float
    clipping_norm: float
    sample_rate: float
    steps: int
    delta: float
    num_examples: int

    @property
    def expected_batch_size(self) -> float:
        return self.sample_rate * self.num_examples


class ClientAccountant:
    """A client's privacy ledger over the rounds it trains in (a ``DpAccountant`` at the
    client's delta) and its noise multiplier, fixed at its first round: ``dp-sgd-noise-
    multiplier``, or calibrated so that training in all ``num-server-rounds`` rounds ends at
    ``dp-sgd-target-epsilon`` (a client that trains in fewer rounds ends below it)."""

    def __init__(self, ledger: DpAccountant | None = None, noise_multiplier: float = 0.0):
        self.ledger = ledger
        self.noise_multiplier = float(noise_multiplier)

    def plan(self, config: Any, num_examples: int) -> DpSgdPlan:
        """This round's plan for a client of ``num_examples`` examples."""
        n = int(num_examples)
        if n < 1:
            raise ValueError("dp: dp=example needs at least one training example on the client")
        q = sample_rate(config, n)
        steps = steps_per_round(config, q)
        if self.ledger is None:
            self.ledger = DpAccountant(client_delta(config, n))
        if self.noise_multiplier <= 0:
            self.noise_multiplier = self._noise_multiplier(config, q, steps)
        return DpSgdPlan(
            self.noise_multiplier, config.dp_sgd_clipping_norm, q, steps, self.ledger.delta, n
        )

    def _noise_multiplier(self, config: Any, q: float, steps: int) -> float:
        """z for every training round: ``dp-sgd-noise-multiplier``, or the smallest z whose
        ``num-server-rounds`` rounds, composed after what the ledger already holds (a
        method's round 0, ``record_release``), end at ``dp-sgd-target-epsilon``. An empty
        ledger takes ``noise_multiplier_for`` itself, so a run without a round 0 calibrates
        exactly as that function does."""
        target = config.dp_sgd_target_epsilon
        if target <= 0:
            return float(config.dp_sgd_noise_multiplier)
        total = config.num_server_rounds * steps
        assert self.ledger is not None
        if not self.ledger.compositions:
            return noise_multiplier_for(target, q, total, self.ledger.delta)
        try:
            return noise_multiplier_after(
                target, self.ledger.compositions, q, total, self.ledger.delta
            )
        except ValueError as exc:  # the releases before training alone reach the target
            raise ValueError(f"dp-sgd-target-epsilon: {exc}") from exc

    def epsilon(self) -> float:
        return 0.0 if self.ledger is None else self.ledger.epsilon()

    def epsilon_after(self, plan: DpSgdPlan) -> float:
        """The epsilon this client would have after training ``plan``."""
        ledger = DpAccountant(plan.delta, self.ledger.compositions if self.ledger else ())
        ledger.record(plan.noise_multiplier, plan.sample_rate, plan.steps)
        return ledger.epsilon()

    def record(self, plan: DpSgdPlan) -> None:
        """Compose the steps of a trained round."""
        if self.ledger is None:
            self.ledger = DpAccountant(plan.delta)
        self.ledger.record(plan.noise_multiplier, plan.sample_rate, plan.steps)

    def _release_ledger(self, config: Any, num_examples: int) -> DpAccountant:
        """The ledger held, else a new one at the client's delta (``client_delta``: the one
        the training rounds then use)."""
        if self.ledger is not None:
            return self.ledger
        if int(num_examples) < 1:
            raise ValueError("dp: dp=example needs at least one training example on the client")
        return DpAccountant(client_delta(config, num_examples))

    def epsilon_after_release(
        self, config: Any, num_examples: int, noise_multiplier: float, sample_rate: float
    ) -> float:
        """The epsilon this client would have after one more Gaussian release (z, q)."""
        held = self._release_ledger(config, num_examples)
        ledger = DpAccountant(held.delta, held.compositions)
        ledger.record(noise_multiplier, sample_rate, 1)
        return ledger.epsilon()

    def record_release(
        self, config: Any, num_examples: int, noise_multiplier: float, sample_rate: float
    ) -> None:
        """Compose one Gaussian release outside training (a method's round 0): noise std
        z C on a sum of per-example gradients each clipped to C, every example included
        with probability q (Poisson; q = 1: all). Add/remove-one changes that sum by at most
        C, so it is one step of the mechanism DP-SGD's steps are, (z, q), in the same
        ledger; the noise multiplier of the training rounds stays unset (calibrated after
        it, ``_noise_multiplier``)."""
        self.ledger = self._release_ledger(config, num_examples)
        self.ledger.record(noise_multiplier, sample_rate, 1)

    def state_dict(self) -> dict[str, Any]:
        """JSON: {"noise-multiplier": z, "ledger": DpAccountant.state_dict() or None}."""
        ledger = None if self.ledger is None else self.ledger.state_dict()
        return {"noise-multiplier": self.noise_multiplier, "ledger": ledger}

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> ClientAccountant:
        try:
            ledger = state["ledger"]
            z = float(state["noise-multiplier"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a ClientAccountant state: {state!r}") from exc
        return cls(None if ledger is None else DpAccountant.from_state_dict(ledger), z)


def plan_round(
    config: Any, accountant: ClientAccountant, num_examples: int, *, where: str
) -> DpSgdPlan:
    """This round's plan; ``DpBudgetExceeded`` when training it would take the client past
    ``dp-max-epsilon`` (``where`` names the client and round in the message)."""
    plan = accountant.plan(config, num_examples)
    limit = config.dp_max_epsilon
    if limit > 0:
        after = accountant.epsilon_after(plan)
        if after > limit:
            raise DpBudgetExceeded(
                f"dp-max-epsilon: {where} refuses to train: its epsilon would reach "
                f"{after:.4g} > {limit:g} (now {accountant.epsilon():.4g}, delta {plan.delta:.3g})"
            )
    return plan


def check_release(
    config: Any,
    accountant: ClientAccountant,
    num_examples: int,
    noise_multiplier: float,
    sample_rate: float,
    *,
    where: str,
    key: str,
) -> float:
    """The epsilon after a release outside training (``ClientAccountant.record_release``),
    checked before anything is computed: ValueError naming ``key`` (the setting of the
    release's noise multiplier) where it would reach ``dp-sgd-target-epsilon`` (no noise
    multiplier could then keep the training rounds within the target), and
    ``DpBudgetExceeded`` where it would take the client past ``dp-max-epsilon``."""
    after = accountant.epsilon_after_release(config, num_examples, noise_multiplier, sample_rate)
    target, limit = config.dp_sgd_target_epsilon, config.dp_max_epsilon
    if target > 0 and after >= target:
        raise ValueError(
            f"{key}: {where} alone would take this client's epsilon to {after:.4g} >= "
            f"dp-sgd-target-epsilon {target:g}, leaving nothing for training; raise {key} "
            "or the target"
        )
    if limit > 0 and after > limit:
        raise DpBudgetExceeded(
            f"dp-max-epsilon: {where} refuses to release: its epsilon would reach "
            f"{after:.4g} > {limit:g} (now {accountant.epsilon():.4g})"
        )
    return after


def round_generators(
    seed: int | None, device: torch.device
) -> tuple[torch.Generator, torch.Generator]:
    """(sampling on the CPU, noise on ``device``): from ``seed`` and seed + 1, or each from
    63 bits of OS entropy where ``seed`` is None (the private default)."""
    seeds = (seed, seed + 1) if seed is not None else (secrets.randbits(63), secrets.randbits(63))
    sampling = torch.Generator().manual_seed(seeds[0])
    noise = torch.Generator(device=device).manual_seed(seeds[1])
    return sampling, noise


def check_trainable_modules(model: nn.Module) -> None:
    """Opacus refuses a trained module that holds buffers (BatchNorm's running statistics
    would leak the data unnoised). The project's own adapter layers (``AdapterLinear``:
    FLoRG's, LoRA-SB's) hold buffers fixed before any data is seen (FLoRG's L, R, signs and
    initial A) or received from the server (LoRA-SB's B and A, post-processing of round 0's
    releases), which training never changes: public, so allowed; any other is refused."""
    from flower_app.adapters.custom_adapter import AdapterLinear

    fixed = {id(m) for m in model.modules() if isinstance(m, AdapterLinear)}
    bad = [
        name
        for name, module in model.named_modules()
        if id(module) not in fixed
        and any(p.requires_grad for p in module.parameters(recurse=False))
        and any(True for _ in module.buffers())
    ]
    if bad:
        raise ValueError(f"dp: dp=example cannot train modules with buffers: {bad}")


@dataclass
class PrivateTraining:
    """A model under Opacus for one round: the Poisson ``loader`` and the ``optimizer``
    that clips per example and adds the noise; ``close`` removes the hooks. ``stats``, the
    optimizer's step hook, reads what the mechanism did (flower_app/privacy/dp_sgd_mechanism.py)."""

    module: Any
    optimizer: Any
    loader: DataLoader
    stats: MechanismStats | None = None

    def empty(self, batch: Any) -> bool:
        """Whether Poisson sampling drew no example (``poisson_loader``: None)."""
        return batch is None

    def noise_step(self) -> None:
        """The step of an empty batch: the clipped sum is 0, the noise and the update are
        taken as for any batch (skipping it would show that the batch was empty)."""
        self.optimizer.zero_grad(set_to_none=True)
        for p in self.optimizer.params:
            p.grad_sample = torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device)
        self.optimizer.step()

    def close(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.module._close()
        for module in self.module._module.modules():
            for attr in ("activations", "max_batch_len"):
                if attr in module.__dict__:
                    delattr(module, attr)


@dataclass(frozen=True)
class DpSgd:
    """What ``training.train_local`` needs to train privately: the plan and the seed of the
    round's generators (None: OS entropy)."""

    plan: DpSgdPlan
    seed: int | None = None

    def attach(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, loader: DataLoader
    ) -> PrivateTraining:
        """Hooks on ``model`` (per-example gradients), the DP optimizer around
        ``optimizer``, and a Poisson loader over ``loader``'s dataset and collation."""
        from opacus import GradSampleModule
        from opacus.optimizers import DPOptimizer

        from flower_app.adapters.florg.grad_sample import register_florg_grad_sampler
        from flower_app.adapters.lora_sb.grad_sample import register_lora_sb_grad_sampler

        register_florg_grad_sampler()
        register_lora_sb_grad_sampler()
        check_trainable_modules(model)
        device = next(p.device for p in model.parameters() if p.requires_grad)
        sampling, noise = round_generators(self.seed, device)
        module = GradSampleModule(model, batch_first=True, loss_reduction="mean", strict=False)
        expected_batch = max(1, round(self.plan.expected_batch_size))
        dp_optimizer = DPOptimizer(
            optimizer,
            noise_multiplier=self.plan.noise_multiplier,
            max_grad_norm=self.plan.clipping_norm,
            expected_batch_size=expected_batch,
            loss_reduction="mean",
            generator=noise,
        )
        # read-only: the per-example norms and the clipped sum, after the noise is drawn
        stats = MechanismStats(self.plan.clipping_norm, self.plan.noise_multiplier, expected_batch)
        dp_optimizer.attach_step_hook(stats.observe)
        poisson = poisson_loader(loader, self.plan.sample_rate, sampling)
        return PrivateTraining(module, dp_optimizer, poisson, stats)


def poisson_loader(loader: DataLoader, sample_rate: float, generator: Any) -> DataLoader:
    """Poisson sampling over ``loader``'s dataset as Opacus' ``DPDataLoader`` draws it (its
    ``UniformWithReplacementSampler``: each example in a step's batch with probability q,
    the same generator passed to the loader too, so the draws are Opacus' own), collated by
    ``loader``'s collate function; an empty draw is collated to None.

    Not ``DPDataLoader`` itself: its empty-batch collation learns the batch's structure
    from the first non-empty batch, and when a round's first draw is empty it falls back to
    ``torch.zeros`` with the dtype of the dataset's first item's entries, which for a dict
    of tensors are its keys (a ``str`` type), and raises."""
    from opacus.utils.uniform_sampler import UniformWithReplacementSampler

    sampler = UniformWithReplacementSampler(
        num_samples=len(loader.dataset),  # type: ignore[arg-type]
        sample_rate=sample_rate,
        generator=generator,
    )
    collate = functools.partial(_collate_draw, loader.collate_fn)
    return DataLoader(
        loader.dataset, batch_sampler=sampler, collate_fn=collate, generator=generator
    )


def _collate_draw(collate_fn: Callable[[list[Any]], Any], draw: list[Any]) -> Any:
    """``collate_fn(draw)``; None for an empty draw (``PrivateTraining.empty``)."""
    return collate_fn(draw) if draw else None


@contextlib.contextmanager
def private_training(
    dp_sgd: DpSgd | None, model: nn.Module, optimizer: torch.optim.Optimizer, loader: DataLoader
) -> Iterator[PrivateTraining | None]:
    """``dp_sgd.attach`` for the duration of a round (None: nothing), hooks removed after."""
    if dp_sgd is None:
        yield None
        return
    private = dp_sgd.attach(model, optimizer, loader)
    try:
        yield private
    finally:
        private.close()
