"""The settings ``precision`` and ``gradient-checkpointing`` reach the app's own model and
round (flower_app/cache/per_process.py, client_round.py, task_eval.py), for every method: the frozen
base is held in bf16, what trains stays float32, a client round trains and the task's
evaluation runs under the precision's autocast. ``tests/runtime/test_precision.py`` tests the
pieces (flower_app/training/precision.py, the FLoRG layer in bf16) on their own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from florg_tools.synthetic import make_generative_qa_task, make_tiny_causal_lm
from flower_app.cache.per_process import cached_adapted_model
from flower_app.client.round import local_batches, train_round
from flower_app.methods.registry import get_method, method_names
from flower_app.settings.config import ConfigError, resolve_config
from flower_app.task_data import load_task_data
from flower_app.task_eval import evaluate_task
from flower_app.training.loop import is_adapter_parameter
from tests.runtime.test_causal_lm import causal_settings


@pytest.fixture(scope="module")
def tiny_decoder(tmp_path_factory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("precision-app")
    return make_tiny_causal_lm(base / "model"), make_generative_qa_task(base / "task")


def _decoder_settings(tiny: tuple[Path, Path], **settings: Any) -> dict[str, Any]:
    """test_causal_lm's settings of the tiny decoder, sized down for one cheap round."""
    return causal_settings(
        tiny,
        **{
            "max-new-tokens": 2,
            "max-train-examples": 16,
            "max-eval-examples": 8,
            "batch-size": 4,
            "local-steps": 2,
            "rank": 2,
            "learning-rate": 0.01,
            "progress-bar": False,
            **settings,
        },
    )


