"""The DP-SGD step benchmark (``python -m benchmarks.core.dp_sgd_step``) at its tiny
``quick`` shape: every arm runs its steps, the DP arms are the project's DP-SGD (the
per-example gradients FLoRG's DP arm clips are those of a one-example-at-a-time autograd
loop; a step moves the parameters and the client's accountant advances), the report has
the ratio rows, and bad options are refused by name. No timing is asserted: speed targets
live in the benchmark's printed ratios, never in a timed test."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from torch import nn

from benchmarks.core.dp_sgd_step import (
    ARMS,
    SHAPES,
    DpStepSettings,
    build_arm,
    fixed_batch,
    format_report,
    main,
    make_dataset,
    run,
    step,
)

# Opacus' notice where a hooked module's input needs no gradient (frozen embeddings)
pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")

QUICK = DpStepSettings(shape=SHAPES["quick"], steps=2, warmup=1)


def test_every_arm_runs_and_the_report_has_the_ratio_rows():
    res = run(QUICK)
    for name in ARMS:
        arm = res["arms"][name]
        assert arm["timed_steps"] == 2 and arm["cpu_median_s"] > 0 and arm["wall_median_s"] > 0
        assert arm["memory"]["step_bytes"] is not None
    florg_dp, lora_dp = res["arms"]["florg-dp"], res["arms"]["lora-dp"]
    assert florg_dp["trainable"] < lora_dp["trainable"]  # FLoRG's r x k A vs LoRA's B and A
    for key in ("florg-dp/lora-dp", "florg/lora", "florg-dp/florg", "lora-dp/lora"):
        ratio = res["ratios"][key]
        assert len(ratio["per_round"]) == 2 and ratio["min"] <= ratio["median"] <= ratio["max"]
    # the accountant composed each DP arm's steps: warm-up, timed and the memory step
    for name in ("florg-dp", "lora-dp"):
        dp = res["dp"][name]
        assert dp["steps"] == 1 + 2 + 1 and dp["epsilon"] > 0
        assert dp["noise_multiplier"] == 1.0 and dp["max_grad_norm"] == 1.0
        assert dp["expected_batch_size"] == QUICK.shape.batch
    table = format_report(res)
    assert "| DP-SGD step, FLoRG / LoRA | **" in table
    assert "| DP overhead, FLoRG (DP step / no-DP step) | **" in table
    json.dumps(res)  # the --json file and the last printed line


def _no_dropout(model: nn.Module) -> None:
    """Dropout off while the model stays in training mode (Opacus' hooks record only
    training forwards), so a forward is deterministic."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0


def test_the_florg_dp_arm_clips_the_real_per_example_gradients_and_steps():
    """The per-example gradients Opacus holds for FLoRG's DP arm (``grad_sample`` of A and
    of the head) are each example's own gradient (autograd on that example alone); one step
    through the arm's DPOptimizer then moves every trained parameter."""
    s = replace(QUICK, shape=replace(QUICK.shape, batch=3))
    dataset = make_dataset(s)
    batch = fixed_batch(dataset, s)
    arm = build_arm("florg-dp", s, dataset)
    try:
        assert type(arm.optimizer).__name__ == "DPOptimizer"
        assert arm.private.loader.batch_sampler.sample_rate == pytest.approx(1 / 50)  # q = b / n
        model = arm.model
        _no_dropout(model)
        trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
        assert any(n.endswith(".A") for n in trained)
        own: list[dict[str, torch.Tensor]] = []
        for i in range(s.shape.batch):
            arm.optimizer.zero_grad(set_to_none=True)
            model(**{k: v[i : i + 1] for k, v in batch.items()}).loss.backward()
            own.append({n: p.grad.clone() for n, p in trained.items()})
        arm.optimizer.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
        for name, p in trained.items():
            expected = torch.stack([g[name] for g in own])
            torch.testing.assert_close(p.grad_sample, expected, rtol=1e-4, atol=1e-6, msg=name)
        before = {n: p.detach().clone() for n, p in trained.items()}
        arm.optimizer.zero_grad(set_to_none=True)
        step(arm, batch)
        assert all(not torch.equal(before[n], p) for n, p in trained.items())
    finally:
        arm.private.close()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--shape", "bert-huge"], "unknown shape 'bert-huge'"),
        (["--steps", "0"], "--steps must be at least 1"),
    ],
)
def test_bad_options_are_refused_by_name(argv, message, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err


def test_cuda_without_cuda_is_refused(capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(SystemExit):
        main(["--shape", "quick", "--device", "cuda"])
    assert "CUDA is not available" in capsys.readouterr().err
