"""FLoRG's factors formed once per training forward (flower_app/adapters/florg/layer.py,
``form_pass_factors``): with gradient checkpointing the recomputed forward reuses them.

Every check compares with the uncached path, the layer forming (L A^T D, A R) inside its
own forward as it did before (``set_group_pass_factors`` patched to do nothing). The cached
path forms the factors of all layers sharing L and R in one product each, whose rows are
the separate products' rows; a large product may round differently in the last bit, so the
comparisons allow float32's rounding (``assert_same``: 1e-5 relative) where a group has
more than one layer; a copy of the cached path is compared bitwise. Counting formations
shows what is formed where; the uncached path's count (two per layer and step under
checkpointing) shows the count can differ.
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from torch import nn

from flower_app.adapters.florg import layer as florg_layer
from flower_app.adapters.florg.layer import FLoRGLinear
from flower_app.adapters.florg.model import (
    FLoRGConfig,
    florg_layers,
    get_florg_state,
    inject_florg,
    set_florg_state,
)
from flower_app.training.loop import make_optimizer, train_step
from flower_app.training.precision import MixedPrecision, prepare_base_model
from tests.runtime.test_precision import lm_batch, tiny_llama

TARGETS = ("q_proj", "v_proj")
VARIANTS = {
    "florg": {},
    "florg-signed": {"signs": (1.0, -1.0, 1.0, -1.0)},
    "subtract-init": {"subtract_init": True},
    "projection-sharing=module": {"projection_sharing": "module"},
}


@pytest.fixture
def factor_calls(monkeypatch) -> Counter:
    """How many times each FLoRGLinear had its factors formed (keyed by the layer object):
    by itself (``lora_factors``) or in its group (``set_group_pass_factors``)."""
    calls: Counter = Counter()
    original = FLoRGLinear.lora_factors
    original_group = florg_layer.set_group_pass_factors

    def counted(self: FLoRGLinear) -> tuple[torch.Tensor, torch.Tensor]:
        calls[self] += 1
        return original(self)

    def counted_group(layers: list[FLoRGLinear], dtype: torch.dtype) -> None:
        calls.update(layers)
        original_group(layers, dtype)

    monkeypatch.setattr(FLoRGLinear, "lora_factors", counted)
    monkeypatch.setattr(florg_layer, "set_group_pass_factors", counted_group)
    return calls


def assert_same(got: torch.Tensor, want: torch.Tensor, what: object = "") -> None:
    """Equal up to float32 rounding of the factor products (module docstring)."""
    scale = float(want.abs().max()) if want.numel() else 0.0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * scale, msg=str(what))


def uncached(patch: pytest.MonkeyPatch) -> None:
    """The path before the pre-hook: nothing stored, each layer forms its own factors in
    its forward (twice per step under gradient checkpointing)."""
    patch.setattr(florg_layer, "set_group_pass_factors", lambda layers, dtype: None)


def florg_llama(precision: str, checkpointing: bool, **config: object) -> nn.Module:
    model = tiny_llama()
    prepare_base_model(model, precision, gradient_checkpointing=checkpointing)
    settings = {"r": 4, "alpha": 8.0, "target_modules": TARGETS, "a_init_std": 0.1, **config}
    inject_florg(model, FLoRGConfig(**settings))
    return model


def per_layer(model: nn.Module, calls: Counter) -> dict[str, int]:
    return {name: calls[layer] for name, layer in florg_layers(model).items()}


def two_steps(model: nn.Module, precision: str, calls: Counter) -> list[dict]:
    """Two train_step calls (forward, backward, AdamW): each step's loss, A's gradients,
    factor formations per layer, and which layers still hold stored factors after it."""
    optimizer = make_optimizer(model, lr=1e-2, weight_decay=0.0)
    mixed = MixedPrecision.for_run(precision, "cpu")
    model.train()
    steps = []
    for step in range(2):
        calls.clear()
        loss = train_step(model, optimizer, lm_batch(step), step, mixed=mixed)
        layers = florg_layers(model)
        steps.append(
            {
                "loss": loss,
                "grads": {n: layer.A.grad.clone() for n, layer in layers.items()},
                "formed": per_layer(model, calls),
                "held": [n for n, layer in layers.items() if layer.holds_pass_factors],
            }
        )
    return steps


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize(
    "precision,checkpointing", [("fp32", True), ("bf16", True), ("fp32", False)]
)
def test_steps_equal_the_uncached_path_and_form_factors_once(
    variant, precision, checkpointing, factor_calls, monkeypatch
):
    cached = florg_llama(precision, checkpointing, **VARIANTS[variant])
    reference = copy.deepcopy(cached)
    got = two_steps(cached, precision, factor_calls)
    with monkeypatch.context() as patch:
        uncached(patch)
        want = two_steps(reference, precision, factor_calls)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_same(g["loss"], w["loss"], step)
        assert g["grads"].keys() == w["grads"].keys() and len(g["grads"]) == 4
        for name in g["grads"]:
            assert torch.linalg.norm(w["grads"][name]) > 0
            assert_same(g["grads"][name], w["grads"][name], (step, name))
        # once per layer and step; the uncached path recomputes them with each block
        assert set(g["formed"].values()) == {1}, g["formed"]
        assert set(w["formed"].values()) == {2 if checkpointing else 1}, w["formed"]
        assert g["held"] == [], "stored factors outlived the backward pass"
    for name, layer in florg_layers(cached).items():  # the optimiser steps agree too
        assert_same(layer.A, florg_layers(reference)[name].A, name)


def test_eval_and_no_grad_forwards_neither_store_nor_use_factors(factor_calls, monkeypatch):
    model = florg_llama("fp32", True)
    batch = lm_batch()
    layers = florg_layers(model)
    for training, grad in ((False, False), (True, False), (False, True)):
        model.train(training)
        factor_calls.clear()
        with torch.set_grad_enabled(grad):
            model(**batch)
        assert not any(layer.holds_pass_factors for layer in layers.values()), (training, grad)
        assert set(per_layer(model, factor_calls).values()) == {1}

    # a no-grad evaluation between a training forward and its backward: it forms its own
    # factors, leaves the training pass's stored ones in place, and the backward is exact
    reference = copy.deepcopy(model)
    model.train()
    factor_calls.clear()
    loss = model(**batch).loss
    stored = {n: layer._pass_factors for n, layer in layers.items()}
    assert all(s is not None for s in stored.values())
    model.eval()
    with torch.no_grad():
        logits = model(**batch).logits
    assert set(per_layer(model, factor_calls).values()) == {2}  # training pass + evaluation
    assert all(layer._pass_factors is stored[n] for n, layer in layers.items())
    model.train()
    loss.backward()
    assert set(per_layer(model, factor_calls).values()) == {2}  # no recomputation formed any
    assert not any(layer.holds_pass_factors for layer in layers.values())

    with monkeypatch.context() as patch:
        uncached(patch)
        reference.eval()
        with torch.no_grad():
            assert torch.equal(reference(**batch).logits, logits)
        reference.train()
        want = reference(**batch).loss
        want.backward()
    assert_same(loss, want)
    for name, layer in florg_layers(reference).items():
        assert_same(layers[name].A.grad, layer.A.grad, name)


def test_a_loaded_after_a_pass_is_used_not_the_stored_factors():
    """A training forward whose backward never runs leaves its factors stored; a new A
    (the client round loading the global one) must win over them."""
    model = florg_llama("fp32", True)
    model.train()
    model(**lm_batch())  # no backward: the stored factors stay
    layer = florg_layers(model)["model.layers.0.self_attn.q_proj"]
    assert layer.holds_pass_factors
    x = torch.randn(3, 32)
    before = layer(x)
    state = {k: v * 2.0 for k, v in get_florg_state(model).items()}
    set_florg_state(model, state)
    after = layer(x)  # training mode, grad enabled, stored factors of the old A present
    with torch.no_grad():
        left, right = layer.lora_factors()
        want = layer.base_layer(x) + layer.scaling * (x @ right.T) @ left.T
    assert not torch.allclose(after, before)
    torch.testing.assert_close(after, want, rtol=1e-6, atol=1e-7)

    # an optimiser step between a forward and the next direct use: the same
    model(**lm_batch())
    with torch.no_grad():
        layer.A.add_(0.1)
    torch.testing.assert_close(layer(x), layer.eval()(x), rtol=0, atol=0)


def test_copies_of_a_model_holding_factors_carry_none():
    model = florg_llama("fp32", True)
    model.train()
    loss = model(**lm_batch()).loss
    clone = copy.deepcopy(model)  # stored non-leaf tensors would refuse deepcopy
    assert all(layer.holds_pass_factors for layer in florg_layers(model).values())
    assert not any(layer.holds_pass_factors for layer in florg_layers(clone).values())
    loss.backward()
    clone(**lm_batch()).loss.backward()  # the copy forms, uses and drops its own
    assert not any(layer.holds_pass_factors for layer in florg_layers(clone).values())
    for name, layer in florg_layers(clone).items():
        assert torch.equal(layer.A.grad, florg_layers(model)[name].A.grad), name


@pytest.mark.parametrize("kind", ["classification", "extractive-qa"])
def test_encoder_kinds_form_factors_once_under_checkpointing(
    kind, tiny_bert_config, factor_calls, monkeypatch
):
    """The app's other task kinds (BERT-style encoders with a classification or span head):
    the pre-hook sits on the model's top-level forward whatever its class."""
    from transformers import BertForQuestionAnswering, BertForSequenceClassification

    torch.manual_seed(0)
    cls = BertForSequenceClassification if kind == "classification" else BertForQuestionAnswering
    model = cls(tiny_bert_config)
    prepare_base_model(model, "fp32", gradient_checkpointing=True)
    config = FLoRGConfig(r=2, alpha=4.0, target_modules=("query", "value"), a_init_std=0.1)
    inject_florg(model, config)
    reference = copy.deepcopy(model)
    ids = torch.randint(5, tiny_bert_config.vocab_size, (2, 10), generator=torch.Generator())
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if kind == "classification":
        batch["labels"] = torch.tensor([0, 1])
    else:
        batch |= {"start_positions": torch.tensor([1, 2]), "end_positions": torch.tensor([3, 4])}
    grads, formed = [], []
    for m, cache in ((model, True), (reference, False)):
        with monkeypatch.context() as patch:
            if not cache:
                uncached(patch)
            factor_calls.clear()
            m.train()
            torch.manual_seed(1)  # the same dropout masks (checkpointing replays them)
            m(**batch).loss.backward()
        grads.append({n: layer.A.grad for n, layer in florg_layers(m).items()})
        formed.append(set(per_layer(m, factor_calls).values()))
    assert formed == [{1}, {2}]
    assert len(grads[0]) == 4
    for name in grads[0]:
        assert_same(grads[0][name], grads[1][name], name)
    assert not any(layer.holds_pass_factors for layer in florg_layers(model).values())


