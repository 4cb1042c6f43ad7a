"""The settings precision / gradient-checkpointing / quantization (flower_app/training/precision.py)
and the adapters in bf16: FLoRG's dense-formula test in bf16, its gradients against float32,
gradient checkpointing with FLoRG, and the app's PEFT LoRA path in bf16.

Tolerances. bf16 keeps 8 significant bits: unit roundoff u = 2^-8 (torch's finfo eps is the
spacing at 1, 2^-7 = 2u). A bf16 FLoRG layer computes y = bf16(bf16(W0 x) + bf16(s U x)),
U = L A^T A R, with the base product accumulated in float32 and the adapter path in float32
(florg_layer.py). Each of the three roundings errs by at most u times its operand, and the
float32 accumulation of d_in products by d_in 2^-24 times sum_j |W0_ij x_j|, so elementwise

    |y - y_ref| <= (3u + d_in 2^-24) (|W0| |x| + |s U| |x|)     (to first order in u)

with y_ref = (W0 + s U) x in float64 from the same bf16 W0 and x. A bf16 adapter path
would add the roundings of L A^T, A R, (A R) x and the final product to that.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from flower_app.adapters.florg.layer import FLoRGLinear
from flower_app.adapters.florg.model import FLoRGConfig, florg_layers, inject_florg
from flower_app.adapters.florg.projections import make_projections
from flower_app.adapters.lora.layer import LoRAConfig, inject_lora, lora_layers
from flower_app.settings.checks import ConfigError
from flower_app.settings.config import defaults, resolve_config, schema
from flower_app.training.loop import make_optimizer, train_step
from flower_app.training.precision import (
    MixedPrecision,
    check_quantization_supported,
    enable_gradient_checkpointing,
    from_pretrained_kwargs,
    keep_trainable_float32,
    precision_dtype,
    prepare_base_model,
    quantization_config,
)

U_BF16 = 2.0**-8  # bf16 unit roundoff
U_FP32 = 2.0**-24


def tiny_llama(seed: int = 0) -> nn.Module:
    """A randomly initialised decoder (Llama layout: q_proj, k_proj, v_proj, o_proj)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=97,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).eval()


def lm_batch(seed: int = 0, batch: int = 2, length: int = 12) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 97, (batch, length), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


# --------------------------------------------------------------------------- settings


def test_settings_defaults_and_values():
    assert defaults()["precision"] == "fp32"
    assert defaults()["gradient-checkpointing"] is False
    assert defaults()["quantization"] == "none"
    config = resolve_config(
        {}, {"precision": "bf16", "gradient-checkpointing": "true", "quantization": "none"}
    )
    assert (config.precision, config.gradient_checkpointing) == ("bf16", True)
    for key, bad in (("precision", "fp8"), ("quantization", "2bit")):
        with pytest.raises(ConfigError, match=f"{key}: bad value"):
            resolve_config({}, {key: bad})
    assert "dtype of the frozen base" in schema()["precision"].help


def test_quantization_on_cpu_device_is_refused_at_resolution():
    with pytest.raises(ConfigError, match="quantization='4bit' needs a CUDA GPU but device='cpu'"):
        resolve_config({}, {"quantization": "4bit", "device": "cpu"})


@pytest.mark.parametrize(
    "settings,key",
    [({"subtract-init": True}, "subtract-init=true"), ({"method": "fedex-lora"}, "fedex-lora")],
)
def test_quantization_refuses_settings_that_write_w0(settings, key):
    with pytest.raises(ConfigError, match=key) as err:
        resolve_config({}, {"quantization": "8bit", **settings})
    assert "quantization='8bit'" in str(err.value)
    resolve_config({}, settings)  # fine without quantization


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where there is no CUDA")
@pytest.mark.parametrize("quantization", ["4bit", "8bit"])
def test_quantization_without_cuda_fails_before_loading(quantization):
    with pytest.raises(ConfigError) as err:
        check_quantization_supported(quantization, "cpu")
    message = str(err.value)
    assert f"quantization={quantization!r}" in message and "CUDA GPU" in message
    assert "quantization=none" in message
    check_quantization_supported("none", "cpu")  # nothing to check


