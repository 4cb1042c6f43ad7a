"""Core benchmark, report: the machine, the server and client tables (markdown)."""

from __future__ import annotations

import os
import platform
from typing import Any

import numpy as np
import torch

from benchmarks.core.settings import ModelShape, Settings


def cpu_count() -> int:
    return os.cpu_count() or 1


def _mib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f} MiB"


def _ms(t: float) -> str:
    return f"{t * 1e3:.1f} ms"


def machine_info(s: Settings, env: dict[str, str]) -> list[str]:
    import peft
    import transformers

    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return [
        f"- CPU: {platform.processor() or platform.machine()}, os.cpu_count() = {cpu_count()}, "
        f"load average (1/5/15 min) at start {load}",
        f"- python {platform.python_version()}, torch {torch.__version__}, numpy "
        f"{np.__version__}, transformers {transformers.__version__}, peft {peft.__version__}",
        f"- torch threads {s.client_threads} (client steps), BLAS and torch threads "
        f"{s.blas_threads} (server step), OMP_WAIT_POLICY={env['OMP_WAIT_POLICY']} in the workers",
    ]


def ok(flag: bool) -> str:
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
            f"in wall time (target >= 2x: {ok(speed >= 2)}); max over layers of "
            f"||A_torch - A_numpy|| / ||A_numpy|| = {cmp_t['max_rel_diff']:.1e} (target "
            f"<= 1e-12: {ok(cmp_t['max_rel_diff'] <= 1e-12)}), diagnostics differ by at most "
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


def ratio_of(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else a / b
