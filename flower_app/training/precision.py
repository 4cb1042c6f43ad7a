"""Precision, gradient checkpointing and quantisation: the settings ``precision``,
``gradient-checkpointing`` and ``quantization`` applied to a Hugging Face model and its step.

The recipe is QLoRA's (Dettmers et al., 2023) and Flower's flowertune-llm example's: the frozen
base in ``precision``'s dtype under ``torch.autocast``, everything that trains in float32 (fp16
steps through a ``GradScaler``); non-reentrant checkpointing; a bitsandbytes base, which
``check_quantization_supported`` refuses without CUDA or the package. At model load
(flower_app/modeling.py): ``check_quantization_supported``, ``from_pretrained_kwargs``,
``prepare_base_model``, the adapter, ``keep_trainable_float32``; in the training loop
``train_step(..., mixed=MixedPrecision.for_run(precision, device))``. The server step stays
float64. docs/usage.md, "Precision, gradient checkpointing, 4-bit and 8-bit bases"."""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from flower_app.settings.checks import PRECISIONS, QUANTIZATIONS, ConfigError

_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def precision_dtype(precision: str) -> torch.dtype:
    """The torch dtype of the setting ``precision`` (fp32 | bf16 | fp16)."""
    try:
        return _DTYPES[precision]
    except KeyError:
        raise ConfigError(
            f"precision: bad value {precision!r} (must be one of {', '.join(PRECISIONS)})"
        ) from None


def _device_type(device: torch.device | str | None) -> str:
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device).type


def check_quantization_supported(
    quantization: str, device: torch.device | str | None = None
) -> None:
    """Refuse ``quantization`` != none where bitsandbytes cannot load the base: no CUDA
    device (``device``: the run's training device, None = this machine's default) or no
    ``bitsandbytes`` package. Raises ConfigError naming the key and what is missing; call it
    before loading any model, so nothing is trained or lost."""
    if quantization not in QUANTIZATIONS:
        raise ConfigError(
            f"quantization: bad value {quantization!r} (must be one of {', '.join(QUANTIZATIONS)})"
        )
    if quantization == "none":
        return
    missing = []
    if _device_type(device) != "cuda" or not torch.cuda.is_available():
        why = (
            f"this torch build ({torch.__version__}) has no CUDA support"
            if torch.version.cuda is None
            else "no CUDA device is visible to this process"
            if not torch.cuda.is_available()
            else f"the training device is {torch.device(device)}"
        )
        missing.append(f"a CUDA GPU ({why})")
    if importlib.util.find_spec("bitsandbytes") is None:
        missing.append("the bitsandbytes package (pip install bitsandbytes)")
    if missing:
        raise ConfigError(
            f"quantization={quantization!r} loads the base model through bitsandbytes, which "
            f"needs {' and '.join(missing)}; set quantization=none to train without it"
        )


def check_precision_supported(precision: str, device: torch.device | str | None = None) -> None:
    """Refuse bf16 on a CUDA GPU without bf16 support (pre-Ampere); ConfigError naming the key."""
    precision_dtype(precision)
    on_gpu = _device_type(device) == "cuda" and torch.cuda.is_available()
    if precision == "bf16" and on_gpu and not torch.cuda.is_bf16_supported():
        raise ConfigError(
            "precision=bf16: this GPU has no bfloat16 support; use precision=fp16 or fp32"
        )


def quantization_config(quantization: str, precision: str) -> Any:
    """The ``BitsAndBytesConfig`` for ``quantization`` (None for none): 4bit as QLoRA and
    the older flowertune-llm example loads it -- NF4, double quantisation, compute in the
    dtype of ``precision`` --, 4bit-fp4 as the FlowerTune LLM templates and their evaluation
    do (``load_in_4bit=True`` alone) and 8bit as LLM.int8()."""
    if quantization == "none":
        return None
    from transformers import BitsAndBytesConfig

    if quantization == "4bit":
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=precision_dtype(precision),
        )
    if quantization == "4bit-fp4":
        return BitsAndBytesConfig(load_in_4bit=True)
    if quantization == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    raise ConfigError(
        f"quantization: bad value {quantization!r} (must be one of {', '.join(QUANTIZATIONS)})"
    )