def test_quantization_names_a_missing_bitsandbytes(monkeypatch):
    """Where CUDA is present but bitsandbytes is not, the error names the package only."""
    import importlib.util

    import flower_app.training.precision as precision

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        precision.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "bitsandbytes" else real_find_spec(name, *a),
    )
    with pytest.raises(ConfigError) as err:
        check_quantization_supported("4bit", "cuda")
    assert "bitsandbytes package" in str(err.value) and "CUDA GPU" not in str(err.value)


def test_quantization_config_is_qlora_nf4():
    pytest.importorskip("transformers")
    assert quantization_config("none", "bf16") is None
    bnb = quantization_config("4bit", "bf16")
    assert bnb.load_in_4bit and bnb.bnb_4bit_quant_type == "nf4"
    assert bnb.bnb_4bit_use_double_quant and bnb.bnb_4bit_compute_dtype == torch.bfloat16
    assert quantization_config("8bit", "fp32").load_in_8bit
    kwargs = from_pretrained_kwargs("bf16", "4bit")
    assert kwargs["dtype"] == torch.bfloat16 and kwargs["quantization_config"].load_in_4bit
    assert from_pretrained_kwargs("fp32") == {"dtype": torch.float32}


def test_mixed_precision_scaler_only_for_fp16():
    assert MixedPrecision.for_run("fp32", "cpu").scaler is None
    assert MixedPrecision.for_run("bf16", "cpu").scaler is None
    assert MixedPrecision.for_run("fp16", "cpu").scaler is not None
    with MixedPrecision.for_run("bf16", "cpu").autocast():
        y = nn.functional.linear(torch.randn(2, 4), torch.randn(3, 4))
    assert y.dtype == torch.bfloat16
    with MixedPrecision.for_run("fp32", "cpu").autocast():
        assert nn.functional.linear(torch.randn(2, 4), torch.randn(3, 4)).dtype == torch.float32


# --------------------------------------------------------------------------- FLoRG in bf16


def _florg_pair(d_out: int, d_in: int, r: int, seed: int = 0):
    """A float32 FLoRG layer and its bf16-base twin (same W0 rounded to bf16, same A, L, R),
    with A large enough that s U is of W0's size (so the update is really tested)."""
    rng = np.random.default_rng(seed)
    L, R = make_projections(d_out, d_in, seed=seed, name="layer")
    A = rng.standard_normal((r, min(d_in, d_out))) * 0.5
    base = nn.Linear(d_in, d_out, bias=True)
    with torch.no_grad():  # W0, b as bf16 values, so both twins hold exactly the same W0
        base.weight.copy_(base.weight.bfloat16().float())
        base.bias.copy_(base.bias.bfloat16().float())
    layer32 = FLoRGLinear(copy.deepcopy(base), L, R, A, scaling=2.0)
    layer16 = FLoRGLinear(copy.deepcopy(base).to(torch.bfloat16), L, R, A, scaling=2.0)
    return layer32, layer16, (L, R, A)


def _dense_reference(layer: FLoRGLinear, L, R, A, x: torch.Tensor):
    w0 = layer.base_layer.weight.detach().double()
    b = layer.base_layer.bias.detach().double()
    update = torch.as_tensor(layer.scaling * (L @ A.T) @ (A @ R))
    x64 = x.double()
    y_ref = x64 @ (w0 + update).T + b
    # the bound's scale: |W0| |x| + |b| + |s U| |x|
    scale = x64.abs() @ w0.abs().T + b.abs() + x64.abs() @ update.abs().T
    return y_ref, scale