def test_a_copy_forms_factors_on_its_own_layers():
    """The pre-hook keeps the model's FLoRG layers in a list on the model; a deep copy made
    after the list exists must form factors on the copy's layers, not on the original's."""
    model = florg_llama("fp32", True)
    model.train()
    model(**lm_batch()).loss.backward()  # the list exists now
    clone = copy.deepcopy(model)
    clone(**lm_batch())  # no backward: the factors stay stored where they were formed
    assert all(layer.holds_pass_factors for layer in florg_layers(clone).values())
    assert not any(layer.holds_pass_factors for layer in florg_layers(model).values())


@pytest.mark.parametrize("variant", ["florg", "florg-signed", "projection-sharing=module"])
def test_layers_sharing_projections_form_their_factors_in_one_group(variant, monkeypatch):
    """One set_group_pass_factors call per shared L, R (q_proj's and v_proj's: 2 groups of
    2 layers; ``projection-sharing=module``: 4 of 1), and each layer's stored pair equals its
    own (L A^T D, A R) up to float32 rounding, D included."""
    model = florg_llama("fp32", False, **VARIANTS[variant])
    sizes: list[int] = []
    original = florg_layer.set_group_pass_factors

    def recorded(layers: list[FLoRGLinear], dtype: torch.dtype) -> None:
        sizes.append(len(layers))
        original(layers, dtype)

    monkeypatch.setattr(florg_layer, "set_group_pass_factors", recorded)
    model.train()
    model(**lm_batch())
    assert sorted(sizes) == ([1, 1, 1, 1] if variant == "projection-sharing=module" else [2, 2])
    for name, layer in florg_layers(model).items():
        stored = layer._pass_factors
        assert stored is not None, name
        with torch.no_grad():
            left, right = layer.lora_factors()
        assert_same(stored.left.detach(), left, name)
        assert_same(stored.right.detach(), right, name)
        assert torch.linalg.norm(left) > 0