def from_pretrained_kwargs(precision: str, quantization: str = "none") -> dict[str, Any]:
    """The keyword arguments of ``from_pretrained`` that load the frozen base in the dtype of
    ``precision`` (or quantised by bitsandbytes, the rest in that dtype)."""
    kwargs: dict[str, Any] = {"dtype": precision_dtype(precision)}
    bnb = quantization_config(quantization, precision)
    if bnb is not None:
        kwargs["quantization_config"] = bnb
    return kwargs


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """Recompute each block's activations in the backward pass instead of keeping them
    (non-reentrant checkpointing, which also works where only adapter parameters need grad);
    the frozen embedding's output is made to require grad as PEFT does for such models."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"gradient-checkpointing: {type(model).__name__} does not support gradient "
            "checkpointing; set gradient-checkpointing=false"
        )
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()
    if hasattr(model, "config"):
        model.config.use_cache = False  # a KV cache is useless in training and conflicts


def prepare_base_model(
    model: nn.Module,
    precision: str,
    quantization: str = "none",
    gradient_checkpointing: bool = False,
) -> nn.Module:
    """The loaded base, before any adapter is injected: its floating-point parameters in
    the dtype of ``precision`` (a no-op where ``from_pretrained_kwargs`` loaded it so), a
    quantised base prepared as PEFT's ``prepare_model_for_kbit_training`` does, and gradient
    checkpointing when asked for. Returns ``model`` (changed in place)."""
    dtype = precision_dtype(precision)
    if quantization != "none":
        from peft import prepare_model_for_kbit_training

        # Casts the non-quantised weights (norms, embeddings) to float32 for stability and,
        # with use_gradient_checkpointing, does what enable_gradient_checkpointing does.
        model = prepare_model_for_kbit_training(
            model,
            use_gradient_checkpointing=gradient_checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False},
        )
        return model
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
    # Parameters only: buffers such as the rotary inv_freq stay as the model made them
    # (transformers computes positions in float32 whatever the weights' dtype).
    if gradient_checkpointing:
        enable_gradient_checkpointing(model)
    return model


def keep_trainable_float32(model: nn.Module) -> int:
    """Cast every trained parameter (requires_grad) held in a half dtype to float32: the
    master weights of the adapter and the head. Returns how many were cast."""
    cast = 0
    for p in model.parameters():
        if p.requires_grad and p.dtype in (torch.float16, torch.bfloat16):
            p.data = p.data.float()
            cast += 1
    return cast


@dataclass
class MixedPrecision:
    """Autocast and (fp16 only) gradient scaling for a training step on ``device_type``.

    ``autocast()`` is a no-op context for fp32. ``backward_and_step`` does
    ``loss.backward(); optimizer.step()``, through the GradScaler when there is one (a step
    whose gradients overflowed is skipped and the scale lowered: the scaler's contract)."""

    precision: str
    device_type: str
    scaler: Any = field(default=None, repr=False)

    @classmethod
    def for_run(cls, precision: str, device: torch.device | str) -> MixedPrecision:
        precision_dtype(precision)
        device_type = torch.device(device).type
        scaler = torch.amp.GradScaler(device_type) if precision == "fp16" else None
        return cls(precision, device_type, scaler)

    @property
    def dtype(self) -> torch.dtype:
        return precision_dtype(self.precision)

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        if self.precision == "fp32":
            yield
            return
        with torch.autocast(device_type=self.device_type, dtype=self.dtype):
            yield

    def backward_and_step(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is None:
            loss.backward()
            optimizer.step()
            return
        self.scaler.scale(loss).backward()
        self.scaler.step(optimizer)
        self.scaler.update()