@pytest.mark.parametrize("d_out,d_in", [(64, 64), (32, 96)])
def test_florg_dense_formula_in_bf16(d_out, d_in):
    _, layer16, (L, R, A) = _florg_pair(d_out, d_in, r=4)
    assert layer16.base_layer.weight.dtype == torch.bfloat16
    assert layer16.A.dtype == torch.float32 and layer16.L.dtype == torch.float32  # masters
    x = torch.randn(5, 7, d_in).bfloat16()
    y = layer16(x)
    assert y.dtype == torch.bfloat16
    y_ref, scale = _dense_reference(layer16, L, R, A, x)
    err = (y.double() - y_ref).abs()
    tol = (3 * U_BF16 + d_in * U_FP32) * scale
    assert torch.all(err <= tol), f"max err/tol {(err / tol).max():.3f}"
    # the update is not negligible next to W0 x: the test sees the adapter path
    update = y_ref - x.double() @ layer16.base_layer.weight.double().T
    assert update.abs().mean() > 0.3 * y_ref.abs().mean()


def test_florg_dense_formula_under_bf16_autocast():
    """A float32 base under autocast(bf16), as precision=bf16 runs the forward: the factors
    L A^T, A R are formed in float32 and rounded to bf16 once, the per-token products run in
    bf16 with float32 accumulation (as PEFT's LoRA under autocast). The bound: bf16's three
    roundings on the base path, and on the adapter path the rounding of each factor, of each
    product's output and of the sum, against s |L A^T| (|A R| |x|)."""
    layer32, _, (L, R, A) = _florg_pair(48, 48, r=4)
    x = torch.randn(3, 48).bfloat16().float()
    with MixedPrecision.for_run("bf16", "cpu").autocast():
        y = layer32(x)
    assert y.dtype == torch.bfloat16
    y_ref, scale = _dense_reference(layer32, L, R, A, x)
    left, right = torch.as_tensor(np.abs(L @ A.T)), torch.as_tensor(np.abs(A @ R))
    adapter_scale = layer32.scaling * (x.double().abs() @ right.T) @ left.T
    tol = 3 * U_BF16 * scale + (5 * U_BF16 + 48 * U_FP32) * adapter_scale
    err = (y.double() - y_ref).abs()
    assert torch.all(err <= tol), f"max err/tol {(err / tol).max():.3f}"


def _florg_and_peft_twins(r: int = 4):
    """A bf16 tiny decoder twice: FLoRG on q_proj, and PEFT LoRA on q_proj whose lora_B,
    lora_A hold FLoRG's float32 factors (L A^T, A R), so both layers hold the same update."""
    base = tiny_llama()
    prepare_base_model(base, "bf16")
    florg = copy.deepcopy(base)
    inject_florg(florg, FLoRGConfig(r=r, alpha=8.0, target_modules=("q_proj",), a_init_std=0.3))
    lora = inject_lora(copy.deepcopy(base), LoRAConfig(r=r, alpha=8.0, target_modules=("q_proj",)))
    for model in (florg, lora):
        keep_trainable_float32(model)
    name = "model.layers.0.self_attn.q_proj"
    f_layer, l_layer = florg_layers(florg)[name], lora_layers(lora)[name]
    assert f_layer.scaling == l_layer.scaling["default"]
    with torch.no_grad():
        left, right = f_layer.lora_factors()
        l_layer.lora_B["default"].weight.copy_(left)
        l_layer.lora_A["default"].weight.copy_(right)
    return f_layer, l_layer


