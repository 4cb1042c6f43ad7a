"""Core benchmark: the FLoRG server step (thin vs reference) and a client training step
(FLoRG vs PEFT LoRA), measured side by side in one run.

    python benchmarks/core_benchmark.py            # full run (a few minutes on 2 CPU cores)
    python benchmarks/core_benchmark.py --quick    # smoke test for CI

The machine this runs on is shared, so every timing is taken as wall time *and* as the
CPU time of the benchmarking process (``time.process_time``: all its threads, user + sys).
Foreign load stretches the wall time of a step by whatever it takes away (measured here
with load average 5 on 2 cores: the same BERT step took 0.7 s to 10 s of wall time) but
hardly changes the CPU time the step needs, so the headline ratios use CPU time; wall-time
numbers and ratios are printed next to them.  For CPU time to mean work, idle OpenMP/BLAS
threads must sleep rather than spin: the workers run with ``OMP_WAIT_POLICY=PASSIVE``
(unless the caller sets it).

1. Server step, RoBERTa-large shaped: 48 adapted layers (24 x query, value), k = 1024,
   N = 20 clients, r = 4.  Every client starts from the same global A and returns it
   slightly perturbed (as after a few local steps), with unequal sample-count weights.
   The whole 48-layer step is timed with ``aggregate_florg`` (thin path) and
   ``aggregate_florg_reference`` (dense k x k eigh), interleaved, min over repetitions,
   in a subprocess whose BLAS thread count is fixed (``--blas-threads``, default 1).
2. Client step (forward + backward + AdamW step) of FLoRG vs PEFT LoRA on a randomly
   initialised BERT (hidden 384, 6 layers, 12 heads, FFN 1536, 3 labels), r = 4,
   alpha = 16, targets query and value, classifier head trainable, batch 8 x 128 random
   tokens, torch threads = os.cpu_count().  After warm-up, blocks of steps alternate
   between the two models (A B B A ...) so that load hits both equally; medians compared.
3. Memory of one training step, each method in its own fresh subprocess, after warm-up
   steps (so AdamW's state exists) and with the gradients freed beforehand:
   - primary: peak of the torch CPU allocator's live bytes allocated during the step
     (``torch.profiler`` with ``profile_memory=True``: every tensor allocation and free is
     an event carrying the running total; tracemalloc cannot see torch's allocations).
     This is the step's working memory: activations kept for backward, gradients,
     temporaries and optimizer scratch.
   - cross-check: peak RSS during the step above the RSS just before it (VmHWM reset
     through /proc/self/clear_refs; glibc's mmap threshold is pinned at 64 KiB so that
     freed tensors go back to the OS and RSS follows live memory).

The last printed line is one JSON object with the headline numbers.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

REPO_ROOT = Path(__file__).resolve().parents[1]
METHODS: tuple[str, ...] = ("florg", "lora")
Problem = tuple[list[np.ndarray], np.ndarray, np.ndarray]
Batch = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Settings:
    """Sizes and repetition counts of one benchmark run."""

    # server step
    layers: int = 48
    k: int = 1024
    clients: int = 20
    rank: int = 4
    client_rel_noise: float = 0.05
    thin_reps: int = 12
    ref_reps: int = 2
    ref_budget_s: float = 30.0  # no further reference pass once this much time is spent
    # BLAS threads of the server worker (both paths alike).  1 by default: on a shared
    # 2-core machine a multi-threaded OpenBLAS under foreign load spin-waits and becomes
    # erratic (measured here: reference 0.4 s/layer with 1 thread, 1.3-6 s with 2).
    blas_threads: int = 1
    # client step
    alpha: float = 16.0
    bert_layers: int = 6
    batch: int = 8
    seq_len: int = 128
    warmup: int = 2
    blocks: int = 10
    steps_per_block: int = 2
    mem_warmup: int = 1
    mem_reps: int = 2
    seed: int = 0


QUICK = Settings(
    layers=4,
    thin_reps=3,
    ref_reps=1,
    bert_layers=2,
    batch=2,
    seq_len=32,
    warmup=1,
    blocks=2,
    steps_per_block=1,
    mem_warmup=1,
    mem_reps=1,
)


def _ensure_repo_on_path() -> None:
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))


def _cpu_count() -> int:
    return os.cpu_count() or 1


def _last_json_line(text: str) -> dict[str, Any]:
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"no JSON line in worker output:\n{text[-2000:]}")


def _run_worker(args: Sequence[str], env_extra: dict[str, str]) -> dict[str, Any]:
    """Run this file as a worker in a fresh interpreter and return its JSON answer."""
    env = {**os.environ, **env_extra}
    cmd = [sys.executable, str(Path(__file__).resolve()), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"worker {args} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return _last_json_line(proc.stdout)


# --------------------------------------------------------------------------- server step


def server_problems(s: Settings) -> list[Problem]:
    """Per layer: (client A_n, client weights, previous global A), seeded."""
    rng = np.random.default_rng(s.seed)
    problems: list[Problem] = []
    for _ in range(s.layers):
        prev = rng.standard_normal((s.rank, s.k)) * 0.02
        clients = [
            prev + s.client_rel_noise * 0.02 * rng.standard_normal((s.rank, s.k))
            for _ in range(s.clients)
        ]
        weights = rng.integers(50, 500, size=s.clients).astype(np.float64)  # samples / client
        problems.append((clients, weights, prev))
    return problems


def _timed_pass(fn: Callable[..., Any], problems: list[Problem]) -> tuple[float, float, list[Any]]:
    """(wall s, process CPU s, outputs) of one call of ``fn`` per layer."""
    gc.collect()
    gc.disable()
    try:
        wall, cpu = time.perf_counter(), time.process_time()
        out = [fn(As, w, prev) for As, w, prev in problems]
        return time.perf_counter() - wall, time.process_time() - cpu, out
    finally:
        gc.enable()


def server_worker(s: Settings) -> dict[str, Any]:
    """Thin vs reference FLoRG server step over all layers, interleaved passes."""
    _ensure_repo_on_path()
    from strategies.florg import aggregate_florg, aggregate_florg_reference

    problems = server_problems(s)
    aggregate_florg(*problems[0])  # warm-up (imports, BLAS thread pool)
    aggregate_florg_reference(*problems[0])

    times: dict[str, list[tuple[float, float]]] = {"thin": [], "ref": []}
    outputs: dict[str, list[Any]] = {}
    paths = {"thin": aggregate_florg, "ref": aggregate_florg_reference}
    ref_reps = s.ref_reps
    per_block = max(1, s.thin_reps // max(1, ref_reps))
    while len(times["thin"]) < s.thin_reps or len(times["ref"]) < ref_reps:
        todo = [("thin", min(per_block, s.thin_reps - len(times["thin"])))]
        todo.append(("ref", 1 if len(times["ref"]) < ref_reps else 0))
        for path, n in todo:
            for _ in range(n):
                wall, cpu, out = _timed_pass(paths[path], problems)
                times[path].append((wall, cpu))
                outputs.setdefault(path, out)
        if sum(w for w, _ in times["ref"]) > s.ref_budget_s:
            ref_reps = len(times["ref"])
    thin_out, ref_out = outputs["thin"], outputs["ref"]

    rel_diffs = [
        float(np.linalg.norm(a_thin - a_ref) / np.linalg.norm(a_ref))
        for (a_thin, _), (a_ref, _) in zip(thin_out, ref_out, strict=True)
    ]
    infos = [(i_thin, i_ref) for (_, i_thin), (_, i_ref) in zip(thin_out, ref_out, strict=True)]
    ranks_agree = all(i_thin["rank"] == i_ref["rank"] for i_thin, i_ref in infos)
    gram_err_diff = max(abs(a["gram_rel_error"] - b["gram_rel_error"]) for a, b in infos)
    return {
        "thin_wall_s": min(w for w, _ in times["thin"]),
        "thin_cpu_s": min(c for _, c in times["thin"]),
        "thin_reps": len(times["thin"]),
        "ref_wall_s": min(w for w, _ in times["ref"]),
        "ref_cpu_s": min(c for _, c in times["ref"]),
        "ref_reps": len(times["ref"]),
        "max_rel_diff": max(rel_diffs),
        "ranks_agree": ranks_agree,
        "rank": int(thin_out[0][1]["rank"]),
        "gram_rel_error": float(thin_out[0][1]["gram_rel_error"]),
        "gram_err_max_abs_diff": float(gram_err_diff),
    }


# --------------------------------------------------------------------------- client step


def build_bert(s: Settings) -> nn.Module:
    """Randomly initialised BERT classifier (same weights for every call with the same seed)."""
    import transformers
    from transformers import BertConfig, BertForSequenceClassification

    transformers.logging.set_verbosity_error()
    torch.manual_seed(s.seed)
    config = BertConfig(
        hidden_size=384,
        num_hidden_layers=s.bert_layers,
        num_attention_heads=12,
        intermediate_size=1536,
        num_labels=3,
    )
    return BertForSequenceClassification(config)


def build_method(method: str, s: Settings) -> tuple[nn.Module, torch.optim.Optimizer]:
    """(model, AdamW over its trainable parameters) for 'florg' or 'lora'."""
    _ensure_repo_on_path()
    from flower_app.adapters.florg_model import FLoRGConfig, inject_florg
    from flower_app.adapters.lora import LoRAConfig, inject_lora

    model = build_bert(s)
    targets = ("query", "value")
    if method == "florg":
        inject_florg(model, FLoRGConfig(r=s.rank, alpha=s.alpha, target_modules=targets))
    elif method == "lora":
        with warnings.catch_warnings():  # peft touches transformers' deprecated attribute
            warnings.filterwarnings("ignore", ".*is_gradient_checkpointing", FutureWarning)
            model = inject_lora(model, LoRAConfig(r=s.rank, alpha=s.alpha, target_modules=targets))
    else:
        raise ValueError(f"unknown method {method!r}")
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(params, lr=1e-3)


def make_batch(s: Settings, vocab_size: int = 30522) -> Batch:
    g = torch.Generator().manual_seed(s.seed + 1)
    return {
        "input_ids": torch.randint(0, vocab_size, (s.batch, s.seq_len), generator=g),
        "attention_mask": torch.ones(s.batch, s.seq_len, dtype=torch.long),
        "labels": torch.randint(0, 3, (s.batch,), generator=g),
    }


def train_step(model: nn.Module, opt: torch.optim.Optimizer, batch: Batch) -> None:
    opt.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    opt.step()


def param_counts(model: nn.Module) -> dict[str, int]:
    """Trainable parameters (adapter vs the rest, i.e. the head) and bytes held by the model."""
    adapter = head = 0
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if "lora_" in name or name.endswith(".A"):
            adapter += p.numel()
        else:
            head += p.numel()
    held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    return {"trainable": adapter + head, "adapter": adapter, "head": head, "model_bytes": held}


def client_worker(s: Settings) -> dict[str, Any]:
    """Interleaved step timing of both methods (wall and process CPU time per step)."""
    torch.set_num_threads(_cpu_count())
    models = {m: build_method(m, s) for m in METHODS}
    batch = make_batch(s)
    for model, opt in models.values():
        for _ in range(s.warmup):
            train_step(model, opt, batch)
    wall: dict[str, list[float]] = {m: [] for m in METHODS}
    cpu: dict[str, list[float]] = {m: [] for m in METHODS}
    gc.collect()
    for block in range(s.blocks):
        for method in METHODS if block % 2 == 0 else METHODS[::-1]:
            model, opt = models[method]
            for _ in range(s.steps_per_block):
                w0, c0 = time.perf_counter(), time.process_time()
                train_step(model, opt, batch)
                wall[method].append(time.perf_counter() - w0)
                cpu[method].append(time.process_time() - c0)
    return {
        method: {
            "wall_median_s": statistics.median(wall[method]),
            "wall_min_s": min(wall[method]),
            "cpu_median_s": statistics.median(cpu[method]),
            "cpu_min_s": min(cpu[method]),
            "steps": len(wall[method]),
            "threads": torch.get_num_threads(),
            **param_counts(models[method][0]),
        }
        for method in METHODS
    }


def _proc_status_kib(key: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _allocator_peak(model: nn.Module, opt: torch.optim.Optimizer, batch: Batch) -> tuple[int, int]:
    """(peak, end) of the torch CPU allocator's bytes allocated during one step (profiler)."""
    from torch.profiler import ProfilerActivity, profile

    opt.zero_grad(set_to_none=True)
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        train_step(model, opt, batch)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    totals = [
        (e["ts"], int(e["args"]["Total Allocated"]))
        for e in events
        if e.get("name") == "[memory]" and e["args"].get("Device Type", 0) == 0
    ]
    if not totals:
        return 0, 0
    totals.sort()
    return max(t for _, t in totals), totals[-1][1]


