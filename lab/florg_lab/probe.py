"""Head or features? A linear probe of a finished run's global model.

    python -m florg_lab.probe RUN_DIR [RUN_DIR ...] [--round T]

For each run folder: load the global model the ServerApp checkpointed after round ``T``
(default: the last; ``--round 0`` without a round-0 checkpoint: the seeded model the
ServerApp starts from, the baseline the federated rounds improve on), collect the features
its classification head sees on the run's whole training pool and on its held-out test
split, refit that head centrally (a multinomial logistic regression on the standardised
features, the same for every run) and print, as a markdown table, the test accuracy of the
federated head beside the refitted one. When the refit is far better, the federated head
is what holds the model back; when the two agree, the features are.

Runs whose global model is not a method output alone are refused: a method with personal
parts (FedSA-LoRA: its global B is zero) or with a server-side fold (FedEx-LoRA: its
residual lives in the strategy's state).

The runs published under ``lab/evidence/`` keep ``config.json``, ``metrics.jsonl`` and
``summary.json`` only, no checkpoint: ``--round 0`` works on them as they are; any later
round needs the run's checkpoint back, which the grid runner regenerates by rerunning the
run (deterministic: the same settings, seed, data and partition), e.g.::

    florg experiments run GRID --out DIR --only RUN_ID --no-report
    python -m florg_lab.probe DIR/runs/RUN_ID

(a tuned grid needs its published choices first, ``lab/evidence/evidence/GRID-tuning.json``
copied to ``DIR/tuning.json``; the evidence grids rerun at their own commit,
``lab/scripts/evidence_grid.sh``). A missing checkpoint's error prints that command.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.numpy import load_file

import strategies.registry  # noqa: F401  (every method registers: resolve_config reads them)
from flower_app.cache.per_process import cached_adapted_model
from flower_app.methods.contract import Method
from flower_app.modeling import pick_device
from flower_app.settings.config import RunConfig, resolve_config, schema
from flower_app.task_data import load_task_data, make_loader, tokenized_split

HEADER = (
    "| run | round | federated head, test | refitted head, test | refit − federated |\n"
    "|---|---|---|---|---|"
)
ROOT = Path(__file__).resolve().parents[2]  # the repository
HEAD = "classifier"  # the head module of Hugging Face's *ForSequenceClassification models


class ProbeError(ValueError):
    """A run folder this probe cannot score (named in the message)."""


def _run_config(folder: Path) -> RunConfig:
    try:
        saved = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ProbeError(f"{folder}: no readable config.json ({err})") from err
    return resolve_config({}, {k: v for k, v in saved.items() if k in schema()})


def regenerate_hint(folder: Path) -> str:
    """How to get a run folder's checkpoint back: rerun the run with the grid runner.

    A published run lies at ``lab/evidence/<grid>/runs/<run id>`` (or, for the evidence
    grids, ``lab/evidence/evidence/runs/<grid>/<run id>``), which names its grid."""
    folder = Path(folder)
    if folder.parent.name == "runs":
        grid = folder.parent.parent.name
    elif folder.parent.parent.name == "runs":
        grid = folder.parent.name
    else:
        grid = "GRID"
    tuning = f"lab/evidence/evidence/{grid}-tuning.json"
    first = (
        f" (first copy {tuning} to DIR/tuning.json, the published tuning choices; the "
        "evidence grids rerun at their own commit, lab/scripts/evidence_grid.sh)"
        if (ROOT / tuning).is_file()
        else ""
    )
    return (
        "Published runs (lab/evidence/) keep config.json, metrics.jsonl and summary.json "
        "only; regenerate the checkpoint by rerunning the run, which the grid runner does "
        f"deterministically: `florg experiments run {grid} --out DIR --only {folder.name} "
        f"--no-report`{first}, then probe DIR/runs/{folder.name}. Round 0 needs no "
        "checkpoint (--round 0)."
    )


def _checkpoint_arrays(folder: Path, round_: int | None) -> tuple[int, dict | None]:
    """The checkpointed global arrays after ``round_`` (None: the last); round 0 without
    a checkpoint is the initial model (None arrays: keep the seeded initialisation)."""
    rounds = sorted(folder.glob("checkpoint/round-*/arrays.safetensors"))
    if round_ is not None:
        rounds = [p for p in rounds if int(p.parent.name.split("-")[1]) == round_]
    if not rounds and round_ == 0:
        return 0, None
    if not rounds:
        which = "any round" if round_ is None else f"round {round_}"
        raise ProbeError(
            f"{folder}: no checkpoint of {which} (checkpoint/round-*/). {regenerate_hint(folder)}"
        )
    path = rounds[-1]
    return int(path.parent.name.split("-")[1]), load_file(str(path))


def _head(model: torch.nn.Module) -> torch.nn.Module:
    """The classification head (outermost module named ``classifier``: under PEFT, the
    wrapper that runs the trained copy)."""
    names = [n for n, _ in model.named_modules() if n == HEAD or n.endswith(f".{HEAD}")]
    if not names:
        raise ProbeError(f"the model has no module named {HEAD!r}")
    return model.get_submodule(min(names, key=len))


@torch.no_grad()
def _features(model: torch.nn.Module, loader, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's inputs and the labels over ``loader``."""
    head = _head(model)
    seen: list[torch.Tensor] = []
    hook = head.register_forward_hook(lambda _m, args, _out: seen.append(args[0].detach()))
    labels = []
    try:
        model.to(device).eval()
        for batch in loader:
            batch = {k: v.to(device) for k, v in batch.items()}
            model(**batch)
            labels.append(batch["labels"])
    finally:
        hook.remove()
    features = torch.cat(seen).float().cpu()
    if features.dim() == 3:  # a head that pools itself (e.g. RoBERTa's): its first token
        features = features[:, 0]
    return features, torch.cat(labels).cpu()


