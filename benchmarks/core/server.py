"""Core benchmark, server step: the seeded FLoRG aggregation problems and the workers that
time the dense reference, the numpy loop and the batched torch path (CPU, and CUDA)."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import numpy as np
import torch

from benchmarks.core.settings import ServerShape, Settings


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
    from strategies.florg.rule import aggregate_florg, aggregate_florg_reference
    from strategies.florg.rule_torch import aggregate_florg_layers

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
    from strategies.florg.rule import aggregate_florg
    from strategies.florg.rule_torch import aggregate_florg_layers

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