def memory_worker(method: str, s: Settings) -> dict[str, Any]:
    """Memory of one steady-state training step of ``method`` (run in a fresh process)."""
    torch.set_num_threads(_cpu_count())
    model, opt = build_method(method, s)
    batch = make_batch(s)
    gc.collect()
    rss_model_kib = _proc_status_kib("VmRSS")
    for _ in range(s.mem_warmup):
        train_step(model, opt, batch)
    rss_deltas: list[int] = []
    if _reset_peak_rss():
        for _ in range(s.mem_reps):
            opt.zero_grad(set_to_none=True)
            gc.collect()
            _reset_peak_rss()
            before = _proc_status_kib("VmRSS")
            train_step(model, opt, batch)
            rss_deltas.append((_proc_status_kib("VmHWM") - before) * 1024)
    peak, end = _allocator_peak(model, opt, batch)
    return {
        "alloc_peak_bytes": peak,
        "alloc_end_bytes": end,
        "rss_step_peak_bytes": statistics.median(rss_deltas) if rss_deltas else None,
        "rss_after_build_bytes": rss_model_kib * 1024,
    }


# --------------------------------------------------------------------------- report


def _mib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f} MiB"


def _ms(t: float) -> str:
    return f"{t * 1e3:.1f} ms"


def machine_info(s: Settings, env: dict[str, str]) -> list[str]:
    import peft
    import transformers

    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return [
        f"- CPU: {platform.processor() or platform.machine()}, os.cpu_count() = {_cpu_count()}, "
        f"load average (1/5/15 min) at start {load}",
        f"- python {platform.python_version()}, torch {torch.__version__}, numpy "
        f"{np.__version__}, transformers {transformers.__version__}, peft {peft.__version__}",
        f"- torch threads {_cpu_count()} (client step), BLAS threads {s.blas_threads} "
        f"(server step), OMP_WAIT_POLICY={env['OMP_WAIT_POLICY']} in the workers",
    ]


