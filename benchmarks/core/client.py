"""Core benchmark, client step: random encoder classifiers with FLoRG or PEFT LoRA, the
interleaved step timing and the memory of one training step (each in its own worker)."""

from __future__ import annotations

import gc
import json
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.core.rss import proc_status_kib, reset_peak_rss
from benchmarks.core.settings import METHODS, Batch, ModelShape, Settings
from flower_app.training.loop import is_adapter_parameter, train_step


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
    """(model, its optimiser) for 'florg' or 'lora' (the app's ``fedit``): the adapter and
    the optimiser (``flower_app.training.loop.make_optimizer``) of a run with the app's default
    settings at rank ``s.rank`` and alpha ``s.alpha``."""
    from flower_app.adapted import AdaptedModel
    from flower_app.settings.config import resolve_config
    from flower_app.training.loop import make_optimizer

    app_method = {"florg": "florg", "lora": "fedit"}.get(method)
    if app_method is None:
        raise ValueError(f"unknown method {method!r}")
    settings = {"method": app_method, "rank": s.rank, "alpha": s.alpha}
    config = resolve_config({}, {**settings, "target-modules": "query,value"})
    with warnings.catch_warnings():  # peft touches transformers' deprecated attribute
        warnings.filterwarnings("ignore", ".*is_gradient_checkpointing", FutureWarning)
        model = AdaptedModel(build_model(shape, s.seed), config).model
    model.train()
    optimizer = make_optimizer(
        model, lr=config.learning_rate, head_lr=config.head_lr, weight_decay=config.weight_decay
    )
    return model, optimizer


def make_batch(shape: ModelShape, seed: int) -> Batch:
    g = torch.Generator().manual_seed(seed + 1)
    return {
        "input_ids": torch.randint(3, shape.vocab, (shape.batch, shape.seq_len), generator=g),
        "attention_mask": torch.ones(shape.batch, shape.seq_len, dtype=torch.long),
        "labels": torch.randint(0, 3, (shape.batch,), generator=g),
    }


def param_counts(model: nn.Module) -> dict[str, int]:
    """Trainable parameters (adapter vs the rest, i.e. the head) and bytes held by the model
    (parameters and buffers; a tensor shared by several modules counted once)."""
    adapter = head = 0
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if is_adapter_parameter(name):
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
    rss_model_kib = proc_status_kib("VmRSS")
    for _ in range(s.mem_warmup):
        train_step(model, opt, batch)
    rss_deltas: list[int] = []
    rss_peaks: list[int] = []
    if reset_peak_rss():
        for _ in range(s.large_mem_reps if large else s.mem_reps):
            opt.zero_grad(set_to_none=True)
            gc.collect()
            reset_peak_rss()
            before = proc_status_kib("VmRSS")
            train_step(model, opt, batch)
            peak = proc_status_kib("VmHWM")
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
        from flower_app.adapters.florg.model import florg_layers

        layers = list(florg_layers(model).values())
        pair = [(x.L.numel() + x.R.numel()) * x.L.element_size() for x in layers]
        unique = {id(x.projections): p for x, p in zip(layers, pair, strict=True)}
        out["module_sharing_extra_bytes"] = sum(pair) - sum(unique.values())
    return out
