"""Example-level DP-SGD (``dp=example``, flower_app/privacy/dp_sgd.py, docs/privacy.md section 9).

The per-example gradients Opacus computes (its hooks; FLoRG's A through
flower_app/adapters/florg/grad_sample.py) are held, for every trained parameter (adapter
and head), to a loop that runs autograd on one example at a time, in float64, to 1e-6:
FLoRG (its pass-factor cache on: the factors are formed outside the layer), florg-signed
(D = diag(+-1)), PEFT's LoRA and LoRA-SB's R (Fed-SB), on the tiny BERT. Then the client's
accountant (against Opacus' own RDP accountant, the calibration to a target epsilon, with
and without a release already in the ledger) and one client round.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from flower_app.adapters.florg.layer import FLoRGLinear
from flower_app.adapters.florg.model import FLoRGConfig, florg_layers, inject_florg
from flower_app.adapters.lora.layer import LoRAConfig, inject_lora, lora_layers
from flower_app.privacy.dp_sgd import (
    ClientAccountant,
    DpSgd,
    DpSgdPlan,
    client_delta,
    round_generators,
)
from flower_app.settings.config import ConfigError, resolve_config

N, T = 5, 7  # examples, tokens


def tiny_bert(tiny_bert_config):
    """The tiny BERT in float64, dropout off (so a training forward is deterministic)."""
    from transformers import AutoModelForSequenceClassification

    config = tiny_bert_config.__class__(
        **{**tiny_bert_config.to_dict(), "hidden_dropout_prob": 0.0,
           "attention_probs_dropout_prob": 0.0}
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForSequenceClassification.from_config(config).double()


def batch(vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(N, T, dtype=torch.long)
    mask[1, 5:] = 0  # padding: per-example gradients must ignore it as the loop does
    mask[3, 3:] = 0
    return {
        "input_ids": torch.randint(0, vocab, (N, T), generator=g),
        "attention_mask": mask,
        "labels": torch.randint(0, 2, (N,), generator=g),
    }


def florg_model(tiny_bert_config, signs=None):
    model = tiny_bert(tiny_bert_config)
    inject_florg(model, FLoRGConfig(r=4, alpha=8.0, a_init_std=0.5, signs=signs))
    return model


def lora_model(tiny_bert_config):
    model = inject_lora(tiny_bert(tiny_bert_config), LoRAConfig(r=4, alpha=8.0))
    with torch.no_grad():  # B = 0 at LoRA's start gives A no gradient: move off it
        for layer in lora_layers(model).values():
            layer.lora_B["default"].weight.normal_(0.0, 0.3)
    return model


def lora_sb_model(tiny_bert_config):
    """LoRA-SB (Fed-SB's adapter): a random fixed B, A and R off its zero start."""
    from flower_app.adapters.lora_sb.layer import LoRASBConfig, inject_lora_sb

    model = tiny_bert(tiny_bert_config)
    layers = inject_lora_sb(model, LoRASBConfig(r=4, alpha=8.0))
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for layer in layers.values():
            for tensor in (layer.B, layer.A, layer.R):
                tensor.copy_(torch.randn(tensor.shape, generator=g, dtype=tensor.dtype))
    return model


BUILDERS = {
    "florg": florg_model,
    "florg-signed": lambda c: florg_model(c, signs=(1.0, -1.0, 1.0, -1.0)),
    "lora": lora_model,
    "lora-sb": lora_sb_model,
}


def per_example_loop(model, data) -> dict[str, torch.Tensor]:
    """name -> (N x shape): autograd on each example alone (its own loss, batch of one)."""
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    grads: dict[str, list[torch.Tensor]] = {n: [] for n in trained}
    for i in range(N):
        model.zero_grad(set_to_none=True)
        model(**{k: v[i : i + 1] for k, v in data.items()}).loss.backward()
        for n, p in trained.items():
            grads[n].append(p.grad.detach().clone())
    model.zero_grad(set_to_none=True)
    return {n: torch.stack(g) for n, g in grads.items()}


@pytest.mark.parametrize("variant", sorted(BUILDERS))
def test_per_example_gradients_equal_a_per_example_autograd_loop(tiny_bert_config, variant):
    from opacus import GradSampleModule

    from flower_app.adapters.florg.grad_sample import register_florg_grad_sampler
    from flower_app.adapters.lora_sb.grad_sample import register_lora_sb_grad_sampler
    from flower_app.privacy.dp_sgd import check_trainable_modules

    register_florg_grad_sampler()
    register_lora_sb_grad_sampler()
    model = BUILDERS[variant](tiny_bert_config).train()
    check_trainable_modules(model)  # the fixed buffers of FLoRG's and LoRA-SB's layers
    data = batch(tiny_bert_config.vocab_size)
    expected = per_example_loop(model, data)
    module = GradSampleModule(model, batch_first=True, loss_reduction="mean", strict=False)
    try:
        loss = model(**data).loss  # the batch's mean loss, as training takes it
        if variant.startswith("florg"):  # the factors came from the model's pre-hook
            assert all(layer.holds_pass_factors for layer in florg_layers(model).values())
        loss.backward()
        names = dict(model.named_parameters())
        adapter = [n for n in expected if n.endswith((".A", ".R")) or ".lora_" in n]
        assert adapter and len(adapter) < len(expected)  # the head is trained and checked too
        for name, loop in expected.items():
            sample = names[name].grad_sample
            assert sample.shape == loop.shape, name
            scale = float(loop.abs().max())
            assert scale > 1e-8, name  # a gradient that can be wrong
            # to 1e-6 of the largest entry (float64: the two agree to about 1e-12)
            torch.testing.assert_close(sample, loop, rtol=0.0, atol=1e-6 * scale, msg=name)
    finally:
        module._close()


def test_the_florg_sampler_sees_a_wrong_gradient(tiny_bert_config):
    """The comparison can fail: without its D, florg-signed's per-example gradients differ."""
    from flower_app.adapters.florg.grad_sample import florg_grad_sample

    layer = next(iter(florg_layers(florg_model(tiny_bert_config, (1.0, -1.0, 1.0, -1.0))).values()))
    x = torch.randn(3, 4, layer.in_features, dtype=torch.float64)
    g = torch.randn(3, 4, layer.out_features, dtype=torch.float64)
    signed = florg_grad_sample(layer, [x], g)[layer.A]
    layer.signs = None
    assert not torch.allclose(signed, florg_grad_sample(layer, [x], g)[layer.A], atol=1e-3)


def test_a_frozen_a_has_no_per_example_gradient(tiny_bert_config):
    from flower_app.adapters.florg.grad_sample import florg_grad_sample

    layer: FLoRGLinear = next(iter(florg_layers(florg_model(tiny_bert_config)).values()))
    layer.A.requires_grad_(False)
    x = torch.randn(2, 3, layer.in_features, dtype=torch.float64)
    assert florg_grad_sample(layer, [x], torch.randn(2, 3, layer.out_features).double()) == {}


# --------------------------------------------------------------------------- accountant


def dp_config(**overrides):
    values = {"dp": "example", "batch-size": 10, "local-steps": 5, "num-server-rounds": 4}
    return resolve_config({}, {**values, **overrides})


def test_the_client_epsilon_matches_opacus_rdp_accountant():
    from opacus.accountants import RDPAccountant

    accountant = ClientAccountant()
    plan = accountant.plan(dp_config(**{"dp-sgd-noise-multiplier": 1.1}), 1000)
    assert plan.sample_rate == 0.01 and plan.delta == 1e-4 and plan.steps == 5
    theirs = RDPAccountant()
    for _ in range(3):  # three rounds
        accountant.record(plan)
        theirs.history.append((plan.noise_multiplier, plan.sample_rate, plan.steps))
    ours = accountant.epsilon()
    assert ours > 0 and ours == pytest.approx(theirs.get_epsilon(plan.delta), rel=0.05)


def test_a_target_epsilon_calibrates_z_for_every_round_of_the_run():
    config = dp_config(**{"dp-sgd-target-epsilon": 3.0})
    accountant = ClientAccountant()
    plan = accountant.plan(config, 500)
    for _ in range(config.num_server_rounds):
        accountant.record(accountant.plan(config, 500))
    assert accountant.noise_multiplier == plan.noise_multiplier  # fixed at the first round
    assert 2.9 < accountant.epsilon() <= 3.0


def test_a_target_epsilon_is_calibrated_after_a_release_already_in_the_ledger():
    """A release before training (a method's round 0: one Gaussian step (z0, 1.0)) is in the
    ledger: z is calibrated so that it and all the training rounds end at the target (to
    1e-3, never above), which the old calibration would overshoot; an empty ledger takes
    ``noise_multiplier_for`` exactly as before (equality); a release that alone reaches the
    target is refused naming dp-sgd-target-epsilon."""
    from flower_app.privacy.accounting import (
        DpAccountant,
        epsilon_for,
        noise_multiplier_after,
        noise_multiplier_for,
    )

    config = dp_config(**{"dp-sgd-target-epsilon": 3.0})
    n, q, steps = 500, 10 / 500, 5
    fresh = ClientAccountant()
    plan = fresh.plan(config, n)
    delta = client_delta(config, n)
    assert plan.noise_multiplier == noise_multiplier_for(3.0, q, 4 * steps, delta)  # as before
    assert noise_multiplier_after(3.0, [], q, 4 * steps, delta) == plan.noise_multiplier

    accountant = ClientAccountant()
    accountant.record_release(config, n, 2.0, 1.0)
    assert accountant.ledger.compositions == [(2.0, 1.0, 1)]
    assert accountant.epsilon() == pytest.approx(epsilon_for(2.0, 1.0, 1, delta), rel=1e-12)
    calibrated = accountant.plan(config, n)
    assert calibrated.noise_multiplier > plan.noise_multiplier  # less room for training
    for _ in range(config.num_server_rounds):
        accountant.record(accountant.plan(config, n))
    assert accountant.epsilon() <= 3.0 and accountant.epsilon() == pytest.approx(3.0, abs=1e-3)
    independent = DpAccountant(delta, [(2.0, 1.0, 1), (calibrated.noise_multiplier, q, 20)])
    assert independent.epsilon() == accountant.epsilon()
    overshoot = DpAccountant(delta, [(2.0, 1.0, 1), (plan.noise_multiplier, q, 20)])
    assert overshoot.epsilon() > 3.0 + 1e-2  # the empty-ledger z would end above the target

    spent = ClientAccountant()
    spent.record_release(config, n, 0.3, 1.0)  # alone far above 3
    with pytest.raises(ValueError, match="dp-sgd-target-epsilon: the releases already"):
        spent.plan(config, n)


def test_the_accountant_state_round_trips_and_continues():
    config = dp_config()
    accountant = ClientAccountant()
    accountant.record(accountant.plan(config, 200))
    restored = ClientAccountant.from_state_dict(accountant.state_dict())
    assert restored.epsilon() == accountant.epsilon() > 0
    plan = restored.plan(config, 200)
    assert restored.epsilon_after(plan) > restored.epsilon()
    with pytest.raises(ValueError, match="ClientAccountant"):
        ClientAccountant.from_state_dict({"ledger": None})


def test_delta_defaults_below_one_over_n():
    assert client_delta(dp_config(), 200) == 1 / 2000
    assert client_delta(dp_config(**{"dp-sgd-delta": 1e-6}), 200) == 1e-6


def test_seeded_generators_repeat_and_unseeded_ones_differ():
    a = [g.initial_seed() for g in round_generators(7, torch.device("cpu"))]
    assert a == [g.initial_seed() for g in round_generators(7, torch.device("cpu"))]
    assert round_generators(None, torch.device("cpu"))[0].initial_seed() != a[0]


# --------------------------------------------------------------------------- one step


def test_a_dp_step_clips_each_example_and_noises_the_sum(tiny_bert_config):
    """z = 0: the step's gradient is the sum of the per-example gradients, each clipped to C,
    over the expected batch size; z > 0 adds noise of std z C / (q n)."""
    from flower_app.training.loop import make_optimizer

    model = florg_model(tiny_bert_config).train()
    data = batch(tiny_bert_config.vocab_size)
    loop = per_example_loop(model, data)
    norms = torch.cat([g.reshape(N, -1) for g in loop.values()], 1).norm(dim=1)
    clip = float(norms.median())
    factor = (clip / (norms + 1e-6)).clamp(max=1.0)
    plan = DpSgdPlan(0.0, clip, 0.5, 1, 1e-5, 2 * N)  # expected batch q n = N
    dataset = [dict(zip(data, values, strict=True)) for values in zip(*data.values(), strict=True)]
    loader = torch.utils.data.DataLoader(dataset, batch_size=N)
    optimizer = make_optimizer(model, lr=0.0, weight_decay=0.0)
    private = DpSgd(plan, seed=0).attach(model, optimizer, loader)
    try:
        private.optimizer.zero_grad()
        model(**data).loss.backward()
        private.optimizer.step()
        for name, p in model.named_parameters():
            if p.requires_grad:
                expected = torch.einsum("i,i...->...", factor, loop[name]) / N
                torch.testing.assert_close(p.grad, expected, rtol=0, atol=1e-9, msg=name)
    finally:
        private.close()
    assert not any(hasattr(p, "grad_sample") for p in model.parameters())


def test_an_empty_poisson_batch_takes_a_noise_only_step(tiny_bert_config):
    from flower_app.training.loop import make_optimizer

    model = florg_model(tiny_bert_config).train()
    plan = DpSgdPlan(1.0, 1.0, 0.5, 1, 1e-5, 2)
    optimizer = make_optimizer(model, lr=0.0, weight_decay=0.0)
    loader = torch.utils.data.DataLoader([{"input_ids": torch.zeros(T, dtype=torch.long)}])
    private = DpSgd(plan, seed=0).attach(model, optimizer, loader)
    try:
        assert private.empty(None) and not private.empty({"input_ids": torch.zeros(1, T)})
        private.noise_step()
        grads = [p.grad for p in model.parameters() if p.requires_grad]
        assert all(g is not None for g in grads)
        std = float(torch.cat([g.flatten() for g in grads]).std())
        assert std == pytest.approx(1.0 * 1.0 / 1, rel=0.2)  # z C / (q n), q n = 1
    finally:
        private.close()
    assert np.isfinite(std)


def examples_of(data: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """The batch's rows as a dataset of dicts (what the tokenised splits are)."""
    return [dict(zip(data, values, strict=True)) for values in zip(*data.values(), strict=True)]


def test_a_round_whose_first_poisson_draw_is_empty_trains_its_steps(tiny_bert_config):
    """q small enough that the round's first draws hold no example: every step is the
    noise-only step and the round completes (Opacus' DPDataLoader raised here: its
    empty-batch collation fell back to torch.zeros with a dict's keys' type as dtype)."""
    from flower_app.privacy.dp_sgd import poisson_loader
    from flower_app.training.loop import train_local

    data = batch(tiny_bert_config.vocab_size)
    loader = torch.utils.data.DataLoader(examples_of(data), batch_size=N)
    plan = DpSgdPlan(1.0, 1.0, 1e-4, 3, 1e-5, N)
    sampling, _ = round_generators(0, torch.device("cpu"))  # the round's, as attach draws
    assert next(iter(poisson_loader(loader, plan.sample_rate, sampling))) is None
    model = florg_model(tiny_bert_config)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    result = train_local(
        model, loader, epochs=1, max_steps=3, lr=0.01, weight_decay=0.0,
        device=torch.device("cpu"), dp_sgd=DpSgd(plan, seed=0),
    )  # fmt: skip
    assert result.steps == 3 and result.num_examples == 0
    moved = [not torch.equal(p, before[n]) for n, p in model.named_parameters() if n in before]
    assert moved and all(moved)  # the noise moved every trained tensor


def test_the_poisson_loader_draws_as_opacus_dp_data_loader():
    """The same seeded generator: poisson_loader's batches are DPDataLoader's, draw for
    draw (the draws of the runs published before the empty-draw fix are unchanged)."""
    from opacus.data_loader import DPDataLoader

    from flower_app.privacy.dp_sgd import poisson_loader

    dataset = [torch.tensor([i]) for i in range(40)]
    ours = poisson_loader(
        torch.utils.data.DataLoader(dataset, collate_fn=torch.stack), 0.1,
        torch.Generator().manual_seed(3),
    )  # fmt: skip
    theirs = DPDataLoader(
        dataset, sample_rate=0.1, collate_fn=torch.stack,
        generator=torch.Generator().manual_seed(3),
    )  # fmt: skip

    def drawn(rows: torch.Tensor | None) -> list[int]:
        return [] if rows is None else rows.flatten().tolist()

    for _ in range(3):  # three rounds' iterators: each draws from the generator as Opacus'
        found, expected = list(ours), list(theirs)
        assert len(found) == len(expected) == 10
        assert [drawn(rows) for rows in found] == [drawn(rows) for rows in expected]
        assert sum(len(drawn(rows)) for rows in found) > 0


# --------------------------------------------------------------------------- settings


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"gradient-checkpointing": True}, "gradient-checkpointing"),
        ({"precision": "bf16"}, "precision"),
        ({"dp-sgd-delta": 1.0}, "dp-sgd-delta"),
        ({"dp-sgd-clipping-norm": 0.0}, "dp-sgd-clipping-norm"),
        ({"dp-sgd-target-epsilon": 8.0, "dp-max-epsilon": 4.0}, "dp-max-epsilon"),
    ],
)
def test_dp_example_refuses_bad_settings_naming_the_key(overrides, key):
    from flower_app.settings.config import ConfigError

    with pytest.raises(ConfigError, match=key):
        dp_config(**overrides)