def _ok(flag: bool) -> str:
    return "yes" if flag else "**NO**"


def print_server(s: Settings, server: dict[str, Any]) -> tuple[float, float]:
    speedup = server["ref_cpu_s"] / server["thin_cpu_s"]
    speedup_wall = server["ref_wall_s"] / server["thin_wall_s"]
    print(f"## Server step: {s.layers} layers, k = {s.k}, N = {s.clients} clients, r = {s.rank}\n")
    print("| path | CPU time, all layers | per layer | wall time, all layers | reps |")
    print("|---|---|---|---|---|")
    for name, key in (("reference (k x k eigh)", "ref"), ("thin (eigh of Nr x Nr)", "thin")):
        print(
            f"| {name} | {_ms(server[key + '_cpu_s'])} | {_ms(server[key + '_cpu_s'] / s.layers)} "
            f"| {_ms(server[key + '_wall_s'])} | {server[key + '_reps']} |"
        )
    diff = server["max_rel_diff"]
    print(
        f"\n(min over repetitions.)  Speedup {speedup:.0f}x in CPU time, {speedup_wall:.0f}x in "
        f"wall time (target >= 100x: {_ok(speedup >= 100)}); "
        f"max over layers of ||A_thin - A_ref||_F / ||A_ref||_F = {diff:.2e} "
        f"(target <= 1e-10: {_ok(diff <= 1e-10)}); numerical rank r' = {server['rank']} "
        f"(same in both paths: {server['ranks_agree']}), gram_rel_error "
        f"{server['gram_rel_error']:.2e}\n"
    )
    return speedup, speedup_wall