def refit_accuracy(
    train_x: torch.Tensor, train_y: torch.Tensor, test_x: torch.Tensor, test_y: torch.Tensor,
    num_labels: int, weight_decay: float = 1e-3,
) -> float:  # fmt: skip
    """Test accuracy of a logistic regression fitted (L-BFGS) on standardised features."""
    mean, std = train_x.mean(0), train_x.std(0).clamp_min(1e-6)
    x, xt = (train_x - mean) / std, (test_x - mean) / std
    torch.manual_seed(0)
    linear = torch.nn.Linear(x.shape[1], num_labels)
    optimiser = torch.optim.LBFGS(linear.parameters(), max_iter=500, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        optimiser.zero_grad()
        loss = torch.nn.functional.cross_entropy(linear(x), train_y)
        loss = loss + weight_decay * linear.weight.square().sum()
        loss.backward()
        return loss

    optimiser.step(closure)
    with torch.no_grad():
        return float((linear(xt).argmax(1) == test_y).float().mean())


def probe_row(folder: Path, round_: int | None = None) -> str:
    config = _run_config(folder)
    data = load_task_data(config)
    adapted = cached_adapted_model(config, data.num_labels, data.spec.kind)
    method = adapted.method
    if method.personal or type(method).receive_on_server is not Method.receive_on_server:
        raise ProbeError(f"{folder}: {config.method}'s global model is not its output alone")
    if config.max_test_examples <= 0:
        raise ProbeError(f"{folder}: the run scored no test split (max-test-examples = 0)")
    at, arrays = _checkpoint_arrays(folder, round_)
    if arrays is not None:
        adapted.load_shared_state(arrays)
    device = pick_device(config.device)
    loader = {
        split: make_loader(tokenized_split(config, split), config.eval_batch_size, False, 0)
        for split in ("train", "test")
    }
    train_x, train_y = _features(adapted.model, loader["train"], device)
    test_x, test_y = _features(adapted.model, loader["test"], device)
    with torch.no_grad():
        logits = _head(adapted.model.to("cpu"))(test_x)
        federated = float((logits.argmax(1) == test_y).float().mean())
    refit = refit_accuracy(train_x, train_y, test_x, test_y, data.num_labels)
    return f"| {folder.name} | {at} | {federated:.3f} | {refit:.3f} | {refit - federated:+.3f} |"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m florg_lab.probe", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("runs", type=Path, nargs="+", help="finished run folders")
    parser.add_argument("--round", type=int, default=None,
                        help="checkpointed round to probe (0: the initial model)")  # fmt: skip
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(HEADER, flush=True)
    for folder in args.runs:
        try:
            print(probe_row(folder, args.round), flush=True)
        except ProbeError as err:
            print(f"error: {err}", flush=True)
            return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