def test_every_registered_method_takes_dp_example_and_a_refusal_names_method_and_reason():
    from dataclasses import replace

    from flower_app.methods.registry import get_method, method_names

    config = dp_config()
    for name in method_names():  # Fed-SB too: its round 0 is private (test_fed_sb.py)
        get_method(name).check_settings(config)  # no refusal
    assert [n for n in method_names() if get_method(n).example_dp_refusal] == []
    refusing = replace(get_method("fedit"), name="toy", example_dp_refusal="its reason")
    with pytest.raises(ValueError, match="dp=example refused for method 'toy': its reason"):
        refusing.check_settings(config)


def test_the_causal_lm_kind_is_refused_with_its_reason():
    from flower_app.task_kinds import get_kind

    assert "per-example" in get_kind("causal-lm").example_dp_refusal
    assert get_kind("classification").example_dp_refusal == ""


def test_extractive_qa_is_refused_before_launch_the_unit_would_be_a_window(tmp_path):
    """A SQuAD-style question whose context is longer than one window trains as several
    windows: DP-SGD would protect a window, not the question, so dp=example is refused
    before launch (the launcher's and the ServerApp's check) with that reason."""
    from flower_app.preflight.references import check_names
    from flower_app.task_kinds import get_kind

    assert "window" in get_kind("extractive-qa").example_dp_refusal
    task = tmp_path / "qa"
    task.mkdir()
    row = {
        "question": "q?",
        "context": "a context",
        "answers": {"text": ["a"], "answer_start": [0]},
    }
    for split in ("train", "validation"):
        (task / f"{split}.jsonl").write_text(json.dumps(row) + "\n")
    settings = {"task": "local", "data-path": str(task), "text-fields": "question,context",
                "task-kind": "extractive-qa", "model": str(tmp_path / "none")}  # fmt: skip
    with pytest.raises(ConfigError, match="dp=example refused for task kind 'extractive-qa'"):
        check_names(resolve_config({}, {**settings, "dp": "example"}))


