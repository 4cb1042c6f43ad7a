"""FLoRG's adapter on a causal LM exports as a standard PEFT LoRA folder (the ServerApp's
``peft_lora/``, ``AdaptedModel.export_peft``) that ``peft.AutoPeftModelForCausalLM`` loads
from the folder alone (the base model's path is recorded in the adapter config), and whose
greedy generation equals the app's own model token for token."""

from __future__ import annotations

import json

import numpy as np
import torch

from florg_tools.synthetic import make_tiny_causal_lm
from flower_app.cache.per_process import cached_adapted_model
from flower_app.modeling import resolve_model_source
from flower_app.settings.config import resolve_config

PROMPTS = ("the movie was", "a film and the plot is very", "good", "the actor was bad")


def _greedy(model, input_ids: torch.Tensor, mask: torch.Tensor, pad_id: int) -> torch.Tensor:
    return model.generate(
        input_ids=input_ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
        pad_token_id=pad_id,
    )  # fmt: skip


def test_florg_exports_a_peft_causal_lm_that_generates_as_the_app_does(tmp_path):
    from peft import AutoPeftModelForCausalLM, PeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    from flower_app.modeling import load_tokenizer

    base_dir = make_tiny_causal_lm(tmp_path / "base")
    config = resolve_config(
        {},
        {"model": str(base_dir), "task": "squad-gen", "task-kind": "causal-lm",
         "method": "florg", "rank": 4, "alpha": 16.0},
    )  # fmt: skip
    adapted = cached_adapted_model.__wrapped__(config, 0, "causal-lm")
    # A non-trivial adapter: every shared array (FLoRG's A per layer) moved off its start.
    rng = np.random.default_rng(0)
    state = adapted.shared_state()
    assert state and all(".q_proj." in k or ".v_proj." in k for k in state)
    adapted.load_shared_state(
        {k: v + rng.normal(0.0, 0.5, v.shape).astype(v.dtype) for k, v in state.items()}
    )
    app_model = adapted.model.eval()

    out = tmp_path / "peft_lora"
    assert adapted.export_peft(out, resolve_model_source(config.model))
    adapter_config = json.loads((out / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(base_dir)
    assert adapter_config["task_type"] == "CAUSAL_LM"
    exported = AutoPeftModelForCausalLM.from_pretrained(out).eval()  # the folder alone
    assert isinstance(exported, PeftModelForCausalLM)

    tokenizer = load_tokenizer(str(base_dir))
    pad_id = tokenizer.pad_token_id
    encoded = [tokenizer(p)["input_ids"] for p in PROMPTS]
    width = max(len(ids) for ids in encoded)
    input_ids = torch.full((len(encoded), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for i, ids in enumerate(encoded):  # left padding, as the app's generation does
        input_ids[i, width - len(ids) :] = torch.tensor(ids)
        mask[i, width - len(ids) :] = 1

    with torch.no_grad():
        app_logits = app_model(input_ids=input_ids, attention_mask=mask).logits
        peft_logits = exported(input_ids=input_ids, attention_mask=mask).logits
        base = AutoModelForCausalLM.from_pretrained(base_dir).eval()
        base_logits = base(input_ids=input_ids, attention_mask=mask).logits
        torch.testing.assert_close(peft_logits, app_logits, rtol=0, atol=1e-5)
        assert (app_logits - base_logits).abs().max() > 1e-2  # the adapter does something

        app_tokens = _greedy(app_model, input_ids, mask, pad_id)
        peft_tokens = _greedy(exported, input_ids, mask, pad_id)
        base_tokens = _greedy(base, input_ids, mask, pad_id)
    assert app_tokens.shape[1] > width
    assert torch.equal(peft_tokens, app_tokens)  # token for token
    assert not torch.equal(base_tokens, app_tokens)  # ... and not the base model's tokens