def test_florg_under_bf16_autocast_computes_what_peft_lora_computes():
    """precision=bf16's forward (autocast): FLoRG's layer and PEFT's LoRA layer holding the
    same factors give the same bf16 output, bit for bit (the same roundings in the same
    places), and A's gradient is the chain rule through the factors of PEFT's gradients."""
    f_layer, l_layer = _florg_and_peft_twins()
    x = torch.randn(3, 5, 32).bfloat16()
    G = torch.randn(3, 5, 32)
    outputs = []
    for layer in (f_layer, l_layer):
        layer.train()
        with MixedPrecision.for_run("bf16", "cpu").autocast():
            y = layer(x)
        (y.float() * G).sum().backward()
        outputs.append(y)
    assert outputs[0].dtype == torch.bfloat16
    assert torch.equal(outputs[0], outputs[1])
    update = outputs[0].double() - f_layer.base_layer(x).double()
    assert update.abs().mean() > 0.1 * outputs[0].double().abs().mean()  # the adapter counts
    grad_left = l_layer.lora_B["default"].weight.grad
    grad_right = l_layer.lora_A["default"].weight.grad
    chain = grad_left.T @ f_layer.L + grad_right @ f_layer.R.T  # d/dA of (L A^T, A R)
    assert torch.linalg.norm(chain) > 0
    atol = 1e-6 * float(chain.abs().max())
    torch.testing.assert_close(f_layer.A.grad, chain, rtol=1e-5, atol=atol)


def test_florg_saves_no_more_for_backward_than_peft_lora_under_bf16_autocast():
    """Activation memory at equal rank: under autocast FLoRG's layers save x as it comes
    (bf16), not a float32 copy of it, so a training forward keeps no more bytes for the
    backward pass than PEFT LoRA's (unique storages, the shared L and R included)."""

    def saved_bytes(model: nn.Module) -> int:
        storages: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        model.train()
        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        with hooks, MixedPrecision.for_run("bf16", "cpu").autocast():
            model(**lm_batch(length=64))
        return sum(storages.values())

    base = tiny_llama()
    prepare_base_model(base, "bf16")
    targets = ("q_proj", "v_proj")
    florg = copy.deepcopy(base)
    inject_florg(florg, FLoRGConfig(r=4, alpha=8.0, target_modules=targets, a_init_std=0.1))
    lora = inject_lora(copy.deepcopy(base), LoRAConfig(r=4, alpha=8.0, target_modules=targets))
    for model in (florg, lora):
        keep_trainable_float32(model)
    florg_bytes, lora_bytes = saved_bytes(florg), saved_bytes(lora)
    assert florg_bytes <= lora_bytes, (florg_bytes, lora_bytes)


def test_florg_gradients_in_bf16_match_float32():
    """Without autocast, with x and the output gradient G representable in bf16, grad_A of
    the bf16-base layer equals the float32 layer's to float32 precision: W0 does not enter
    grad_A, and the adapter path, where it is computed, is float32 without autocast (a bf16
    path would be off by ~2^-8)."""
    layer32, layer16, _ = _florg_pair(64, 64, r=4)
    x = torch.randn(6, 64).bfloat16()
    G = torch.randn(6, 64).bfloat16().float()
    (layer32(x.float()).float() * G).sum().backward()
    (layer16(x).float() * G).sum().backward()
    g32, g16 = layer32.A.grad, layer16.A.grad
    assert g16.dtype == torch.float32 and torch.isfinite(g16).all()
    assert torch.linalg.norm(g32) > 0
    torch.testing.assert_close(g16, g32, rtol=1e-5, atol=1e-6 * float(g32.abs().max()))


def test_gradient_checkpointing_gives_the_same_florg_gradients():
    config = FLoRGConfig(r=4, alpha=8.0, target_modules=("q_proj", "v_proj"), a_init_std=0.1)
    plain = tiny_llama()
    checkpointed = copy.deepcopy(plain)
    inject_florg(plain, config)
    prepare_base_model(checkpointed, "fp32", gradient_checkpointing=True)
    inject_florg(checkpointed, config)
    calls = []
    first_q = florg_layers(checkpointed)["model.layers.0.self_attn.q_proj"]
    first_q.register_forward_hook(lambda *_: calls.append(1))
    batch = lm_batch()
    grads = []
    for model in (plain, checkpointed):
        model.train()
        model(**batch).loss.backward()
        grads.append({n: layer.A.grad.clone() for n, layer in florg_layers(model).items()})
    assert len(calls) == 2, "the checkpointed block was not recomputed in the backward pass"
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == 4
    for name in grads[0]:
        assert torch.linalg.norm(grads[0][name]) > 0
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7)