def test_off_leaves_the_round_untouched():
    """dp=off builds no record and no accountant: the strategy's round 0 row is as before."""
    from strategies.server.example_dp import example_dp_record

    assert example_dp_record(resolve_config({})) is None
    assert example_dp_record(dp_config()) is not None


def test_the_server_record_keeps_the_largest_epsilon_and_bounds_a_lost_ledger():
    from strategies.server.example_dp import ExampleDpRecord

    record = ExampleDpRecord(target=2.0)
    record._take(1, 0, 1.0)
    record._take(1, 1, 2.5)
    assert record.metrics() == {
        "dp-sgd-epsilon-max": 2.5, "dp-sgd-over-target": 1, "dp-sgd-clients": 2,
    }  # fmt: skip
    record._take(2, 1, 0.5)  # partition 1's node lost its ledger: 2.5 + 0.5
    assert record.epsilon(1) == 3.0
    restored = ExampleDpRecord(2.0)
    restored.load_state_json(json.loads(json.dumps(record.state_json())))
    assert restored.metrics() == record.metrics()


# --------------------------------------------------------------------------- the mechanism


def one_dp_step(tiny_bert_config, plan: DpSgdPlan, *, lr: float = 0.0, hook: bool = True):
    """One DP-SGD step of the tiny FLoRG BERT on ``batch``: (its model, the stats' metrics;
    None where ``hook`` is false, the step hook removed before the step)."""
    from flower_app.training.loop import make_optimizer

    model = florg_model(tiny_bert_config).train()
    data = batch(tiny_bert_config.vocab_size)
    dataset = [dict(zip(data, values, strict=True)) for values in zip(*data.values(), strict=True)]
    loader = torch.utils.data.DataLoader(dataset, batch_size=N)
    optimizer = make_optimizer(model, lr=lr, weight_decay=0.0)
    private = DpSgd(plan, seed=0).attach(model, optimizer, loader)
    try:
        if not hook:
            private.optimizer.step_hook = None
        private.optimizer.zero_grad()
        model(**data).loss.backward()
        private.optimizer.step()
    finally:
        private.close()
    assert private.stats is not None
    return model, private.stats.metrics() if hook else None


