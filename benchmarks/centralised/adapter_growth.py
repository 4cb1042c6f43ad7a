"""How far each method's adapter moves the adapted weights as centralised training runs, per
learning rate: the diagnosis of FLoRG's stall at large learning rates
(lab/evidence/evidence/NOTES.md, "Why FLoRG stalls at 2e-3 on SNLI").

    python -m benchmarks.centralised.adapter_growth --task snli --learning-rates 5e-4,2e-3 \
        --methods florg,fedit --steps 300 --eval-every 30

Every ``--eval-every`` steps it prints, per method and learning rate: the mean training
loss of the last chunk, the validation accuracy, and the relative change of the adapted
weights since step 0,

    rel_dW = || W_eff(t) - W_eff(0) ||_F / || W0 ||_F      (median and max over layers)

where W_eff = W0 + s L A^T A R for FLoRG (paper, eq. (1)) and W0 + s B A for LoRA. Since
L and R are semi-orthogonal, ||s L M R||_F = s ||M||_F, so FLoRG's row is also the size of
the change of s A^T A. Also the Frobenius norm of the trainable head's weights, which every
method trains at the same learning rate.

The training is the centralised reference's (``benchmarks.centralised.training``): the
app's ``resolve_config``, ``cached_adapted_model``, ``tokenized_split`` of the whole
training split, ``train_centralised`` (a client round's ``train_steps``, AdamW fresh per
chunk) and ``evaluate``; one torch thread.
"""

from __future__ import annotations

import argparse
import statistics
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="all-MiniLM-L6-v2")
    parser.add_argument("--task", default="snli")
    parser.add_argument("--methods", default="florg,fedit")
    parser.add_argument("--learning-rates", default="5e-4,2e-3")
    parser.add_argument("--steps", type=int, default=300, help="total AdamW steps")
    parser.add_argument("--eval-every", type=int, default=30, help="steps between evaluations")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-train-examples", type=int, default=2400)
    parser.add_argument("--max-eval-examples", type=int, default=300)
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.eval_every < 1:
        parser.error("--steps and --eval-every must be >= 1")
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    try:
        args.learning_rates = [float(v) for v in args.learning_rates.split(",") if v.strip()]
    except ValueError:
        parser.error(f"--learning-rates must be comma-separated numbers: {args.learning_rates}")
    if not args.methods or not args.learning_rates:
        parser.error("--methods and --learning-rates must each name at least one value")
    if any(lr <= 0 for lr in args.learning_rates):
        parser.error("--learning-rates must be positive")
    return args


def effective_weights(adapted: object) -> dict[str, tuple[object, object]]:
    """{layer: (W0, W_eff)} for every adapted linear layer, detached float64 copies."""
    import torch

    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    with torch.no_grad():
        for name, (w0, delta) in adapted.kind.delta_weights(adapted.model).items():
            out[name] = (w0, w0 + delta)
    return out


def relative_change(
    start: dict[str, tuple[object, object]], now: dict[str, tuple[object, object]]
) -> list[float]:
    """|| W_eff(t) - W_eff(0) ||_F / || W0 ||_F per layer."""
    import torch

    return [
        float(torch.linalg.norm(now[n][1] - start[n][1]) / torch.linalg.norm(start[n][0]))
        for n in start
    ]


def head_norm(adapted: object) -> float:
    """Frobenius norm of the trainable parameters outside the adapters (the task head)."""
    import torch

    squares = 0.0
    for name, p in adapted.model.named_parameters():
        if p.requires_grad and not (name.endswith(".A") or "lora_" in name):
            squares += float(torch.sum(p.detach().to(torch.float64) ** 2))
    return squares**0.5


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from benchmarks.centralised.training import (
        centralised_data,
        centralised_settings,
        train_centralised,
    )
    from flower_app.cache.per_process import cached_adapted_model
    from flower_app.settings.config import ConfigError, resolve_config

    torch.set_num_threads(args.threads)
    print(
        f"adapter growth: {args.model} on {args.task}, {args.max_train_examples} training / "
        f"{args.max_eval_examples} validation examples, batch {args.batch_size}, r = "
        f"{args.rank}, {args.steps} steps, seed {args.seed}",
        flush=True,
    )
    try:
        configs = {
            (m, lr): resolve_config({}, centralised_settings(args, m, lr))
            for m in args.methods
            for lr in args.learning_rates
        }
    except ConfigError as err:
        print(f"adapter growth: {err}", file=sys.stderr)
        return 2
    try:
        data, train_split, held_out = centralised_data(
            next(iter(configs.values())), kinds=("classification",)
        )
    except ValueError as err:
        print(f"adapter growth: {err}", file=sys.stderr)
        return 2
    rows: list[tuple[str, float, int, float, float, float, float, float]] = []

    def run(method: str, lr: float, config) -> None:
        # a fresh model per run (the cache returns a new copy), the same batches for all
        adapted = cached_adapted_model(config, data.num_labels)
        start_weights = effective_weights(adapted)
        start_head = head_norm(adapted)

        def after_chunk(done, trained, result) -> None:
            change = relative_change(start_weights, effective_weights(adapted))
            row = (
                method, lr, done, trained.loss, result.score,
                statistics.median(change), max(change), head_norm(adapted),
            )  # fmt: skip
            rows.append(row)
            print(
                f"[{method} lr {lr:g}] step {done:>4} | train loss {trained.loss:.4f} | "
                f"rel_dW median {row[5]:.4f} max {row[6]:.4f} | head {row[7]:.3f}",
                flush=True,
            )

        first = len(rows)
        curve = train_centralised(
            config, adapted.model, train_split, held_out, None, steps=args.steps,
            eval_every=args.eval_every, label=f"{method} lr {lr:g}", seed=0,
            after_chunk=after_chunk,
        )  # fmt: skip
        initial = curve.points[0][1]
        rows.insert(first, (method, lr, 0, float("nan"), initial, 0.0, 0.0, start_head))

    for (method, lr), config in configs.items():
        run(method, lr, config)
    print(
        "\n| method | lr | step | train loss | val acc | rel_dW median | rel_dW max | head norm |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for method, lr, step, loss, acc, med, top, head in rows:
        loss_cell = "–" if step == 0 else f"{loss:.4f}"
        print(
            f"| {method} | {lr:g} | {step} | {loss_cell} | {acc:.3f} | {med:.4f} | {top:.4f} "
            f"| {head:.3f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