def test_gradient_checkpointing_refused_by_a_model_without_it():
    with pytest.raises(ValueError, match="gradient-checkpointing"):
        enable_gradient_checkpointing(nn.Linear(2, 2))


# --------------------------------------------------------------------------- whole models


def test_prepare_base_model_bf16_keeps_trained_parameters_float32():
    model = tiny_llama()
    prepare_base_model(model, "bf16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    inject_florg(model, FLoRGConfig(r=2, target_modules=("q_proj", "v_proj"), a_init_std=0.1))
    model.lm_head.requires_grad_(True)  # a trained head, as the classification kinds have
    assert keep_trainable_float32(model) == 1  # the head; A is created float32
    trained = {n: p.dtype for n, p in model.named_parameters() if p.requires_grad}
    assert set(trained.values()) == {torch.float32} and len(trained) == 5
    frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
    assert frozen == {torch.bfloat16}


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("method", ["florg", "lora"])
def test_train_step_in_half_precision(precision, method):
    model = tiny_llama()
    prepare_base_model(model, precision, gradient_checkpointing=True)
    targets = ("q_proj", "v_proj")
    if method == "florg":
        inject_florg(model, FLoRGConfig(r=2, target_modules=targets, a_init_std=0.1))
    else:
        model = inject_lora(model, LoRAConfig(r=2, alpha=4.0, target_modules=targets))
    keep_trainable_float32(model)
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(p.dtype == torch.float32 for p in trained.values())
    before = {n: p.detach().clone() for n, p in trained.items()}
    optimizer = make_optimizer(model, lr=1e-2, weight_decay=0.0)
    mixed = MixedPrecision.for_run(precision, "cpu")
    model.train()
    losses = [float(train_step(model, optimizer, lm_batch(s), s, mixed=mixed)) for s in range(3)]
    assert all(np.isfinite(losses))
    moved = [n for n, p in trained.items() if not torch.equal(p.detach(), before[n])]
    assert moved, "no trained parameter moved in three steps"
    assert all(p.dtype == torch.float32 for p in trained.values())


def test_lora_dense_formula_in_bf16():
    """The app's LoRA path (inject_lora, PEFT) with a bf16 base: adapters stay float32
    (PEFT's autocast_adapter_dtype) and y = W0 x + s B A x within the bound above."""
    model = tiny_llama()
    prepare_base_model(model, "bf16")
    model = inject_lora(model, LoRAConfig(r=4, alpha=8.0, target_modules=("q_proj",)))
    layer = lora_layers(model)["model.layers.0.self_attn.q_proj"]
    lora_A, lora_B = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    assert lora_A.dtype == torch.float32 and lora_B.dtype == torch.float32
    with torch.no_grad():
        lora_B.copy_(torch.randn_like(lora_B) * 0.5)  # B = 0 at init: make the update count
    x = torch.randn(4, 32).bfloat16()
    y = layer(x)
    w0 = layer.base_layer.weight.detach().double()
    update = layer.scaling["default"] * lora_B.double() @ lora_A.double()
    x64 = x.double()
    y_ref = x64 @ (w0 + update).T
    scale = x64.abs() @ w0.abs().T + x64.abs() @ update.abs().T
    # PEFT's own path: x cast to float32, the update in float32, added in bf16 (as FLoRG)
    assert torch.all((y.double() - y_ref).abs() <= (3 * U_BF16 + 32 * U_FP32) * scale)
    assert (x64 @ update.T).abs().mean() > 0.3 * y_ref.abs().mean()


def test_precision_dtype_names():
    assert precision_dtype("bf16") == torch.bfloat16
    assert precision_dtype("fp16") == torch.float16
    with pytest.raises(ConfigError, match="precision"):
        precision_dtype("int8")
