"""Core benchmark: the FLoRG server step (dense reference, numpy loop, batched torch on CPU
and, where present, on a GPU) and a client training step (FLoRG vs PEFT LoRA) at MiniLM size
and at the RoBERTa-large shape, measured side by side in one run.

    python benchmarks/core_benchmark.py            # full run (about 10 minutes on 2 CPU cores)
    python benchmarks/core_benchmark.py --quick    # smoke test for CI

The machine this runs on is shared, so every timing is taken as wall time *and* as the
CPU time of the benchmarking process (``time.process_time``: all its threads, user + sys).
Foreign load stretches the wall time of a step by whatever it takes away (measured here
with load average 5 on 2 cores: the same BERT step took 0.7 s to 10 s of wall time) but
hardly changes the CPU time the step needs, so the headline ratios use CPU time; wall-time
numbers and ratios are printed next to them.  For CPU time to mean work, idle OpenMP/BLAS
threads must sleep rather than spin: the workers run with ``OMP_WAIT_POLICY=PASSIVE``
(unless the caller sets it).

1. Server step at two shapes, N = 20 clients, each starting from the same global A and
   returning it slightly perturbed (as after a few local steps), unequal sample-count
   weights: RoBERTa-large (48 adapted layers = 24 x query, value, k = 1024, r = 4) and a
   7B decoder's q, v (64 layers, k = 4096, r = 8).  Paths: the dense reference
   (``aggregate_florg_reference``, k x k ``eigh``; skipped at the 7B shape, where one pass
   would take about half an hour), today's numpy loop (``aggregate_florg`` per layer) and
   the batched torch path on the CPU (``aggregate_florg_layers(device='cpu')``), passes
   interleaved, min over repetitions, one BLAS / torch thread (``--blas-threads``); then
   the torch path on CUDA when a GPU is present (wall ms, synchronised; skipped otherwise,
   with the reason printed).
2. Client step (forward + backward + AdamW step) of FLoRG vs PEFT LoRA, r = 4, alpha = 16,
   targets query and value, classifier head trainable, random tokens, one torch thread:
   a randomly initialised BERT (hidden 384, 6 layers, 12 heads, FFN 1536; MiniLM's shape),
   batch 8 x 128, and a randomly initialised RoBERTa-large-shaped classifier (24 layers,
   hidden 1024, 16 heads, FFN 4096), batch 4 x 128.  Step time: both models in one
   process, blocks of steps alternating between them (A B, B A, ...); each adjacent pair
   of blocks gives one ratio (FLoRG CPU time / LoRA CPU time) and the headline is the
   median of those per-pair ratios, so load that comes and goes hits both sides of a ratio.
3. Memory of one training step, each method in its own fresh subprocess, after warm-up
   steps (so AdamW's state exists) and with the gradients freed beforehand:
   - model: bytes of all parameters and buffers (shared tensors counted once).
   - peak RSS of the step: VmHWM after the step, the high-water mark having been reset
     through /proc/self/clear_refs just before it (glibc's mmap threshold pinned at 64 KiB
     so that freed tensors go back to the OS and RSS follows live memory); also that peak
     above the RSS just before the step.
   - MiniLM size only: peak of the torch CPU allocator's live bytes allocated during the
     step (``torch.profiler`` with ``profile_memory=True``), the step's working memory.

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
Batch = dict[str, torch.Tensor]


@dataclass(frozen=True)
class ServerShape:
    """One server-step problem: ``layers`` adapted layers of k columns, N clients, rank r."""

    name: str
    layers: int
    k: int
    clients: int
    rank: int
    dense_reference: bool  # the k x k eigh path is timed only where it takes seconds


SERVER_SHAPES: tuple[ServerShape, ...] = (
    ServerShape("roberta-large", 48, 1024, 20, 4, True),
    ServerShape("7b", 64, 4096, 20, 8, False),
)
QUICK_SERVER_SHAPES: tuple[ServerShape, ...] = (
    ServerShape("roberta-large", 4, 64, 5, 4, True),
    ServerShape("7b", 4, 96, 5, 8, False),
)


@dataclass(frozen=True)
class ModelShape:
    """A randomly initialised encoder classifier for the client step."""

    name: str
    family: str  # 'bert' or 'roberta'
    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    batch: int
    seq_len: int


MINILM = ModelShape("minilm", "bert", 6, 384, 12, 1536, 30522, 8, 128)
ROBERTA_LARGE = ModelShape("roberta-large", "roberta", 24, 1024, 16, 4096, 50265, 4, 128)
QUICK_MINILM = ModelShape("minilm", "bert", 2, 64, 4, 128, 1000, 2, 32)
QUICK_LARGE = ModelShape("roberta-large", "roberta", 2, 128, 4, 256, 1000, 2, 32)


@dataclass(frozen=True)
class Settings:
    """Sizes and repetition counts of one benchmark run."""

    # server step
    server_shapes: tuple[ServerShape, ...] = SERVER_SHAPES
    client_rel_noise: float = 0.05
    server_reps: int = 6  # passes of the numpy loop and of the torch path, each
    ref_reps: int = 2
    ref_budget_s: float = 40.0  # no further reference pass once this much time is spent
    gpu_reps: int = 20
    # BLAS threads of the server worker (both paths alike).  1 by default: on a shared
    # 2-core machine a multi-threaded OpenBLAS under foreign load spin-waits and becomes
    # erratic (measured here: reference 0.4 s/layer with 1 thread, 1.3-6 s with 2).
    blas_threads: int = 1
    # client step
    rank: int = 4
    alpha: float = 16.0
    small: ModelShape = MINILM
    large: ModelShape = ROBERTA_LARGE
    client_threads: int = 1
    warmup: int = 2
    rounds: int = 12  # pairs of blocks (one block per method) of the small model
    steps_per_block: int = 3
    large_warmup: int = 1
    large_rounds: int = 5
    large_steps_per_block: int = 2
    mem_warmup: int = 1
    mem_reps: int = 2
    large_mem_reps: int = 1
    seed: int = 0


QUICK = Settings(
    server_shapes=QUICK_SERVER_SHAPES,
    server_reps=2,
    ref_reps=1,
    gpu_reps=2,
    small=QUICK_MINILM,
    large=QUICK_LARGE,
    warmup=1,
    rounds=2,
    steps_per_block=1,
    large_rounds=2,
    large_steps_per_block=1,
    mem_reps=1,
)


def settings_from_json(text: str) -> Settings:
    raw = json.loads(text)
    raw["server_shapes"] = tuple(ServerShape(**x) for x in raw["server_shapes"])
    raw["small"], raw["large"] = ModelShape(**raw["small"]), ModelShape(**raw["large"])
    return Settings(**raw)


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


def server_problems(
    shape: ServerShape, s: Settings
) -> tuple[dict[str, list[np.ndarray]], np.ndarray, dict[str, np.ndarray]]:
    """(layer -> clients' A_n, client weights, layer -> previous global A), seeded."""
    rng = np.random.default_rng(s.seed)
    client_As: dict[str, list[np.ndarray]] = {}
    prev_As: dict[str, np.ndarray] = {}
    weights = rng.integers(50, 500, size=shape.clients).astype(np.float64)  # samples / client
    for i in range(shape.layers):
        name = f"layer{i // 2}.{'query' if i % 2 == 0 else 'value'}"
        prev = rng.standard_normal((shape.rank, shape.k)) * 0.02
        client_As[name] = [
            prev + s.client_rel_noise * 0.02 * rng.standard_normal((shape.rank, shape.k))
            for _ in range(shape.clients)
        ]
        prev_As[name] = prev
    return client_As, weights, prev_As


def _timed(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """(wall s, process CPU s, output) of one call."""
    gc.collect()
    gc.disable()
    try:
        wall, cpu = time.perf_counter(), time.process_time()
        out = fn()
        return time.perf_counter() - wall, time.process_time() - cpu, out
    finally:
        gc.enable()


def _compare(
    out: dict[str, tuple[np.ndarray, dict[str, Any]]],
    ref: dict[str, tuple[np.ndarray, dict[str, Any]]],
) -> dict[str, Any]:
    """Max over layers of the relative difference of A and the abs. difference of diagnostics."""
    rel = [float(np.linalg.norm(out[n][0] - ref[n][0]) / np.linalg.norm(ref[n][0])) for n in ref]
    diag = [
        abs(float(out[n][1][key]) - float(ref[n][1][key]))
        for n in ref
        for key in ("gram_rel_error", "drift", "eigengap")
    ]
    return {
        "max_rel_diff": max(rel),
        "max_diag_diff": max(diag),
        "ranks_agree": all(out[n][1]["rank"] == ref[n][1]["rank"] for n in ref),
    }


def server_worker(s: Settings, shape_name: str) -> dict[str, Any]:
    """Dense reference, numpy loop and batched torch (CPU) for one shape, interleaved."""
    _ensure_repo_on_path()
    from strategies.florg import aggregate_florg, aggregate_florg_reference
    from strategies.florg_torch import aggregate_florg_layers

    torch.set_num_threads(s.blas_threads)
    shape = next(x for x in s.server_shapes if x.name == shape_name)
    client_As, w, prev_As = server_problems(shape, s)

    def numpy_loop() -> dict[str, tuple[np.ndarray, dict[str, Any]]]:
        return {n: aggregate_florg(client_As[n], w, prev_As[n]) for n in prev_As}

    def reference() -> dict[str, tuple[np.ndarray, dict[str, Any]]]:
        return {n: aggregate_florg_reference(client_As[n], w, prev_As[n]) for n in prev_As}

    def batched() -> dict[str, tuple[np.ndarray, dict[str, Any]]]:
        new, info = aggregate_florg_layers(client_As, w, prev_As, device="cpu")
        return {n: (new[n], info[n]) for n in prev_As}

    paths = {"numpy": numpy_loop, "torch": batched}
    for fn in paths.values():  # warm-up: imports, BLAS thread pools, the stacking buffer
        fn()
    times: dict[str, list[tuple[float, float]]] = {"numpy": [], "torch": [], "ref": []}
    outputs: dict[str, Any] = {}
    for rep in range(s.server_reps):
        for name in ("numpy", "torch") if rep % 2 == 0 else ("torch", "numpy"):
            wall, cpu, out = _timed(paths[name])
            times[name].append((wall, cpu))
            outputs.setdefault(name, out)
    if shape.dense_reference:
        for _ in range(s.ref_reps):
            wall, cpu, out = _timed(reference)
            times["ref"].append((wall, cpu))
            outputs.setdefault("ref", out)
            if sum(t for t, _ in times["ref"]) > s.ref_budget_s:
                break
    result: dict[str, Any] = {"shape": asdict(shape), "torch_threads": torch.get_num_threads()}
    for name, ts in times.items():
        if ts:
            result[f"{name}_wall_s"] = min(t for t, _ in ts)
            result[f"{name}_cpu_s"] = min(c for _, c in ts)
            result[f"{name}_reps"] = len(ts)
    result["torch_vs_numpy"] = _compare(outputs["torch"], outputs["numpy"])
    if "ref" in outputs:
        result["numpy_vs_ref"] = _compare(outputs["numpy"], outputs["ref"])
    first = next(iter(prev_As))
    result["rank"] = int(outputs["numpy"][first][1]["rank"])
    result["gram_rel_error"] = float(outputs["numpy"][first][1]["gram_rel_error"])
    return result


def gpu_worker(s: Settings) -> dict[str, Any]:
    """The batched torch step on CUDA (wall ms, inputs from host numpy to host numpy)."""
    if not torch.cuda.is_available():
        return {"available": False, "reason": "CUDA not available"}
    _ensure_repo_on_path()
    from strategies.florg import aggregate_florg
    from strategies.florg_torch import aggregate_florg_layers

    out: dict[str, Any] = {"available": True, "device": torch.cuda.get_device_name(0)}
    for shape in s.server_shapes:
        client_As, w, prev_As = server_problems(shape, s)
        # As they arrive from the clients: float32 (ArrayRecord carries float32).
        wire = {n: [a.astype(np.float32) for a in As] for n, As in client_As.items()}
        for _ in range(2):
            aggregate_florg_layers(wire, w, prev_As, device="cuda")
        ms = []
        for _ in range(s.gpu_reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            new, _ = aggregate_florg_layers(wire, w, prev_As, device="cuda")
            torch.cuda.synchronize()
            ms.append((time.perf_counter() - t0) * 1e3)
        as64 = {n: [a.astype(np.float64) for a in As] for n, As in wire.items()}
        rel = max(
            float(np.linalg.norm(new[n] - ref) / np.linalg.norm(ref))
            for n in prev_As
            for ref in [aggregate_florg(as64[n], w, prev_As[n])[0]]
        )
        out[shape.name] = {"ms_min": min(ms), "ms_median": statistics.median(ms), "rel": rel}
    return out


# --------------------------------------------------------------------------- client step


def build_model(shape: ModelShape, seed: int) -> nn.Module:
    """Randomly initialised encoder classifier (same weights for every call with one seed)."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    common = {
        "hidden_size": shape.hidden,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "intermediate_size": shape.ffn,
        "vocab_size": shape.vocab,
        "num_labels": 3,
    }
    if shape.family == "bert":
        return transformers.BertForSequenceClassification(transformers.BertConfig(**common))
    config = transformers.RobertaConfig(**common, max_position_embeddings=shape.seq_len + 2)
    return transformers.RobertaForSequenceClassification(config)


def build_method(
    method: str, shape: ModelShape, s: Settings
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """(model, AdamW over its trainable parameters) for 'florg' or 'lora'."""
    _ensure_repo_on_path()
    from flower_app.adapters.florg_model import FLoRGConfig, inject_florg
    from flower_app.adapters.lora import LoRAConfig, inject_lora

    model = build_model(shape, s.seed)
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


def make_batch(shape: ModelShape, seed: int) -> Batch:
    g = torch.Generator().manual_seed(seed + 1)
    return {
        "input_ids": torch.randint(3, shape.vocab, (shape.batch, shape.seq_len), generator=g),
        "attention_mask": torch.ones(shape.batch, shape.seq_len, dtype=torch.long),
        "labels": torch.randint(0, 3, (shape.batch,), generator=g),
    }


def train_step(model: nn.Module, opt: torch.optim.Optimizer, batch: Batch) -> None:
    opt.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    opt.step()


def param_counts(model: nn.Module) -> dict[str, int]:
    """Trainable parameters (adapter vs the rest, i.e. the head) and bytes held by the model
    (parameters and buffers; a tensor shared by several modules counted once)."""
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


def per_pair_ratios(florg: list[float], lora: list[float], per_block: int) -> list[float]:
    """FLoRG / LoRA time of each adjacent pair of blocks (sums over the block's steps)."""
    n = min(len(florg), len(lora)) // per_block
    return [
        sum(florg[i * per_block : (i + 1) * per_block])
        / sum(lora[i * per_block : (i + 1) * per_block])
        for i in range(n)
    ]


def client_worker(s: Settings, which: str) -> dict[str, Any]:
    """Interleaved step timing of both methods on the small or large model."""
    large = which == "large"
    shape = s.large if large else s.small
    warmup = s.large_warmup if large else s.warmup
    rounds = s.large_rounds if large else s.rounds
    per_block = s.large_steps_per_block if large else s.steps_per_block
    torch.set_num_threads(s.client_threads)
    models = {m: build_method(m, shape, s) for m in METHODS}
    batch = make_batch(shape, s.seed)
    for model, opt in models.values():
        for _ in range(warmup):
            train_step(model, opt, batch)
    wall: dict[str, list[float]] = {m: [] for m in METHODS}
    cpu: dict[str, list[float]] = {m: [] for m in METHODS}
    gc.collect()
    for pair in range(rounds):
        for method in METHODS if pair % 2 == 0 else METHODS[::-1]:
            model, opt = models[method]
            for _ in range(per_block):
                w0, c0 = time.perf_counter(), time.process_time()
                train_step(model, opt, batch)
                wall[method].append(time.perf_counter() - w0)
                cpu[method].append(time.process_time() - c0)
    cpu_ratios = per_pair_ratios(cpu["florg"], cpu["lora"], per_block)
    wall_ratios = per_pair_ratios(wall["florg"], wall["lora"], per_block)
    return {
        "cpu_ratio_median": statistics.median(cpu_ratios),
        "wall_ratio_median": statistics.median(wall_ratios),
        "cpu_ratios": cpu_ratios,
        **{
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
        },
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


def memory_worker(method: str, which: str, s: Settings) -> dict[str, Any]:
    """Memory of one steady-state training step of ``method`` (run in a fresh process)."""
    large = which == "large"
    shape = s.large if large else s.small
    torch.set_num_threads(s.client_threads)
    model, opt = build_method(method, shape, s)
    batch = make_batch(shape, s.seed)
    gc.collect()
    rss_model_kib = _proc_status_kib("VmRSS")
    for _ in range(s.mem_warmup):
        train_step(model, opt, batch)
    rss_deltas: list[int] = []
    rss_peaks: list[int] = []
    if _reset_peak_rss():
        for _ in range(s.large_mem_reps if large else s.mem_reps):
            opt.zero_grad(set_to_none=True)
            gc.collect()
            _reset_peak_rss()
            before = _proc_status_kib("VmRSS")
            train_step(model, opt, batch)
            peak = _proc_status_kib("VmHWM")
            rss_deltas.append((peak - before) * 1024)
            rss_peaks.append(peak * 1024)
    peak, end = (None, None) if large else _allocator_peak(model, opt, batch)
    out: dict[str, Any] = {
        "alloc_peak_bytes": peak,
        "alloc_end_bytes": end,
        "rss_step_peak_bytes": statistics.median(rss_deltas) if rss_deltas else None,
        "rss_step_hwm_bytes": statistics.median(rss_peaks) if rss_peaks else None,
        "rss_after_build_bytes": rss_model_kib * 1024,
        **param_counts(model),
    }
    if method == "florg":
        # What the per-module derivation (projection-sharing=module) would hold on top:
        # one L, R pair per module instead of one per shape.
        from flower_app.adapters.florg_model import florg_layers

        layers = list(florg_layers(model).values())
        pair = [(x.L.numel() + x.R.numel()) * x.L.element_size() for x in layers]
        unique = {id(x.projections): p for x, p in zip(layers, pair, strict=True)}
        out["module_sharing_extra_bytes"] = sum(pair) - sum(unique.values())
    return out


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
        f"- torch threads {s.client_threads} (client steps), BLAS and torch threads "
        f"{s.blas_threads} (server step), OMP_WAIT_POLICY={env['OMP_WAIT_POLICY']} in the workers",
    ]


def _ok(flag: bool) -> str:
    return "yes" if flag else "**NO**"


def print_server(servers: dict[str, dict[str, Any]], gpu: dict[str, Any]) -> dict[str, Any]:
    """The server tables; returns the headline numbers."""
    heads: dict[str, Any] = {}
    for name, res in servers.items():
        sh = res["shape"]
        print(
            f"## Server step, {name}: {sh['layers']} layers, k = {sh['k']}, "
            f"N = {sh['clients']} clients, r = {sh['rank']}\n"
        )
        print("| path | CPU time, all layers | per layer | wall time, all layers | reps |")
        print("|---|---|---|---|---|")
        rows = [
            ("dense reference (k x k eigh per layer)", "ref"),
            ("numpy loop (`aggregate_florg` per layer)", "numpy"),
            ("torch batched, CPU (`aggregate_florg_layers`)", "torch"),
        ]
        for label, key in rows:
            if f"{key}_cpu_s" not in res:
                print(f"| {label} | skipped: one pass would take about half an hour | | | |")
                continue
            print(
                f"| {label} | {_ms(res[key + '_cpu_s'])} | "
                f"{_ms(res[key + '_cpu_s'] / sh['layers'])} | {_ms(res[key + '_wall_s'])} | "
                f"{res[key + '_reps']} |"
            )
        speed = res["numpy_cpu_s"] / res["torch_cpu_s"]
        cmp_t = res["torch_vs_numpy"]
        print(
            f"\n(min over repetitions, {res['torch_threads']} thread.)  Torch batched vs numpy "
            f"loop: {speed:.2f}x in CPU time, {res['numpy_wall_s'] / res['torch_wall_s']:.2f}x "
            f"in wall time (target >= 2x: {_ok(speed >= 2)}); max over layers of "
            f"||A_torch - A_numpy|| / ||A_numpy|| = {cmp_t['max_rel_diff']:.1e} (target "
            f"<= 1e-12: {_ok(cmp_t['max_rel_diff'] <= 1e-12)}), diagnostics differ by at most "
            f"{cmp_t['max_diag_diff']:.1e}, ranks agree: {cmp_t['ranks_agree']}; r' = "
            f"{res['rank']}, gram_rel_error {res['gram_rel_error']:.2e}."
        )
        heads[name] = {"speedup": speed, "rel": cmp_t["max_rel_diff"]}
        if "ref_cpu_s" in res:
            ref_speed = res["ref_cpu_s"] / res["numpy_cpu_s"]
            print(
                f"Numpy loop (thin path) vs dense reference: {ref_speed:.0f}x in CPU time; max "
                f"relative difference {res['numpy_vs_ref']['max_rel_diff']:.1e}."
            )
            heads[name].update(ref_speed=ref_speed, ref_rel=res["numpy_vs_ref"]["max_rel_diff"])
        if gpu.get("available"):
            g = gpu[name]
            print(
                f"CUDA ({gpu['device']}): {g['ms_min']:.1f} ms min, {g['ms_median']:.1f} ms median "
                f"(float32 inputs from the host, results back on the host), max rel. difference "
                f"{g['rel']:.1e}."
            )
        else:
            print(f"CUDA: skipped ({gpu['reason']}).")
        print()
    return heads


def print_client(
    label: str, shape: ModelShape, client: dict[str, Any], memory: dict[str, Any], s: Settings
) -> None:
    print(
        f"## Client step, {label}: {shape.family} {shape.layers} x {shape.hidden} (random "
        f"weights), batch {shape.batch} x {shape.seq_len}, r = {s.rank}, alpha = {s.alpha:g}, "
        f"targets query+value, head trainable, {s.client_threads} thread\n"
    )
    print(
        "| method | trainable params (adapter + head) | CPU median | wall median | "
        "model (params + buffers) | step peak RSS | step RSS above before | step peak (allocator) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, key in (("FLoRG", "florg"), ("PEFT LoRA", "lora")):
        c, m = client[key], memory[key]
        print(
            f"| {name} | {c['trainable']:,} ({c['adapter']:,} + {c['head']:,}) | "
            f"{_ms(c['cpu_median_s'])} | {_ms(c['wall_median_s'])} | {_mib(m['model_bytes'])} | "
            f"{_mib(m['rss_step_hwm_bytes'])} | {_mib(m['rss_step_peak_bytes'])} | "
            f"{_mib(m['alloc_peak_bytes'])} |"
        )
    ratios = ", ".join(f"{x:.3f}" for x in client["cpu_ratios"])
    print(
        f"\nStep time FLoRG / LoRA: {client['cpu_ratio_median']:.3f}, median of the per-pair "
        f"CPU-time ratios ({ratios}); wall time {client['wall_ratio_median']:.3f}.\n"
    )


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else a / b


def run(s: Settings, quick: bool) -> dict[str, Any]:
    torch.set_num_threads(_cpu_count())
    env = {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    print(f"# FLoRG core benchmark{' (quick)' if quick else ''}\n")
    print("\n".join(machine_info(s, env)) + "\n", flush=True)

    t0 = time.perf_counter()
    settings = ["--settings", json.dumps(asdict(s))]
    blas = {k: str(s.blas_threads) for k in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    servers = {
        shape.name: _run_worker(
            ["--worker", "server", "--shape", shape.name, *settings], {**env, **blas}
        )
        for shape in s.server_shapes
    }
    gpu = _run_worker(["--worker", "gpu", *settings], env)
    heads = print_server(servers, gpu)
    sys.stdout.flush()

    mem_env = {**env, "MALLOC_MMAP_THRESHOLD_": "65536"}
    clients, memories = {}, {}
    for which in ("small", "large"):
        clients[which] = _run_worker(["--worker", "client", "--which", which, *settings], env)
        memories[which] = {
            m: _run_worker(
                ["--worker", "memory", "--method", m, "--which", which, *settings], mem_env
            )
            for m in METHODS
        }
        shape = s.small if which == "small" else s.large
        label = "MiniLM size" if which == "small" else "RoBERTa-large shape"
        print_client(label, shape, clients[which], memories[which], s)
        sys.stdout.flush()
    elapsed = time.perf_counter() - t0

    small_m, large_m = memories["small"], memories["large"]
    param_ratio = large_m["florg"]["model_bytes"] / large_m["lora"]["model_bytes"]
    module_param_ratio = (
        large_m["florg"]["model_bytes"] + large_m["florg"]["module_sharing_extra_bytes"]
    ) / large_m["lora"]["model_bytes"]
    peak_ratio = _ratio(
        large_m["florg"]["rss_step_hwm_bytes"], large_m["lora"]["rss_step_hwm_bytes"]
    )
    large_step = clients["large"]["cpu_ratio_median"]
    print(
        f"RoBERTa-large shape, FLoRG / LoRA: parameters + buffers {param_ratio:.4f} (target "
        f"<= 1.02: {_ok(param_ratio <= 1.02)}; {module_param_ratio:.4f} with one L, R pair per "
        f"module, projection-sharing=module), peak step RSS "
        f"{'n/a' if peak_ratio is None else f'{peak_ratio:.4f}'} (target <= 1.03: "
        f"{_ok(peak_ratio is not None and peak_ratio <= 1.03)}), step time {large_step:.3f} "
        f"(target <= 1.05: {_ok(large_step <= 1.05)}).\n"
    )
    gpu_7b = gpu.get("7b", {}).get("ms_median") if gpu.get("available") else None
    if gpu_7b is not None:
        print(f"7B server step on CUDA: {gpu_7b:.1f} ms (target < 50 ms: {_ok(gpu_7b < 50)}).\n")
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"Total benchmark time {elapsed:.0f} s; load average at the end {load}\n", flush=True)

    rob = heads.get("roberta-large", {})
    fs, ls = clients["small"]["florg"], clients["small"]["lora"]
    return {
        "server_speedup": round(rob.get("ref_speed", float("nan")), 2),
        "server_max_rel_diff": rob.get("ref_rel"),
        "server_batched_speedup_roberta": round(heads["roberta-large"]["speedup"], 3),
        "server_batched_speedup_7b": round(heads["7b"]["speedup"], 3),
        "server_batched_max_rel_diff": max(h["rel"] for h in heads.values()),
        "server_gpu_ms_7b": None if gpu_7b is None else round(gpu_7b, 2),
        "client_step_ratio": round(clients["small"]["cpu_ratio_median"], 4),
        "client_step_wall_ratio": round(clients["small"]["wall_ratio_median"], 4),
        "client_memory_ratio": round(
            small_m["florg"]["alloc_peak_bytes"] / small_m["lora"]["alloc_peak_bytes"], 4
        ),
        "large_param_memory_ratio": round(param_ratio, 4),
        "large_param_memory_ratio_module_sharing": round(module_param_ratio, 4),
        "large_peak_memory_ratio": None if peak_ratio is None else round(peak_ratio, 4),
        "large_step_ratio": round(large_step, 4),
        "large_step_wall_ratio": round(clients["large"]["wall_ratio_median"], 4),
        "server_numpy_cpu_s_roberta": servers["roberta-large"]["numpy_cpu_s"],
        "server_torch_cpu_s_roberta": servers["roberta-large"]["torch_cpu_s"],
        "server_numpy_cpu_s_7b": servers["7b"]["numpy_cpu_s"],
        "server_torch_cpu_s_7b": servers["7b"]["torch_cpu_s"],
        "client_step_florg_cpu_s": fs["cpu_median_s"],
        "client_step_lora_cpu_s": ls["cpu_median_s"],
        "large_model_bytes_florg": large_m["florg"]["model_bytes"],
        "large_model_bytes_lora": large_m["lora"]["model_bytes"],
        "large_step_hwm_florg_bytes": large_m["florg"]["rss_step_hwm_bytes"],
        "large_step_hwm_lora_bytes": large_m["lora"]["rss_step_hwm_bytes"],
        "trainable_florg": fs["trainable"],
        "trainable_lora": ls["trainable"],
        "quick": quick,
        "cpu_count": _cpu_count(),
        "elapsed_s": round(elapsed, 1),
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    parser.add_argument(
        "--blas-threads", type=int, default=1, help="BLAS threads of the server step (default 1)"
    )
    parser.add_argument(
        "--worker", choices=("server", "gpu", "client", "memory"), help=argparse.SUPPRESS
    )
    parser.add_argument("--method", choices=METHODS, help=argparse.SUPPRESS)
    parser.add_argument("--which", choices=("small", "large"), help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        s = settings_from_json(args.settings)
        if args.worker == "server":
            result = server_worker(s, args.shape)
        elif args.worker == "gpu":
            result = gpu_worker(s)
        elif args.worker == "client":
            result = client_worker(s, args.which)
        else:
            result = memory_worker(args.method, args.which, s)
        print(json.dumps(result), flush=True)
        return
    s = replace(QUICK if args.quick else Settings(), blas_threads=args.blas_threads)
    print(json.dumps(run(s, args.quick)), flush=True)


if __name__ == "__main__":
    main()
