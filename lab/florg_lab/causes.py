"""The measured causes of FLoRG's deficit (issue 27), each printed from finished runs.

    python -m florg_lab.causes reachable RUN_DIR [RUN_DIR ...]
    python -m florg_lab.causes init-share RUN_DIR [RUN_DIR ...]
    python -m florg_lab.causes fedavg-gap RUN_DIR [RUN_DIR ...]
    python -m florg_lab.causes head-lr --v1 DIR [DIR ...] --v2 DIR [DIR ...] \
        --arms method=florg method=fedit

A RUN_DIR is a run folder the ServerApp wrote (``config.json``, ``metrics.jsonl``,
``summary.json``); ``reachable`` and ``init-share`` also need its last checkpoint
(``checkpoint/round-*/``, which published runs do not keep: rerun the run with its grid's
command, runs are deterministic).

**reachable** (cause b). FLoRG's update is ``s L P R`` with P = AᵀA positive
semi-definite and L (d_out x k), R (k x d_in) with orthonormal columns / rows. For any
update ΔW, the nearest reachable update is ``L P* R`` with P* the positive part of the
symmetric part of C = Lᵀ ΔW Rᵀ (the Frobenius projection onto the frame, then onto the
closed convex PSD cone), and by Moreau's decomposition the reachable fraction is

    ||P*||²_F / ||ΔW||²_F,

summed over the adapted layers (a layer counts by its ||ΔW||²). Printed for the run's final
global update (FLoRG: s L AᵀA R over the original W0; LoRA methods: s B A, FedEx-LoRA plus
its folded residual) in both frames, ``semi-orthogonal`` (seeded by the run's seed and the
layer shape) and ``svd`` (W0's singular vectors), beside a Gaussian random matrix of each
layer's shape in the same frame (about 1/4 for square layers: half of C is symmetric, half
of a random symmetric spectrum is positive). FedSA-LoRA's global model has no update (its
B stays on the clients) and is skipped with that reason.

**init-share** (cause d). FLoRG starts from ΔW⁰ = s L A₀ᵀA₀ R ≠ 0 (A₀ the seeded
initial A) unless ``subtract-init``. Per run: ``coef`` = <ΔW, ΔW⁰> / ||ΔW⁰||² (how much of
the start the final update still holds; 1 = all of it) and ``share`` = coef² ||ΔW⁰||² /
||ΔW||² (the fraction of the final ||ΔW||² that is that start), summed over layers.

**fedavg-gap** (cause c). The server's metrics rows carry ``fedavg_gap_procrustes`` and
``fedavg_gap_truncate`` (strategies/florg/strategy.py): per round, ||A_new - Σ wₙAₙ||_F /
||A_new - A_prev||_F under each rank-mismatch policy; printed here as the mean over rounds.

**head-lr** (cause a). The paired gap between two arms (FLoRG − FedIT) under protocol v1
(one learning rate for adapter and head) and under v2 (the head's rate fixed), each at the
learning rate its grid chose, paired by seed; the change of the gap is the head rate's
share of it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

import strategies.registry  # noqa: F401  (every method registers: resolve_config reads them)
from florg_lab.communication import load_metrics
from florg_lab.runs import finished_run, finished_runs_under
from florg_lab.stats import mean_interval, paired_difference

__all__ = ["final_updates", "init_share", "reachable_fraction", "random_reachable_fraction"]

FRAMES = ("semi-orthogonal", "svd")


# --------------------------------------------------------------------------- the math


def reachable_fraction(delta: np.ndarray, L: np.ndarray, R: np.ndarray) -> tuple[float, float]:
    """(||P*||², ||ΔW||²) for one layer: P* the PSD part of sym(Lᵀ ΔW Rᵀ) (see the module
    docstring). L has orthonormal columns, R orthonormal rows."""
    core = L.T @ delta @ R.T
    sym = (core + core.T) / 2
    eigenvalues = np.linalg.eigvalsh(sym)
    positive = np.clip(eigenvalues, 0.0, None)
    return float(np.sum(positive**2)), float(np.sum(delta**2))


def random_reachable_fraction(
    shape: tuple[int, int], L: np.ndarray, R: np.ndarray, rng: np.random.Generator
) -> tuple[float, float]:
    """``reachable_fraction`` of a standard Gaussian matrix of ``shape``."""
    return reachable_fraction(rng.standard_normal(shape), L, R)


def init_share(delta: np.ndarray, delta0: np.ndarray) -> tuple[float, float, float]:
    """(<ΔW, ΔW⁰>, ||ΔW⁰||², ||ΔW||²) of one layer (summed over layers, then coef and share)."""
    return float(np.sum(delta * delta0)), float(np.sum(delta0**2)), float(np.sum(delta**2))


# --------------------------------------------------------------------------- run folders


def _run_config(folder: Path) -> Any:
    from flower_app.settings.config import resolve_config, schema

    values = json.loads((folder / "config.json").read_text())
    return resolve_config({}, {k: v for k, v in values.items() if k in schema()})


Update = tuple[np.ndarray, np.ndarray, np.ndarray]  # (final ΔW, original W0, start ΔW⁰)


def final_updates(folder: Path) -> tuple[Any, dict[str, Update]]:
    """(the run's config, layer -> (final ΔW over the original W0, the original W0, the
    update the run started from: FLoRG's ΔW⁰, else 0)), float64, from the run's newest
    checkpoint; ValueError when there is none or the method keeps its update on the
    clients."""
    import torch

    from flower_app.cache.per_process import cached_adapted_model
    from flower_app.run_output.checkpoint import load_checkpoint
    from flower_app.task_data import load_task_data

    checkpoint = load_checkpoint(folder)
    if checkpoint is None:
        raise ValueError(
            f"{folder}: no checkpoint (published runs keep none): rerun the run with its "
            "grid's command, e.g. python -m florg_lab run GRID --only RUN_ID"
        )
    config = _run_config(folder)
    # a model of its own (the per-process cache would share it with whoever loads arrays)
    adapted = cached_adapted_model.__wrapped__(config, load_task_data(config).num_labels)
    if adapted.method.personal:
        raise ValueError(f"{folder}: {config.method} keeps its update on the clients")
    out: dict[str, Update] = {}
    kind = adapted.kind
    with torch.no_grad():
        start = kind.delta_weights(adapted.model)
        adapted.load_shared_state(checkpoint.arrays)
        # a folding method's residuals, folded into W0 over the rounds (s x their sum)
        s = adapted.method.adapter_alpha(config) / config.rank
        cumulative = {
            key[len("fedex/cumulative/") :]: np.asarray(value, np.float64)
            for key, value in checkpoint.strategy_arrays.items()
            if key.startswith("fedex/cumulative/")
        }
        for name, (frozen, final) in kind.delta_weights(adapted.model).items():
            w0, delta, delta0 = frozen.numpy(), final.numpy(), start[name][1].numpy()
            delta = delta + s * cumulative.get(name, 0.0)
            if kind.subtracts_initial_update(config, adapted.method):
                # the frozen weight is W0 - ΔW⁰: the update over W0 is Δ - ΔW⁰
                w0, delta, delta0 = w0 + delta0, delta - delta0, 0.0 * delta0
            out[name] = (delta, w0, delta0)
    return config, out


def _frame(name: str, w0: np.ndarray, seed: int, init: str) -> tuple[np.ndarray, np.ndarray]:
    from flower_app.adapters.florg.projections import make_projections, projection_key

    d_out, d_in = w0.shape
    key = projection_key(name, d_out, d_in, "shape", init)
    return make_projections(d_out, d_in, seed=seed, name=key, init=init, weight=w0)


def _label(config: Any) -> str:
    label = config.method
    if config.method.startswith("florg"):
        if config.subtract_init:
            label += " subtract-init"
        if config.projection_init != "semi-orthogonal":
            label += f" projection-init={config.projection_init}"
    return label


def _loaded(folders: Sequence[Path], rows: list[dict[str, Any]]):
    """(folder, config, final updates) of each run; a run without them adds a skipped row."""
    for folder in folders:
        try:
            config, updates = final_updates(folder)
        except ValueError as err:
            rows.append({"run": folder.name, "skipped": str(err)})
            continue
        yield folder, config, updates


def reachable_rows(folders: Sequence[Path], seed: int = 0) -> list[dict[str, Any]]:
    """One row per run: its label, seed, and per frame the reachable fraction of its final
    update and of random matrices of the same shapes."""
    rows: list[dict[str, Any]] = []
    for folder, config, updates in _loaded(folders, rows):
        row: dict[str, Any] = {"run": folder.name, "label": _label(config), "seed": config.seed}
        rng = np.random.default_rng(seed)
        for init in FRAMES:
            reached = total = random_reached = random_total = 0.0
            for name, (delta, w0, _) in updates.items():
                L, R = _frame(name, w0, config.seed, init)
                a, b = reachable_fraction(delta, L, R)
                c, d = random_reachable_fraction(delta.shape, L, R, rng)
                reached, total = reached + a, total + b
                random_reached, random_total = random_reached + c, random_total + d
            row[init] = reached / total if total > 0 else float("nan")
            row[f"random {init}"] = random_reached / random_total
        rows.append(row)
    return rows


def init_share_rows(folders: Sequence[Path]) -> list[dict[str, Any]]:
    """One row per FLoRG run: coef and share of ΔW⁰ in the final update (module doc)."""
    rows: list[dict[str, Any]] = []
    for folder, config, updates in _loaded(folders, rows):
        if not config.method.startswith("florg"):
            rows.append({"run": folder.name, "skipped": f"{config.method} starts at ΔW = 0"})
            continue
        inner = total0 = total = 0.0
        for delta, _, delta0 in updates.values():
            a, b, c = init_share(delta, delta0)
            inner, total0, total = inner + a, total0 + b, total + c
        coef = inner / total0 if total0 > 0 else 0.0
        share = coef**2 * total0 / total if total > 0 else float("nan")
        rows.append({"run": folder.name, "label": _label(config), "seed": config.seed,
                     "coef": coef, "share": share,
                     "start-norm": total0**0.5, "final-norm": total**0.5})  # fmt: skip
    return rows


def fedavg_gap_rows(folders: Sequence[Path]) -> list[dict[str, Any]]:
    """One row per FLoRG run: the mean over rounds of each policy's FedAvg gap."""
    rows = []
    for folder in folders:
        metrics = load_metrics(folder / "metrics.jsonl")
        row: dict[str, Any] = {"run": folder.name}
        for policy in ("procrustes", "truncate"):
            values = [float(r[f"fedavg_gap_{policy}"]) for r in metrics
                      if r.get(f"fedavg_gap_{policy}") is not None]  # fmt: skip
            row[policy] = sum(values) / len(values) if values else None
        if row["procrustes"] is None:
            row["skipped"] = "no fedavg_gap_* in metrics.jsonl (not FLoRG, or before the key)"
        rows.append(row)
    return rows


# --------------------------------------------------------------------------- head lr (a)


def _matches(config: dict[str, Any], arm: dict[str, str]) -> bool:
    return all(str(config.get(k)) == v for k, v in arm.items())


def _chosen_scores(roots: Sequence[Path], arm: dict[str, str]) -> dict[int, float]:
    """seed -> final test score of the arm's runs at the learning rate its grid chose
    (the lr that ran seed 1; tuning runs at other rates exist only for seed 0)."""
    by_lr: dict[float, dict[int, float]] = {}
    for _folder, summary, config in finished_runs_under(roots):
        score = summary.get("final-test-score")  # FedSA-LoRA's: its personalised models'
        if _matches(config, arm) and score is not None:
            by_lr.setdefault(float(config["learning-rate"]), {})[int(config["seed"])] = score
    chosen = [lr for lr, seeds in by_lr.items() if any(s != 0 for s in seeds)]
    if len(chosen) != 1:
        raise ValueError(f"arm {arm}: expected one learning rate with seeds > 0, got {chosen}")
    return by_lr[chosen[0]]


def head_lr_report(v1: Sequence[Path], v2: Sequence[Path], arms: Sequence[str]) -> list[str]:
    parsed = [dict(part.split("=", 1) for part in arm.split(",")) for arm in arms]
    first, second = parsed
    gaps = {}
    for name, roots in (("v1", v1), ("v2", v2)):
        a, b = _chosen_scores(roots, first), _chosen_scores(roots, second)
        gaps[name] = {s: a[s] - b[s] for s in sorted(set(a) & set(b))}
    seeds = sorted(set(gaps["v1"]) & set(gaps["v2"]))
    lines = [f"{arms[0]} − {arms[1]}, final-round test score, paired by seed {seeds}:"]
    for name in ("v1", "v2"):
        lines.append(f"  {name}: {mean_interval([gaps[name][s] for s in seeds])}")
    if len(seeds) >= 2:
        change = paired_difference([gaps["v2"][s] for s in seeds], [gaps["v1"][s] for s in seeds])
        lines.append(f"  v2 − v1 (the head rate's share of the gap): {change.difference}")
    return lines


# --------------------------------------------------------------------------- command line


def _print_rows(rows: list[dict[str, Any]], columns: list[str]) -> None:
    print("| run | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        if "skipped" in row:
            print(f"| {row['run']} | skipped: {row['skipped']} |")
            continue
        cells = [f"{row[c]:.4f}" if isinstance(row.get(c), float) else str(row.get(c, "–"))
                 for c in columns]  # fmt: skip
        print(f"| {row['run']} | " + " | ".join(cells) + " |")
        groups.setdefault(str(row.get("label", "")), []).append(row)
    numeric = [c for c in columns if all(isinstance(r.get(c), float)
               for g in groups.values() for r in g)]  # fmt: skip
    if any(len(g) > 1 for g in groups.values()) and numeric:
        print("\nper label, mean [95% CI] over runs:")
        for label, group in groups.items():
            cells = [f"{c} {mean_interval([r[c] for r in group])}" for c in numeric]
            print(f"  {label} ({len(group)} runs): " + "; ".join(cells))


def _folders(paths: Sequence[Path]) -> list[Path]:
    """Run folders: each path itself if it holds a finished run, else its finished runs."""
    out = []
    for path in paths:
        if finished_run(path) is not None:
            out.append(path)
        else:
            out += [folder for folder, _, _ in finished_runs_under([path])]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("reachable", "init-share", "fedavg-gap"):
        cmd = sub.add_parser(name)
        cmd.add_argument("runs", nargs="+", type=Path, help="run folders or folders of runs")
    head = sub.add_parser("head-lr")
    head.add_argument("--v1", nargs="+", type=Path, required=True)
    head.add_argument("--v2", nargs="+", type=Path, required=True)
    head.add_argument("--arms", nargs=2, required=True, help="key=value[,key=value] twice")
    args = parser.parse_args(argv)
    try:
        if args.command == "head-lr":
            print("\n".join(head_lr_report(args.v1, args.v2, args.arms)))
            return 0
        folders = _folders(args.runs)
        if not folders:
            raise ValueError(f"no finished run under {[str(p) for p in args.runs]}")
        if args.command == "reachable":
            columns = [c for f in FRAMES for c in (f, f"random {f}")]
            _print_rows(reachable_rows(folders), ["label", "seed", *columns])
        elif args.command == "init-share":
            rows = init_share_rows(folders)
            _print_rows(rows, ["label", "seed", "coef", "share", "start-norm", "final-norm"])
        else:
            _print_rows(fedavg_gap_rows(folders), ["procrustes", "truncate"])
    except (FileNotFoundError, ValueError) as err:
        print(f"causes: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