def _checkpointing(model: torch.nn.Module) -> bool:
    """Whether the Hugging Face model (under any adapter wrapper) recomputes activations."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    flag = getattr(type(base), "is_activation_checkpointing", None)
    name = "is_activation_checkpointing" if flag is not None else "is_gradient_checkpointing"
    return bool(getattr(base, name, False))


def _initialise_lora_sb(config, adapted) -> None:
    """A LoRA-SB adapter's B and A and initial R from this client's round-0 gradients (the
    gradient taken under the run's precision), as the server would from its one client."""
    from flower_app.adapters.lora_sb.layer import set_lora_sb_basis
    from strategies.fed_sb.gradient import gradient_key
    from strategies.fed_sb.rule import initial_factors

    grads, _ = adapted.method.answer_query(config, adapted, local_batches(config, 0, 1))
    basis, state = {}, dict(adapted.shared_state())
    for key in [k for k in state if k.endswith(".R")]:
        layer = key[: -len(".R")]
        grad = grads[gradient_key(layer)]
        assert np.isfinite(grad).all() and np.abs(grad).sum() > 0, layer
        basis[f"{layer}.B"], state[key], basis[f"{layer}.A"] = initial_factors(
            grad, config.learning_rate, config.rank
        )
    set_lora_sb_basis(adapted.model, basis)
    adapted.load_shared_state(state)


def _round_and_eval(config) -> tuple[Any, dict[str, np.ndarray], dict[str, np.ndarray], dict]:
    data = load_task_data(config)
    adapted = cached_adapted_model(config, data.num_labels, data.spec.kind)
    if adapted.method.adapter == "lora-sb":  # its round 0 first, on this one client
        _initialise_lora_sb(config, adapted)
    before = {k: v.copy() for k, v in adapted.shared_state().items()}
    reply = train_round(config, adapted, server_round=1, partition_id=0, num_partitions=1)
    metrics = evaluate_task(config, adapted.model, torch.device("cpu"))
    return adapted, before, reply.shared, metrics


# a method that writes into W0 is refused over a half-precision base: below
HALF_PRECISION_METHODS = [m for m in method_names() if not get_method(m).writes_base_weights]


@pytest.mark.parametrize("method", HALF_PRECISION_METHODS)
def test_every_method_trains_a_bf16_base_with_checkpointing(tiny_decoder, method):
    config = resolve_config(
        {},
        _decoder_settings(
            tiny_decoder, method=method, precision="bf16", **{"gradient-checkpointing": True}
        ),
    )
    adapted, before, after, metrics = _round_and_eval(config)
    model = adapted.model
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    base = [
        p
        for n, p in model.named_parameters()
        if not p.requires_grad and not is_adapter_parameter(n) and p.is_floating_point()
    ]
    assert trained and all(p.dtype == torch.float32 for p in trained.values())
    assert base and all(p.dtype == torch.bfloat16 for p in base)
    # an adapter part a method freezes (FFA-LoRA's A) is adapter state: float32 like the rest
    assert all(
        p.dtype == torch.float32 for n, p in model.named_parameters() if is_adapter_parameter(n)
    )
    assert _checkpointing(model)
    moved = [k for k in after if not np.array_equal(after[k], before[k])]
    assert moved, f"{method}: no shared array changed in a bf16 round"
    assert all(np.isfinite(v).all() for v in after.values())
    assert np.isfinite(metrics["response-loss"]) and metrics["num-examples"] == 8


@pytest.mark.parametrize(
    ("settings", "key"),
    [({"method": "fedex-lora"}, "fedex-lora"), ({"subtract-init": True}, "subtract-init")],
)
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_writes_into_a_half_precision_w0_are_refused(tiny_decoder, settings, key, precision):
    """FedEx-LoRA's fold and subtract-init write into W0; in bf16 / fp16 the write would round
    W0 by about as much as it adds, so the run is refused before anything is loaded."""
    with pytest.raises(ConfigError, match=f"{key}.*precision='{precision}'"):
        resolve_config({}, _decoder_settings(tiny_decoder, precision=precision, **settings))


def test_fp32_stays_float32_everywhere(tiny_decoder):
    config = resolve_config({}, _decoder_settings(tiny_decoder, method="florg"))
    adapted, _, _, metrics = _round_and_eval(config)
    assert all(p.dtype == torch.float32 for p in adapted.model.parameters())
    assert not _checkpointing(adapted.model)
    assert np.isfinite(metrics["perplexity"])


def test_bf16_round_tracks_the_fp32_round(tiny_decoder):
    """The same round in bf16 and in fp32 from the same start: FLoRG's trained A agrees to
    bf16's resolution (the base's rounding moves the loss, not the adapter's arithmetic)."""
    fp32 = resolve_config({}, _decoder_settings(tiny_decoder, method="florg", seed=3))
    bf16 = resolve_config(
        {}, _decoder_settings(tiny_decoder, method="florg", seed=3, precision="bf16")
    )
    _, start32, after32, _ = _round_and_eval(fp32)
    _, start16, after16, _ = _round_and_eval(bf16)
    for key in start32:
        np.testing.assert_array_equal(start32[key], start16[key])  # A and its head start equal
        step32 = after32[key] - start32[key]
        step16 = after16[key] - start16[key]
        scale = np.abs(step32).max()
        if scale == 0:
            continue
        # two AdamW steps of lr 0.01 move each entry by at most ~0.02; bf16 changes the
        # gradients' direction by its rounding of the base (eps 2^-8) only
        assert np.abs(step16 - step32).max() <= 0.25 * scale, key


@pytest.mark.parametrize("quantization", ["4bit", "8bit"])
def test_a_quantised_base_without_cuda_fails_before_loading(
    tiny_decoder, quantization, monkeypatch
):
    """Without CUDA (as on this CPU machine; forced on a GPU machine) the model loader
    refuses a 4-bit / 8-bit base before it reads a single weight, naming the key and what
    is missing."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = resolve_config({}, _decoder_settings(tiny_decoder, quantization=quantization))
    with pytest.raises(ConfigError, match=f"quantization.*{quantization}.*CUDA"):
        cached_adapted_model(config, 0, "causal-lm")
