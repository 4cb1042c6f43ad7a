"""Fed-SB's round 0 on a client (``estimate_gradients``): the gradient of the loss with respect
to every adapted W0, summed over the client's first ``fed-sb-init-examples`` training
examples, as the authors' ``estimate_and_process_grads_torch``
(fed_sb/utils/gradient_utils.py) computes it: each batch's loss divided by the batch's size
before its backward pass, the gradients summed. The server averages the clients' sums and
takes the sign and the SVD (``rule.py``). Only the base weights of the adapted layers take
gradients while it runs (``training_base_weights``); what trained before is frozen
meanwhile and restored after. This is the estimate of dp=off and dp=central (where the
server clips and noises each client's sum); under dp=example the client sends
``private_gradient.py``'s. docs/architecture.md, "Fed-SB, and how it differs".
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np


def gradient_key(layer: str) -> str:
    """The reply's key of ``layer``'s gradient (d_out x d_in)."""
    return f"{layer}.grad"


@contextlib.contextmanager
def training_base_weights(adapted: Any, batches: Any) -> Iterator[dict[str, Any]]:
    """While open: the base weight W0 of every LoRA-SB layer takes gradients and what
    trained before (R, the head) is frozen, the model in training mode on ``batches``'
    device with torch seeded by its seed (dropout as in a training round). Yields
    {layer: W0}; everything is restored, and the model moved back to the CPU, on exit."""
    import torch

    from flower_app.adapters.lora_sb.layer import lora_sb_layers

    model = adapted.model
    trained = [p for p in model.parameters() if p.requires_grad]
    weights = {name: layer.base_layer.weight for name, layer in lora_sb_layers(model).items()}
    torch.manual_seed(batches.seed)  # dropout, as in a training round
    model.to(batches.device).train()
    try:
        for p in trained:
            p.requires_grad_(False)
        for w in weights.values():
            w.requires_grad_(True)
        yield weights
    finally:
        for w in weights.values():
            w.requires_grad_(False)
            w.grad = None
        for p in trained:
            p.requires_grad_(True)
        model.eval()
        model.to("cpu")


def estimate_gradients(
    adapted: Any, batches: Any, num_examples: int
) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """({'<layer>.grad': the summed gradient of W0}, {'num-examples': N used}) over the
    first ``num_examples`` examples of ``batches`` (``flower_app.client.round.LocalBatches``:
    the loader, the task's loss, the precision, the device and the seed).

    As the authors: the model in training mode, batches of ``batch-size`` cut so that
    exactly the first N examples count, each batch's loss divided by the batch's size
    before its backward pass, the gradients summed over the batches. The examples are the
    first N of the client's partition in the order round 0 shuffles it (seeded with the
    run's seed plus the partition id, the seed of a training round at round 0), and dropout
    draws from that seed, so the estimate is reproducible. The model is the initial one
    (R = 0: the update adds nothing), its task head the seeded head the server starts
    from."""
    import torch

    model = adapted.model
    used = 0
    with training_base_weights(adapted, batches) as weights:
        sums = {name: torch.zeros(w.shape, dtype=torch.float64) for name, w in weights.items()}
        for batch in batches.loader:
            n = min(int(batch["input_ids"].shape[0]), num_examples - used)
            if n <= 0:
                break
            batch = {k: v[:n].to(batches.device) for k, v in batch.items()}
            with batches.mixed.autocast():
                loss = batches.loss_fn(model, batch)
            if not torch.isfinite(loss):
                raise FloatingPointError("non-finite loss in the gradient estimate of round 0")
            (loss / n).backward()  # the authors' normalisation: the batch's loss / its size
            for name, w in weights.items():
                sums[name] += w.grad.detach().to("cpu", torch.float64)
                w.grad = None
            used += n
    if used == 0:
        raise ValueError("fed-sb-init-examples: this client's partition has no training example")
    arrays = {gradient_key(name): s.numpy() for name, s in sums.items()}
    return arrays, {"num-examples": used}
