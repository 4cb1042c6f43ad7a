"""Decoder benchmark: FLoRG vs PEFT LoRA step time and peak memory at decoder shapes
(issue 28), measured side by side in one run.

    python -m benchmarks.core.decoder_benchmark                  # all arms (see below)
    python -m benchmarks.core.decoder_benchmark --arms smollm2-bf16 --steps 2
    python -m benchmarks.core.decoder_benchmark --quick          # tiny decoder, a smoke test

Arms (adapters on q_proj, v_proj, r = 8, alpha = 16, no trained head; a causal-LM step on
random tokens, labels = inputs; forward + backward + AdamW, the app's ``train_step`` with
the settings ``precision`` / ``gradient-checkpointing`` applied by
flower_app/training/precision.py):

- ``smollm2-fp32``, ``smollm2-bf16``: the real SmolLM2-135M (the fetched asset:
  ``python -m florg_tools.assets fetch --only SmolLM2-135M``), batch 1 x 256;
- ``llama1b-bf16``: a randomly initialised LlamaForCausalLM of Llama-3.2-1B's shape (hidden
  2048, 16 layers, 32 heads, 8 kv heads, intermediate 8192, vocab 128256, tied embeddings)
  in bf16 with gradient checkpointing, batch 1 x 256;
- ``smollm2shape-fp32``, ``smollm2shape-bf16``: a randomly initialised LlamaForCausalLM of
  SmolLM2-135M's shape (its config.json: hidden 576, 30 layers, 9 heads, 3 kv heads,
  intermediate 1536, vocab 49152, tied embeddings), batch 1 x 256: the SmolLM2 arms where
  the asset is absent (a GPU machine without network). A step's time and memory do not
  depend on the weights' values: the same shapes, the same kernels;
- ``overhead30-bf16``: SmolLM2's 30 layers at the tiny decoder's widths (hidden 64), bf16,
  batch 1 x 8: a step made of the host's per-layer work (Python, dispatch, autograd
  nodes), as an H100 step at SmolLM2 size is (0.13 s a step, the CPU time equal to the wall
  time: lab/evidence/gpu-h100/), measured on a CPU.

Step time: both methods' models in one worker process, steps alternating between them (A B,
B A, ...); each adjacent pair gives one ratio FLoRG / LoRA and the headline is the median
of those, in the worker's CPU time (``time.process_time``, which foreign load on this shared
machine hardly changes; wall time is printed next to it). On CUDA: wall time, synchronised.

Peak memory: each method in its own fresh subprocess, after warm-up steps (AdamW's state
exists). On the CPU: the process's resident-set high-water mark (VmHWM) over one step, reset
through /proc/self/clear_refs just before it, with glibc's mmap threshold pinned at 64 KiB
so freed tensors go back to the OS (tracemalloc does not see torch's allocations); it
includes the model's weights, as a GPU's max_memory_allocated does. On CUDA:
``torch.cuda.max_memory_allocated`` over the step. The printed targets are those of
issue 28: step time <= 1.05, peak memory <= 1.03. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from torch import nn

from benchmarks import REPO_ROOT
from benchmarks.core.rss import proc_status_kib, reset_peak_rss

WORKER_MODULE = "benchmarks.core.decoder_benchmark"
METHODS = ("florg", "lora")
APP_METHOD = {"florg": "florg", "lora": "fedit"}  # fedit: plain federated PEFT LoRA

LLAMA_1B_SHAPE = {  # Llama-3.2-1B's config.json, randomly initialised here
    "hidden_size": 2048,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 8192,
    "vocab_size": 128256,
    "tie_word_embeddings": True,
    "max_position_embeddings": 2048,
}
SMOLLM2_SHAPE = {  # SmolLM2-135M's config.json, randomly initialised here
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "intermediate_size": 1536,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
    "max_position_embeddings": 8192,
}
TINY_SHAPE = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 500,
    "tie_word_embeddings": True,
    "max_position_embeddings": 128,
}


@dataclass(frozen=True)
class Arm:
    """One measured configuration: which base, its precision, checkpointing, batch."""

    name: str
    base: str  # 'smollm2' (the asset); random: 'llama1b', 'smollm2shape', 'overhead30', 'tiny'
    precision: str
    gradient_checkpointing: bool
    batch: int = 1
    seq_len: int = 256
    steps: int = 4  # measured pairs of steps (one step per method each)
    warmup: int = 1


@dataclass(frozen=True)
class Settings:
    rank: int = 8
    alpha: float = 16.0
    targets: str = "q_proj,v_proj"
    threads: int = 1
    device: str = "cpu"
    seed: int = 0


ARMS: dict[str, Arm] = {
    a.name: a
    for a in (
        # pairs: on the loaded 2-core machine one pair's ratio spreads by +-10 %; these
        # take about 6, 6 and 25 minutes there (--steps to change them)
        Arm("smollm2-fp32", "smollm2", "fp32", False, steps=8),
        Arm("smollm2-bf16", "smollm2", "bf16", False, steps=8),
        Arm("llama1b-bf16", "llama1b", "bf16", True, steps=3),
    )
}
# Not in the default run (the real SmolLM2 arms measure the same shapes): for machines
# without the asset, by name (--arms smollm2shape-bf16).
SHAPE_ARMS: dict[str, Arm] = {
    a.name: a
    for a in (
        Arm("smollm2shape-fp32", "smollm2shape", "fp32", False, steps=8),
        Arm("smollm2shape-bf16", "smollm2shape", "bf16", False, steps=8),
        Arm("overhead30-bf16", "overhead30", "bf16", False, batch=1, seq_len=8, steps=40),
    )
}
QUICK_ARM = Arm("tiny-bf16", "tiny", "bf16", True, batch=1, seq_len=16, steps=1, warmup=0)


# --------------------------------------------------------------------------- building


def build_base(arm: Arm, seed: int, device: str = "cpu") -> nn.Module:
    """The base decoder of ``arm`` (same weights on every call on one device), its
    parameters in the arm's precision and gradient checkpointing applied
    (flower_app/training/precision.py). Random-weight bases are initialised on ``device`` (a 1B
    model's initialisation takes a minute on a CPU, seconds on a GPU)."""
    import transformers

    from flower_app.training.precision import from_pretrained_kwargs, prepare_base_model

    transformers.logging.set_verbosity_error()
    kwargs = from_pretrained_kwargs(arm.precision)
    if arm.base == "smollm2":
        from flower_app.cache.assets import model_path

        model = transformers.AutoModelForCausalLM.from_pretrained(
            model_path("SmolLM2-135M"), **kwargs
        )
    else:
        shapes = {
            "llama1b": LLAMA_1B_SHAPE,
            "smollm2shape": SMOLLM2_SHAPE,
            "overhead30": {**TINY_SHAPE, "num_hidden_layers": 30},
            "tiny": TINY_SHAPE,
        }
        shape = shapes[arm.base]
        torch.manual_seed(seed)
        config = transformers.LlamaConfig(**shape)
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(config, **kwargs)
    model.config.use_cache = False
    return prepare_base_model(
        model, arm.precision, gradient_checkpointing=arm.gradient_checkpointing
    )


def build_method(method: str, arm: Arm, s: Settings) -> tuple[nn.Module, Any, Any]:
    """(model, AdamW, MixedPrecision) for 'florg' or 'lora' with the app's adapter code."""
    from flower_app.adapted import AdaptedModel
    from flower_app.settings.config import resolve_config
    from flower_app.training.loop import make_optimizer
    from flower_app.training.precision import MixedPrecision, keep_trainable_float32

    config = resolve_config(
        {},
        {
            "method": APP_METHOD[method],
            "rank": s.rank,
            "alpha": s.alpha,
            "target-modules": s.targets,
            "train-head": False,
            "precision": arm.precision,
            "gradient-checkpointing": arm.gradient_checkpointing,
            "seed": s.seed,
        },
    )
    with warnings.catch_warnings():  # peft and transformers' deprecated checkpointing names
        warnings.filterwarnings("ignore", category=FutureWarning)
        model = AdaptedModel(build_base(arm, s.seed, s.device), config).model
    keep_trainable_float32(model)
    model.to(s.device).train()
    optimizer = make_optimizer(model, lr=1e-4, weight_decay=0.0)
    return model, optimizer, MixedPrecision.for_run(arm.precision, s.device)


def make_batch(arm: Arm, vocab: int, s: Settings) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(s.seed + 1)
    ids = torch.randint(3, vocab, (arm.batch, arm.seq_len), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    return {k: v.to(s.device) for k, v in batch.items()}


def counts(model: nn.Module) -> dict[str, int]:
    from flower_app.training.loop import is_adapter_parameter

    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    adapter = sum(p.numel() for n, p in named if is_adapter_parameter(n))
    held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    return {"trainable": trained, "adapter": adapter, "model_bytes": held}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _step(model: nn.Module, optimizer: Any, batch: dict[str, torch.Tensor], mixed: Any) -> None:
    from flower_app.training.loop import train_step

    train_step(model, optimizer, batch, mixed=mixed)


# --------------------------------------------------------------------------- workers


def time_worker(arm: Arm, s: Settings) -> dict[str, Any]:
    """Interleaved step timing of both methods' models, held in this one process."""
    torch.set_num_threads(s.threads)
    built = {m: build_method(m, arm, s) for m in METHODS}
    vocab = built["florg"][0].config.vocab_size
    batch = make_batch(arm, vocab, s)
    for model, opt, mixed in built.values():
        for _ in range(arm.warmup):
            _step(model, opt, batch, mixed)
    wall: dict[str, list[float]] = {m: [] for m in METHODS}
    cpu: dict[str, list[float]] = {m: [] for m in METHODS}
    gc.collect()
    for pair in range(arm.steps):
        for method in METHODS if pair % 2 == 0 else METHODS[::-1]:
            model, opt, mixed = built[method]
            _sync(s.device)
            w0, c0 = time.perf_counter(), time.process_time()
            _step(model, opt, batch, mixed)
            _sync(s.device)
            wall[method].append(time.perf_counter() - w0)
            cpu[method].append(time.process_time() - c0)
    clock = wall if s.device.startswith("cuda") else cpu
    ratios = [f / lo for f, lo in zip(clock["florg"], clock["lora"], strict=True)]
    wall_ratios = [f / lo for f, lo in zip(wall["florg"], wall["lora"], strict=True)]
    return {
        "ratio_median": statistics.median(ratios),
        "ratios": ratios,
        "clock": "wall" if s.device.startswith("cuda") else "cpu",
        "wall_ratio_median": statistics.median(wall_ratios),
        **{
            m: {
                "cpu_median_s": statistics.median(cpu[m]),
                "wall_median_s": statistics.median(wall[m]),
                "steps": len(wall[m]),
                **counts(built[m][0]),
            }
            for m in METHODS
        },
    }


def memory_worker(method: str, arm: Arm, s: Settings) -> dict[str, Any]:
    """Peak memory of one steady-state step of ``method`` (run in a fresh process)."""
    torch.set_num_threads(s.threads)
    model, opt, mixed = build_method(method, arm, s)
    batch = make_batch(arm, model.config.vocab_size, s)
    for _ in range(max(arm.warmup, 1)):  # AdamW's state exists before the measured step
        _step(model, opt, batch, mixed)
    opt.zero_grad(set_to_none=True)
    gc.collect()
    out: dict[str, Any] = counts(model)
    if s.device.startswith("cuda"):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        _step(model, opt, batch, mixed)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        out.update(measure="torch.cuda.max_memory_allocated", peak_bytes=peak, before_bytes=before)
        return out
    if not reset_peak_rss():
        out.update(measure="none: /proc/self/clear_refs is not writable", peak_bytes=None)
        return out
    before = proc_status_kib("VmRSS") * 1024
    _step(model, opt, batch, mixed)
    peak = proc_status_kib("VmHWM") * 1024
    out.update(measure="VmHWM (peak RSS) over the step", peak_bytes=peak, before_bytes=before)
    return out


# --------------------------------------------------------------------------- driver


def _run_worker(args: Sequence[str], env_extra: dict[str, str]) -> dict[str, Any]:
    env = {**os.environ, **env_extra}
    cmd = [sys.executable, "-m", WORKER_MODULE, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False, cwd=REPO_ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"worker {args} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    for line in reversed(proc.stdout.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"no JSON line in worker output:\n{proc.stdout[-2000:]}")


def _mib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:,.1f} MiB"


def _ok(flag: bool) -> str:
    return "yes" if flag else "**NO**"


def run_arm(arm: Arm, s: Settings) -> dict[str, Any]:
    env = {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    payload = ["--arm", json.dumps(asdict(arm)), "--settings", json.dumps(asdict(s))]
    t0 = time.perf_counter()
    timing = _run_worker(["--worker", "time", *payload], env)
    mem_env = {**env, "MALLOC_MMAP_THRESHOLD_": "65536"}
    memory = {
        m: _run_worker(["--worker", "memory", "--method", m, *payload], mem_env) for m in METHODS
    }
    elapsed = time.perf_counter() - t0
    peak_f, peak_l = memory["florg"].get("peak_bytes"), memory["lora"].get("peak_bytes")
    mem_ratio = peak_f / peak_l if peak_f and peak_l else None
    time_ratio = timing["ratio_median"]
    gc_text = ", gradient checkpointing" if arm.gradient_checkpointing else ""
    print(
        f"## {arm.name}: {arm.base}, {arm.precision}{gc_text}, batch {arm.batch} x "
        f"{arm.seq_len}, r = {s.rank}, alpha = {s.alpha:g}, {s.targets}, {s.device}, "
        f"{s.threads} thread(s)\n"
    )
    print("| method | trainable (adapter) | CPU median | wall median | model | step peak |")
    print("|---|---|---|---|---|---|")
    for label, m in (("FLoRG", "florg"), ("PEFT LoRA", "lora")):
        t, mm = timing[m], memory[m]
        print(
            f"| {label} | {t['trainable']:,} ({t['adapter']:,}) | {t['cpu_median_s']:.2f} s | "
            f"{t['wall_median_s']:.2f} s | {_mib(mm['model_bytes'])} | {_mib(mm['peak_bytes'])} |"
        )
    ratios = ", ".join(f"{x:.3f}" for x in timing["ratios"])
    print(
        f"\n{arm.name}: step time FLoRG / LoRA {time_ratio:.3f} ({timing['clock']} time, median "
        f"of the per-pair ratios {ratios}; wall {timing['wall_ratio_median']:.3f}) "
        f"(target <= 1.05: {_ok(time_ratio <= 1.05)})"
    )
    mem_text = "n/a" if mem_ratio is None else f"{mem_ratio:.4f}"
    print(
        f"{arm.name}: peak memory FLoRG / LoRA {mem_text} ({memory['florg']['measure']}) "
        f"(target <= 1.03: {_ok(mem_ratio is not None and mem_ratio <= 1.03)})"
    )
    print(f"({elapsed:.0f} s for this arm)\n", flush=True)
    return {
        "time_ratio": round(time_ratio, 4),
        "wall_time_ratio": round(timing["wall_ratio_median"], 4),
        "memory_ratio": None if mem_ratio is None else round(mem_ratio, 4),
        "florg_step_s": timing["florg"]["cpu_median_s"],
        "lora_step_s": timing["lora"]["cpu_median_s"],
        "florg_peak_bytes": peak_f,
        "lora_peak_bytes": peak_l,
        "memory_measure": memory["florg"]["measure"],
    }


def machine_lines(s: Settings) -> list[str]:
    import platform

    import peft
    import transformers

    from flower_app.environment import describe_environment, environment_label

    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    device = torch.cuda.get_device_name(0) if s.device.startswith("cuda") else "CPU"
    return [
        f"- device {device}; CPU {platform.processor() or platform.machine()}, os.cpu_count() "
        f"= {os.cpu_count()}, load average (1/5/15 min) at start {load}",
        # the CPU's model and the vector-instruction flags that decide PyTorch's CPU kernels
        # (bf16 products fall back to a reference kernel without avx512_bf16 or AMX)
        f"- machine: {environment_label(describe_environment())}",
        f"- python {platform.python_version()}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}, peft {peft.__version__}; {s.threads} torch thread(s)",
    ]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny decoder, 1 step (smoke test)")
    parser.add_argument(
        "--arms", default=",".join(ARMS), help=f"comma-separated arms (default: {','.join(ARMS)})"
    )
    parser.add_argument("--steps", type=int, help="measured step pairs per arm (default per arm)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto", help="default: auto"
    )
    parser.add_argument("--worker", choices=("time", "memory"), help=argparse.SUPPRESS)
    parser.add_argument("--method", choices=METHODS, help=argparse.SUPPRESS)
    parser.add_argument("--arm", help=argparse.SUPPRESS)
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        arm, s = Arm(**json.loads(args.arm)), Settings(**json.loads(args.settings))
        if args.worker == "time":
            result = time_worker(arm, s)
        else:
            result = memory_worker(args.method, arm, s)
        print(json.dumps(result), flush=True)
        return

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    s = Settings(threads=args.threads, device=device)
    if args.quick:
        arms = [QUICK_ARM]
    else:
        known = {**ARMS, **SHAPE_ARMS}
        unknown = [a for a in args.arms.split(",") if a not in known]
        if unknown:
            parser.error(f"unknown arm(s) {unknown}; arms: {', '.join(known)}")
        arms = [known[a] for a in args.arms.split(",")]
    if args.steps is not None:
        arms = [replace(a, steps=args.steps) for a in arms]
    print(f"# FLoRG decoder benchmark{' (quick)' if args.quick else ''}\n")
    print("\n".join(machine_lines(s)) + "\n", flush=True)
    t0 = time.perf_counter()
    results = {arm.name: run_arm(arm, s) for arm in arms}
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"Total {time.perf_counter() - t0:.0f} s; load average at the end {load}\n")
    print(json.dumps({"arms": results, "device": device, "quick": args.quick}), flush=True)


if __name__ == "__main__":
    main()