def test_the_mechanism_stats_equal_a_per_example_autograd_computation(tiny_bert_config):
    """The clipped fraction, the median per-example norm and the clipped mean gradient's
    norm of one step against autograd on one example at a time (float64), C between the
    3rd and 4th smallest norms (so 2 of the 5 examples are clipped, none at the boundary);
    the noise std is z C on the sum."""
    reference = florg_model(tiny_bert_config).train()
    loop = per_example_loop(reference, batch(tiny_bert_config.vocab_size))
    norms = torch.cat([g.reshape(N, -1) for g in loop.values()], 1).norm(dim=1)
    ordered = norms.sort().values
    clip = float(ordered[2] + ordered[3]) / 2
    factor = (clip / (norms + 1e-6)).clamp(max=1.0)
    clipped = [torch.einsum("i,i...->...", factor, g).flatten() for g in loop.values()]
    clipped_sum = torch.cat(clipped)
    plan = DpSgdPlan(0.5, clip, 0.5, 1, 1e-5, 2 * N)  # expected batch q n = N
    _, found = one_dp_step(tiny_bert_config, plan)
    assert found["dp-sgd-clipped-fraction"] == float((norms > clip).sum()) / N == 2 / N
    assert found["dp-sgd-grad-norm-median"] == pytest.approx(float(ordered[2]), rel=1e-9)
    assert found["dp-sgd-clipped-mean-norm"] == pytest.approx(
        float(clipped_sum.norm()) / N, rel=1e-9
    )
    assert found["dp-sgd-sum-noise-std"] == 0.5 * clip
    assert found["dp-sgd-expected-batch"] == N
    assert found["dp-sgd-trained-params"] == sum(g[0].numel() for g in loop.values())


