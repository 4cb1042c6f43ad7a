"""DP-SGD step time, FLoRG / LoRA: one example-level DP-SGD step (``dp=example``) of FLoRG
and of PEFT LoRA, measured side by side in one run, with the same two methods without DP
for reference.

    python -m benchmarks.core.dp_sgd_step --shape minilm --device cpu --steps 12
    python -m benchmarks.core.dp_sgd_step --shape roberta-large --device cuda
    python -m benchmarks.core.dp_sgd_step --shape quick --steps 2   # smoke test

Models: the core benchmark's randomly initialised encoder classifiers
(benchmarks/core/client.py ``build_method``: the app's adapter and optimiser for FLoRG and
for PEFT LoRA, the app's ``fedit``, r = 4, alpha = 16, targets query and value, head
trainable) at MiniLM size (BERT 6 x 384, batch 8 x 128), the RoBERTa-large shape (24 x
1024, batch 4 x 128) or a tiny ``quick`` BERT; ``--batch`` / ``--seq-len`` override the
shape's batch.

Arms, four models in one process: FLoRG and LoRA each wrapped for DP-SGD exactly as a
client's round wraps them (flower_app/privacy/dp_sgd.py: a run configuration with ``dp=example``
from ``resolve_config``, the round's ``DpSgdPlan`` from ``ClientAccountant.plan``, then
``DpSgd.attach``: Opacus' ``GradSampleModule`` hooks, with the project's grad samplers for
FLoRG's A, and ``DPOptimizer`` around the app's AdamW), and FLoRG and LoRA without DP. A
step is the app's ``train_step`` (flower_app/training/loop.py) with the arm's optimiser, as the
client's training loop runs it: forward, backward (with per-example gradients under DP),
then the optimiser step (under DP: each example's gradient clipped to C jointly over all
trained parameters, Gaussian noise of std z C added to the sum, AdamW update).

What is timed and why: every step takes one fixed batch of exactly the expected batch size
q n. ``DpSgd.attach`` builds the client's Poisson loader (``poisson_loader``) as a round does,
but its batches vary in size from step to step (standard deviation about sqrt(q n)), which
would add variance unrelated to the methods; a fixed batch gives every arm the same work
per step. The sampling itself is data loading, outside the step in either case.

Timing: after ``--warmup`` steps of each arm, ``--steps`` rounds, each running every arm
once, in the order FLoRG-DP, LoRA-DP, LoRA, FLoRG and the next round in the reverse order
(so each pair of methods alternates A B, B A, ... and every arm's mean position is the
same). Each round gives one ratio per pair (FLoRG / LoRA with DP, without DP, and DP / no
DP per method); the headline is the median of those per-round ratios, so load that comes
and goes hits both sides of a ratio. On a CPU the ratios use the process's CPU time
(``time.process_time``; the core benchmark's reasoning: foreign load stretches wall time,
hardly CPU time), wall time printed beside them; on CUDA wall time, synchronised.

Memory, after the timing, one more step of each arm: on CUDA
``torch.cuda.max_memory_allocated`` over the step (reset just before it) and what was
allocated before it; on a CPU the process's resident-set high-water mark (VmHWM, reset
through ``/proc/self/clear_refs`` just before the step, benchmarks/core/rss.py) above the
resident set before it, glibc's mmap threshold pinned at 64 KiB and free heap trimmed first
so that the resident set follows live memory (set only after the timing, which it would
slow). All four models live in the process, so the CPU figure is the step's own memory
(activations, per-example gradients, gradients, optimiser temporaries) above the models
and AdamW states held. tracemalloc does not see torch's allocations, so it is not used.

The last printed line is one JSON object with the numbers (also written by ``--json FILE``).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import statistics
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.core.client import build_method, param_counts
from benchmarks.core.rss import proc_status_kib, reset_peak_rss
from benchmarks.core.settings import MINILM, QUICK_MINILM, ROBERTA_LARGE, Batch, ModelShape
from benchmarks.core.settings import Settings as CoreSettings

SHAPES: dict[str, ModelShape] = {
    "minilm": MINILM,
    "roberta-large": ROBERTA_LARGE,
    "quick": replace(QUICK_MINILM, name="quick"),
}
# The arms in a round's order (the next round runs them reversed).
ARMS: tuple[str, ...] = ("florg-dp", "lora-dp", "lora", "florg")
LABELS = {
    "florg-dp": "FLoRG, DP-SGD",
    "lora-dp": "PEFT LoRA, DP-SGD",
    "florg": "FLoRG, no DP",
    "lora": "PEFT LoRA, no DP",
}
# The ratios printed: (label, numerator arm, denominator arm).
RATIOS: tuple[tuple[str, str, str], ...] = (
    ("DP-SGD step, FLoRG / LoRA", "florg-dp", "lora-dp"),
    ("no-DP step, FLoRG / LoRA", "florg", "lora"),
    ("DP overhead, FLoRG (DP step / no-DP step)", "florg-dp", "florg"),
    ("DP overhead, LoRA (DP step / no-DP step)", "lora-dp", "lora"),
)
# The client's n examples: q = batch / n (only the accountant's epsilon depends on it).
EXAMPLES_PER_BATCH = 50
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number


@dataclass(frozen=True)
class DpStepSettings:
    """One run of the benchmark."""

    shape: ModelShape
    device: str = "cpu"
    steps: int = 12  # measured rounds; each runs every arm once
    warmup: int = 2  # steps of each arm before the timing
    threads: int = 1
    rank: int = 4
    alpha: float = 16.0
    noise_multiplier: float = 1.0
    clipping_norm: float = 1.0
    seed: int = 0
    memory: bool = True  # one more step of each arm, for its peak memory


@dataclass
class Arm:
    """One arm: its model, the optimiser its steps use (Opacus' DPOptimizer under DP), and
    under DP the attached ``PrivateTraining`` and the round's plan."""

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    private: Any = None  # flower_app.privacy.dp_sgd.PrivateTraining
    plan: Any = None  # flower_app.privacy.dp_sgd.DpSgdPlan
    steps: int = 0

    @property
    def dp(self) -> bool:
        return self.private is not None


def dp_run_config(method: str, s: DpStepSettings, steps: int) -> Any:
    """The run configuration of a ``dp=example`` client of ``method`` ('florg' or 'lora'),
    built as tests/runtime/test_dp_sgd.py builds it: one round of ``steps`` local steps at the
    shape's batch size, the noise multiplier and clipping norm of ``s``."""
    from flower_app.settings.config import resolve_config

    values = {
        "method": {"florg": "florg", "lora": "fedit"}[method],
        "rank": s.rank,
        "alpha": s.alpha,
        "target-modules": "query,value",
        "dp": "example",
        "batch-size": s.shape.batch,
        "local-steps": max(1, steps),
        "num-server-rounds": 1,
        "dp-sgd-noise-multiplier": s.noise_multiplier,
        "dp-sgd-clipping-norm": s.clipping_norm,
    }
    return resolve_config({}, values)


def make_dataset(s: DpStepSettings) -> list[dict[str, torch.Tensor]]:
    """The client's n = EXAMPLES_PER_BATCH x batch random examples (the Poisson loader's
    dataset); the timed batch is their first ``batch``."""
    from benchmarks.core.client import make_batch

    n = EXAMPLES_PER_BATCH * s.shape.batch
    rows = make_batch(replace(s.shape, batch=n), s.seed)
    return [{k: v[i] for k, v in rows.items()} for i in range(n)]


def fixed_batch(dataset: list[dict[str, torch.Tensor]], s: DpStepSettings) -> Batch:
    """The timed batch: the dataset's first q n = ``batch`` examples, on the device."""
    rows = dataset[: s.shape.batch]
    return {k: torch.stack([r[k] for r in rows]).to(s.device) for k in rows[0]}


def build_arm(name: str, s: DpStepSettings, dataset: list[dict[str, torch.Tensor]]) -> Arm:
    """The model of ``name`` (an entry of ARMS) on ``s.device``; the DP arms attached for
    DP-SGD with the project's own functions (flower_app/privacy/dp_sgd.py), seeded generators
    (``DpSgd(plan, seed)``: reproducible, as ``dp-sgd-seeded-noise=true``)."""
    from flower_app.privacy.dp_sgd import ClientAccountant, DpSgd

    method = name.removesuffix("-dp")
    core = CoreSettings(rank=s.rank, alpha=s.alpha, seed=s.seed)
    model, optimizer = build_method(method, s.shape, core)
    model.to(s.device)  # in place: the optimiser's parameters are the moved ones
    if not name.endswith("-dp"):
        return Arm(name, model, optimizer)
    total = s.warmup + s.steps + int(s.memory)
    plan = ClientAccountant().plan(dp_run_config(method, s, total), len(dataset))
    loader = torch.utils.data.DataLoader(dataset, batch_size=s.shape.batch)
    private = DpSgd(plan, seed=s.seed).attach(model, optimizer, loader)
    return Arm(name, model, private.optimizer, private, plan)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def step(arm: Arm, batch: Batch) -> None:
    """One training step of ``arm``: the app's ``train_step`` with the arm's optimiser."""
    from flower_app.training.loop import train_step

    train_step(arm.model, arm.optimizer, batch, step=arm.steps)
    arm.steps += 1


def timed_step(arm: Arm, batch: Batch, device: str) -> tuple[float, float]:
    """(wall, process CPU) seconds of one step, synchronised on CUDA."""
    _sync(device)
    w0, c0 = time.perf_counter(), time.process_time()
    step(arm, batch)
    _sync(device)
    return time.perf_counter() - w0, time.process_time() - c0


def _pin_malloc() -> None:
    """Large allocations (>= 64 KiB) through mmap, so freed tensors leave the resident set,
    and the heap's free memory returned now (glibc; a no-op elsewhere)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, 65536)
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def step_memory(arm: Arm, batch: Batch, device: str) -> dict[str, Any]:
    """Peak memory of one more step of ``arm`` (module docstring), gradients freed first."""
    arm.optimizer.zero_grad(set_to_none=True)
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step(arm, batch)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        return {
            "measure": "torch.cuda.max_memory_allocated",
            "peak_bytes": peak,
            "before_bytes": before,
            "step_bytes": peak - before,
        }
    _pin_malloc()
    if not reset_peak_rss():
        step(arm, batch)
        return {"measure": "VmHWM (not resettable here)", "peak_bytes": None, "step_bytes": None}
    before = proc_status_kib("VmRSS")
    step(arm, batch)
    peak = proc_status_kib("VmHWM")
    return {
        "measure": "VmHWM above VmRSS before the step",
        "peak_bytes": peak * 1024,
        "before_bytes": before * 1024,
        "step_bytes": (peak - before) * 1024,
    }


def _ratios(times: dict[str, list[float]], num: str, den: str) -> list[float]:
    return [a / b for a, b in zip(times[num], times[den], strict=True)]


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run(s: DpStepSettings) -> dict[str, Any]:
    """Build the four arms, time them in alternating rounds, measure their memory; the
    numbers as a JSON-able dict (``format_report`` prints it)."""
    import transformers

    transformers.logging.set_verbosity_error()
    with warnings.catch_warnings():
        # Opacus' hooks where no input needs a gradient (the first encoder layer's input
        # comes from the frozen embeddings): a notice each backward, not a fault
        warnings.filterwarnings("ignore", "Full backward hook is firing", UserWarning)
        return _run(s)


def _run(s: DpStepSettings) -> dict[str, Any]:
    torch.set_num_threads(s.threads)
    load_start = os.getloadavg()
    dataset = make_dataset(s)
    batch = fixed_batch(dataset, s)
    arms = {name: build_arm(name, s, dataset) for name in ARMS}
    try:
        for arm in arms.values():
            for _ in range(s.warmup):
                step(arm, batch)
        wall: dict[str, list[float]] = {name: [] for name in ARMS}
        cpu: dict[str, list[float]] = {name: [] for name in ARMS}
        gc.collect()
        for k in range(s.steps):
            for name in ARMS if k % 2 == 0 else ARMS[::-1]:
                w, c = timed_step(arms[name], batch, s.device)
                wall[name].append(w)
                cpu[name].append(c)
        memory = (
            {name: step_memory(arms[name], batch, s.device) for name in ARMS} if s.memory else {}
        )
        dp_records = {name: _dp_record(arm) for name, arm in arms.items() if arm.dp}
    finally:
        for arm in arms.values():
            if arm.private is not None:
                arm.private.close()
    clock = "wall" if s.device.startswith("cuda") else "cpu"
    headline = wall if clock == "wall" else cpu
    ratios = {
        f"{num}/{den}": {
            "label": label,
            **_summary(_ratios(headline, num, den)),
            "per_round": _ratios(headline, num, den),
            "wall_median": statistics.median(_ratios(wall, num, den)),
        }
        for label, num, den in RATIOS
    }
    return {
        "settings": {**asdict(s), "shape": asdict(s.shape)},
        "clock": clock,
        "machine": _machine(s, load_start),
        "arms": {
            name: {
                "wall_median_s": statistics.median(wall[name]),
                "cpu_median_s": statistics.median(cpu[name]),
                "cpu_min_s": min(cpu[name]),
                "wall_min_s": min(wall[name]),
                "timed_steps": len(wall[name]),
                **param_counts(arms[name].model),
                "memory": memory.get(name),
            }
            for name in ARMS
        },
        "ratios": ratios,
        "dp": dp_records,
        "load_end": list(os.getloadavg()),
    }


def _dp_record(arm: Arm) -> dict[str, Any]:
    """The DP optimiser's noise multiplier and clipping norm, and the client's epsilon after
    the steps this arm took (the round's plan composed in a ``ClientAccountant``)."""
    from flower_app.privacy.dp_sgd import ClientAccountant

    plan = replace(arm.plan, steps=arm.steps)
    accountant = ClientAccountant(noise_multiplier=plan.noise_multiplier)
    accountant.record(plan)
    return {
        "noise_multiplier": arm.optimizer.noise_multiplier,
        "max_grad_norm": arm.optimizer.max_grad_norm,
        "expected_batch_size": arm.optimizer.expected_batch_size,
        "sample_rate": plan.sample_rate,
        "examples": plan.num_examples,
        "delta": plan.delta,
        "steps": arm.steps,
        "epsilon": accountant.epsilon(),
    }


def _machine(s: DpStepSettings, load: Sequence[float]) -> dict[str, Any]:
    import opacus
    import peft
    import transformers

    device = torch.cuda.get_device_name(0) if s.device.startswith("cuda") else "CPU"
    return {
        "device": device,
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_start": list(load),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "opacus": opacus.__version__,
        "threads": s.threads,
    }


def _ms(t: float) -> str:
    return f"{t * 1e3:.1f} ms"


def _mib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:,.1f} MiB"


def format_report(res: dict[str, Any]) -> str:
    """The markdown tables of a run."""
    st, sh, m = res["settings"], res["settings"]["shape"], res["machine"]
    clock = "CPU time" if res["clock"] == "cpu" else "wall time, synchronised"
    load = ", ".join(f"{x:.2f}" for x in m["load_start"])
    load_end = ", ".join(f"{x:.2f}" for x in res["load_end"])
    dp = res["dp"].get("florg-dp") or next(iter(res["dp"].values()))
    lines = [
        f"# DP-SGD step time, FLoRG / LoRA: {sh['name']}, {st['device']}",
        "",
        f"- {m['device']} ({m['cpu']}, os.cpu_count() = {m['cpu_count']}), {m['threads']} "
        f"torch thread(s); load average (1/5/15 min) {load} at the start, {load_end} at the end",
        f"- python {m['python']}, torch {m['torch']}, transformers {m['transformers']}, peft "
        f"{m['peft']}, opacus {m['opacus']}",
        f"- model: {sh['family']} {sh['layers']} x {sh['hidden']}, {sh['heads']} heads, FFN "
        f"{sh['ffn']}, vocab {sh['vocab']} (random weights); batch {sh['batch']} x "
        f"{sh['seq_len']}; r = {st['rank']}, alpha = {st['alpha']:g}, targets query+value, "
        "head trainable",
        f"- DP-SGD: z = {dp['noise_multiplier']:g}, C = {dp['max_grad_norm']:g}, expected "
        f"batch {dp['expected_batch_size']} (q = {dp['sample_rate']:g} of n = {dp['examples']}); "
        f"every step on one fixed batch of that size; epsilon after the {dp['steps']} steps of "
        f"each DP arm {dp['epsilon']:.3g} (delta {dp['delta']:.2g})",
        f"- {st['warmup']} warm-up steps per arm, then {st['steps']} rounds of one step per arm "
        "(FLoRG-DP, LoRA-DP, LoRA, FLoRG, then reversed); ratios: median of per-round ratios "
        f"of {clock}",
        "",
        "| arm | trainable (adapter + head) | median step, CPU | median step, wall | "
        "min step, CPU | step peak memory above before | peak (process: all four models) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in ARMS:
        a = res["arms"][name]
        mem = a["memory"] or {}
        lines.append(
            f"| {LABELS[name]} | {a['trainable']:,} ({a['adapter']:,} + {a['head']:,}) | "
            f"{_ms(a['cpu_median_s'])} | {_ms(a['wall_median_s'])} | {_ms(a['cpu_min_s'])} | "
            f"{_mib(mem.get('step_bytes'))} | {_mib(mem.get('peak_bytes'))} |"
        )
    lines += [
        "",
        f"| ratio | median ({clock}) | range over {st['steps']} rounds | median, wall |",
        "|---|---|---|---|",
    ]
    for r in res["ratios"].values():
        lines.append(
            f"| {r['label']} | **{r['median']:.3f}** | {r['min']:.3f}-{r['max']:.3f} | "
            f"{r['wall_median']:.3f} |"
        )
    mf = (res["arms"]["florg-dp"]["memory"] or {}).get("step_bytes")
    ml = (res["arms"]["lora-dp"]["memory"] or {}).get("step_bytes")
    if mf and ml:
        lines.append(f"| DP-SGD step peak memory above before, FLoRG / LoRA | {mf / ml:.3f} | | |")
    if res["arms"]["florg-dp"]["memory"]:
        lines += ["", f"Memory: {res['arms']['florg-dp']['memory']['measure']}."]
    return "\n".join(lines) + "\n"


def settings_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> DpStepSettings:
    """The run's settings; ``parser.error`` for an unknown shape or CUDA without CUDA."""
    shape = SHAPES.get(args.shape)
    if shape is None:
        parser.error(f"unknown shape {args.shape!r}; shapes: {', '.join(SHAPES)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available here (torch sees no GPU)")
    if args.batch is not None:
        shape = replace(shape, batch=args.batch)
    if args.seq_len is not None:
        shape = replace(shape, seq_len=args.seq_len)
    for key in ("steps", "batch", "seq_len", "threads"):
        value = getattr(args, key)
        if value is not None and value < 1:
            parser.error(f"--{key.replace('_', '-')} must be at least 1, not {value}")
    if args.warmup < 0:
        parser.error(f"--warmup must be at least 0, not {args.warmup}")
    return DpStepSettings(
        shape=shape,
        device=args.device,
        steps=args.steps,
        warmup=args.warmup,
        threads=args.threads,
        memory=not args.no_memory,
    )


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--shape", default="minilm", help=f"one of {', '.join(SHAPES)}")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--batch", type=int, help="batch size (default: the shape's)")
    parser.add_argument("--seq-len", type=int, help="tokens per example (default: the shape's)")
    parser.add_argument("--steps", type=int, default=12, help="measured rounds (default 12)")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up steps per arm")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory step")
    parser.add_argument("--json", type=Path, help="also write the numbers to this file")
    args = parser.parse_args(argv)
    s = settings_from_args(args, parser)
    res = run(s)
    print(format_report(res), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res), flush=True)
    return res


if __name__ == "__main__":
    main()
