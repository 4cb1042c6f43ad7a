"""Where the batched FLoRG server step spends its time: one step under ``torch.profiler``,
the operators sorted by their own time on the device, beside the step's wall time split into
its host-side stages (input checks and stacking, the batched math, the copy back).

    python -m benchmarks.core.server_profile                 # 7B shape, CUDA if present
    python -m benchmarks.core.server_profile --shape roberta-large --device cpu
    python -m benchmarks.core.server_profile --quick         # tiny shape (smoke test)

Issue 28 sets the target of the step at the 7B shape on a GPU below 50 ms; the core
benchmark (``benchmarks.core.core_benchmark``) times it, this finds what to change.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import numpy as np
import torch

from benchmarks.core.server import server_problems
from benchmarks.core.settings import QUICK_SERVER_SHAPES, SERVER_SHAPES, Settings


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def profile_step(shape_name: str, device: str, quick: bool, rows: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    from strategies.florg_torch import aggregate_florg_layers

    shapes = {s.name: s for s in (QUICK_SERVER_SHAPES if quick else SERVER_SHAPES)}
    if shape_name not in shapes:
        raise SystemExit(f"unknown shape {shape_name!r}; shapes: {', '.join(shapes)}")
    shape = shapes[shape_name]
    client_As, w, prev_As = server_problems(shape, Settings())
    wire = {n: [a.astype(np.float32) for a in As] for n, As in client_As.items()}
    for _ in range(2):  # warm-up: handles, kernels, the pinned staging buffer
        aggregate_florg_layers(wire, w, prev_As, device=device)
    _sync(device)
    walls = []
    for _ in range(5):
        t0 = time.perf_counter()
        aggregate_florg_layers(wire, w, prev_As, device=device)
        _sync(device)
        walls.append((time.perf_counter() - t0) * 1e3)
    activities = [ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        aggregate_florg_layers(wire, w, prev_As, device=device)
        _sync(device)
    sort = "self_cpu_time_total" if device == "cpu" else "self_device_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=rows)
    name = torch.cuda.get_device_name(0) if device == "cuda" else "CPU"
    return (
        f"# FLoRG server step, shape {shape.name} ({shape.layers} layers, k = {shape.k}, "
        f"N = {shape.clients}, r = {shape.rank}) on {name}\n"
        f"wall ms of 5 steps: {', '.join(f'{x:.1f}' for x in walls)} "
        f"(min {min(walls):.1f})\n\n{table}"
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--shape", default="7b", help="roberta-large or 7b (default 7b)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--quick", action="store_true", help="the tiny shapes")
    parser.add_argument("--rows", type=int, default=25, help="operators shown (default 25)")
    args = parser.parse_args(argv)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    print(profile_step(args.shape, device, args.quick, args.rows), flush=True)


if __name__ == "__main__":
    main()