def run(s: Settings, quick: bool) -> dict[str, Any]:
    torch.set_num_threads(_cpu_count())
    env = {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    print(f"# FLoRG core benchmark{' (quick)' if quick else ''}\n")
    print("\n".join(machine_info(s, env)) + "\n", flush=True)

    t0 = time.perf_counter()
    settings = ["--settings", json.dumps(asdict(s))]
    blas = {k: str(s.blas_threads) for k in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    server = _run_worker(["--worker", "server", *settings], {**env, **blas})
    speedup, speedup_wall = print_server(s, server)

    client = _run_worker(["--worker", "client", *settings], env)
    mem_env = {**env, "MALLOC_MMAP_THRESHOLD_": "65536"}
    memory = {
        m: _run_worker(["--worker", "memory", "--method", m, *settings], mem_env) for m in METHODS
    }
    elapsed = time.perf_counter() - t0

    f, lo = client["florg"], client["lora"]
    step_ratio = f["cpu_median_s"] / lo["cpu_median_s"]
    wall_ratio = f["wall_median_s"] / lo["wall_median_s"]
    wall_min_ratio = f["wall_min_s"] / lo["wall_min_s"]
    mem_ratio = memory["florg"]["alloc_peak_bytes"] / memory["lora"]["alloc_peak_bytes"]
    rss_f, rss_l = memory["florg"]["rss_step_peak_bytes"], memory["lora"]["rss_step_peak_bytes"]
    rss_ratio = rss_f / rss_l if rss_f and rss_l else None
    total = {m: memory[m]["alloc_peak_bytes"] + client[m]["model_bytes"] for m in METHODS}
    total_ratio = total["florg"] / total["lora"]

    print(
        f"## Client step: BERT {s.bert_layers} x 384 (random weights), batch {s.batch} x "
        f"{s.seq_len}, r = {s.rank}, alpha = {s.alpha:g}, targets query+value, head trainable\n"
    )
    print(
        "Step = forward + backward + AdamW step, timed in interleaved blocks "
        f"({s.blocks} x {s.steps_per_block} steps per method, after {s.warmup} warm-up steps); "
        "'CPU' is the process CPU time of a step (all threads), robust to foreign load.  "
        "Memory: each method in a fresh subprocess; 'step peak (allocator)' is the peak of "
        "torch CPU allocator bytes allocated during one steady-state step (torch.profiler, "
        "profile_memory=True), 'step peak (RSS)' the peak RSS during the step above the RSS "
        "before it (VmHWM reset via /proc/self/clear_refs, glibc mmap threshold 64 KiB); "
        "'model' is the bytes of all parameters and buffers.\n"
    )
    print(
        "| method | trainable params (adapter + head) | CPU median | wall median | wall min "
        "| step peak (allocator) | step peak (RSS) | model | model + step peak |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, key in (("FLoRG", "florg"), ("PEFT LoRA", "lora")):
        c, m = client[key], memory[key]
        print(
            f"| {name} | {c['trainable']:,} ({c['adapter']:,} + {c['head']:,}) | "
            f"{_ms(c['cpu_median_s'])} | {_ms(c['wall_median_s'])} | {_ms(c['wall_min_s'])} | "
            f"{_mib(m['alloc_peak_bytes'])} | {_mib(m['rss_step_peak_bytes'])} | "
            f"{_mib(c['model_bytes'])} | {_mib(total[key])} |"
        )
    rss_txt = "n/a" if rss_ratio is None else f"{rss_ratio:.3f}"
    print(
        f"\nStep time FLoRG / LoRA: {step_ratio:.3f} in CPU time (target <= 1.10: "
        f"{_ok(step_ratio <= 1.10)}); wall time {wall_ratio:.3f} (medians), "
        f"{wall_min_ratio:.3f} (minima).  Step memory FLoRG / LoRA: {mem_ratio:.3f} allocator "
        f"peak (target <= 1.10: {_ok(mem_ratio <= 1.10)}), {rss_txt} RSS peak; "
        f"model + step peak {total_ratio:.3f}\n"
    )
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"Total benchmark time {elapsed:.0f} s; load average at the end {load}\n", flush=True)

    return {
        "server_speedup": round(speedup, 2),
        "server_max_rel_diff": server["max_rel_diff"],
        "client_step_ratio": round(step_ratio, 4),
        "client_memory_ratio": round(mem_ratio, 4),
        "server_speedup_wall": round(speedup_wall, 2),
        "server_thin_cpu_s": server["thin_cpu_s"],
        "server_reference_cpu_s": server["ref_cpu_s"],
        "server_thin_wall_s": server["thin_wall_s"],
        "server_reference_wall_s": server["ref_wall_s"],
        "client_step_florg_cpu_s": f["cpu_median_s"],
        "client_step_lora_cpu_s": lo["cpu_median_s"],
        "client_step_florg_wall_s": f["wall_median_s"],
        "client_step_lora_wall_s": lo["wall_median_s"],
        "client_step_wall_ratio": round(wall_ratio, 4),
        "client_step_wall_min_ratio": round(wall_min_ratio, 4),
        "client_step_peak_florg_bytes": memory["florg"]["alloc_peak_bytes"],
        "client_step_peak_lora_bytes": memory["lora"]["alloc_peak_bytes"],
        "client_rss_ratio": None if rss_ratio is None else round(rss_ratio, 4),
        "client_model_plus_step_memory_ratio": round(total_ratio, 4),
        "trainable_florg": f["trainable"],
        "trainable_lora": lo["trainable"],
        "quick": quick,
        "cpu_count": _cpu_count(),
        "elapsed_s": round(elapsed, 1),
    }


WORKERS: dict[str, Callable[[Settings, str | None], dict[str, Any]]] = {
    "server": lambda s, _: server_worker(s),
    "client": lambda s, _: client_worker(s),
    "memory": lambda s, method: memory_worker(str(method), s),
}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    parser.add_argument(
        "--blas-threads", type=int, default=1, help="BLAS threads of the server step (default 1)"
    )
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--method", choices=METHODS, help=argparse.SUPPRESS)
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        s = Settings(**json.loads(args.settings))
        print(json.dumps(WORKERS[args.worker](s, args.method)), flush=True)
        return
    s = replace(QUICK if args.quick else Settings(), blas_threads=args.blas_threads)
    print(json.dumps(run(s, args.quick)), flush=True)


if __name__ == "__main__":
    main()