def test_the_mechanism_stats_leave_the_trained_parameters_bit_for_bit(tiny_bert_config):
    """A noised step at a learning rate: the parameters after it are equal, bit for bit,
    with and without the stats' step hook (it reads, draws nothing, writes nothing)."""
    plan = DpSgdPlan(1.0, 0.05, 0.5, 1, 1e-5, 2 * N)
    with_hook, found = one_dp_step(tiny_bert_config, plan, lr=0.01)
    without, _ = one_dp_step(tiny_bert_config, plan, lr=0.01, hook=False)
    assert found is not None and found["dp-sgd-clipped-fraction"] == 1.0  # C below every norm
    trained = [n for n, p in with_hook.named_parameters() if p.requires_grad]
    assert trained
    after = dict(without.named_parameters())
    for name, p in with_hook.named_parameters():
        assert torch.equal(p, after[name]), name


def test_an_empty_round_reports_no_per_example_statistics():
    from flower_app.privacy.dp_sgd_mechanism import MechanismStats

    found = MechanismStats(1.0, 2.0, 8).metrics()
    assert found == {
        "dp-sgd-sum-noise-std": 2.0, "dp-sgd-expected-batch": 8.0, "dp-sgd-trained-params": 0.0,
    }  # fmt: skip


def test_the_server_row_aggregates_the_clients_mechanism_over_successful_replies():
    """Mean clipped fraction, medians of the norms, noise std z C / B (and its norm over d
    coordinates) over the replies that carry them; a round without them has no key."""
    from flwr.app import MetricRecord, RecordDict

    from strategies.server.example_dp import ExampleDpRecord

    class Reply:  # what the record reads of a Flower reply: its error flag and content
        def __init__(self, content: RecordDict) -> None:
            self.content = content

        def has_error(self) -> bool:
            return False

    def reply(partition: int, **metrics: float) -> Reply:
        values = {"partition-id": partition, "dp-sgd-epsilon": 1.0, **metrics}
        return Reply(RecordDict({"metrics": MetricRecord(values)}))

    def mechanism(fraction, norm, mean, batch):
        return {
            "dp-sgd-clipped-fraction": fraction, "dp-sgd-grad-norm-median": norm,
            "dp-sgd-clipped-mean-norm": mean, "dp-sgd-sum-noise-std": 2.0,
            "dp-sgd-expected-batch": batch, "dp-sgd-trained-params": 100.0,
        }  # fmt: skip

    replies = [
        reply(0, **mechanism(0.5, 3.0, 0.2, 8.0)),
        reply(1, **mechanism(1.0, 5.0, 0.4, 4.0)),
        reply(2, **mechanism(0.0, 1.0, 0.9, 8.0)),
        reply(3),  # a reply without the keys (an older client) counts for the epsilon only
    ]
    row = ExampleDpRecord().observe(1, replies)
    assert row["dp-sgd-clients"] == 4
    assert row["dp-sgd-clipped-fraction"] == pytest.approx(0.5)  # mean of 0.5, 1, 0
    assert row["dp-sgd-grad-norm-median"] == 3.0 and row["dp-sgd-clipped-mean-norm"] == 0.4
    assert row["dp-sgd-noise-std"] == 2.0 / 8.0  # median of 1/4, 1/2, 1/4
    assert row["dp-sgd-noise-norm"] == pytest.approx(2.0 / 8.0 * 10.0)
    assert "dp-sgd-noise-std" not in ExampleDpRecord().observe(1, [reply(0)])
