"""Where the batched FLoRG server step spends its time: one step under ``torch.profiler``,
the operators sorted by their own time on the device, beside the step's wall time split into
its host-side stages (input checks and stacking, the batched math, the copy back).

    python -m benchmarks.core.server_profile                 # 7B shape, CUDA if present
    python -m benchmarks.core.server_profile --shape roberta-large --device cpu
    python -m benchmarks.core.server_profile --quick         # tiny shape (smoke test)
    python -m benchmarks.core.server_profile --blocks        # + the step's building blocks
    python -m benchmarks.core.server_profile --eigh-sizes    # CUDA: the eigen routes by size

``--blocks`` also times, at the same shape, each building block alone on the device and on
the CPU (all threads): the host-to-device copy of the clients' float32 matrices, the
batched float64 Gram product, ``eigvalsh`` and ``eigh`` of the B x Nr x Nr Grams, and the
thin SVD of the B x r x Nr Procrustes cross products -- which of them a faster step must
replace (torch batches small CUDA eigen and singular value problems only up to 32 x 32).
On CUDA it also times candidate replacements: eigvalsh through MAGMA and in float32, the
batched eigh of the r x r products X X^T (the polar factor's route when r <= 32) and a
batched Cholesky of the Grams (a full-rank test without eigenvalues).

Issue 28 sets the target of the step at the 7B shape on a GPU below 50 ms; the core
benchmark (``benchmarks.core.core_benchmark``) times it, this finds what to change.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from benchmarks.core.server import server_problems
from benchmarks.core.settings import QUICK_SERVER_SHAPES, SERVER_SHAPES, ServerShape, Settings


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _server_shape(name: str, quick: bool) -> ServerShape:
    shapes = {s.name: s for s in (QUICK_SERVER_SHAPES if quick else SERVER_SHAPES)}
    if name not in shapes:
        raise SystemExit(f"unknown shape {name!r}; shapes: {', '.join(shapes)}")
    return shapes[name]


def profile_step(shape_name: str, device: str, quick: bool, rows: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    from strategies.florg.rule_torch import aggregate_florg_layers

    shape = _server_shape(shape_name, quick)
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
    from strategies.florg.device import STAGING, stack_layers
    from strategies.florg.rule_torch import _validated

    stages: dict[str, list[float]] = {"validate": [], "stack + copy": []}
    for _ in range(5):  # the host-side stages alone
        t0 = time.perf_counter()
        mats, _w, prevs = _validated(wire, w, prev_As)
        t1 = time.perf_counter()
        with STAGING.lock:
            stack_layers(list(prevs), mats, prevs, torch.device(device))
            _sync(device)
        t2 = time.perf_counter()
        stages["validate"].append((t1 - t0) * 1e3)
        stages["stack + copy"].append((t2 - t1) * 1e3)
    split = ", ".join(f"{k} {min(v):.1f}" for k, v in stages.items())
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
        f"(min {min(walls):.1f}); host-side stages alone, min ms of 5: {split}\n\n{table}"
    )


def _median_ms(fn: Callable[[], Any], device: str, reps: int = 7) -> float:
    fn()
    _sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _on_library(name: str, fn: Callable[[], Any]) -> Any:
    """``fn()`` with torch's preferred CUDA linear-algebra library set to ``name``
    (``magma`` or ``cusolver``), then the previous preference restored."""
    before = torch.backends.cuda.preferred_linalg_library()
    torch.backends.cuda.preferred_linalg_library(name)
    try:
        return fn()
    finally:
        torch.backends.cuda.preferred_linalg_library(before)


def _on_host_pool(fn: Callable[[torch.Tensor], Any], batch: torch.Tensor, workers: int) -> Any:
    """``fn`` over ``batch`` (on the device) copied to the host, in ``workers`` threads of
    chunks of the batch (LAPACK releases the GIL), the results concatenated and copied back:
    the candidate that moves the small eigen- and singular-value problems off the GPU."""
    host = batch.cpu()
    chunks = host.tensor_split(workers)
    with ThreadPoolExecutor(workers) as pool:
        parts = list(pool.map(fn, chunks))
    if isinstance(parts[0], tuple):
        return tuple(
            torch.cat(p).to(batch.device, non_blocking=True) for p in zip(*parts, strict=True)
        )
    return torch.cat(parts).to(batch.device, non_blocking=True)


def _polar_qr(X: torch.Tensor) -> torch.Tensor:
    """Theorem 1's S = U V^T for X (B x r x n, r <= 32) without an r x n SVD: X^T = Q R
    (thin QR), then the r x r SVD R^T = U' S' V'^T, so X = U' S' (Q V')^T and
    S = U' V'^T Q^T (a candidate: torch batches r x r SVDs on CUDA)."""
    Q, R = torch.linalg.qr(X.mT)
    U, _, Vh = torch.linalg.svd(R.mT)
    return (U @ Vh) @ Q.mT


def _polar_svd(X: torch.Tensor) -> torch.Tensor:
    """S = U V^T from the thin SVD of X (what the step does now)."""
    U, _, Vh = torch.linalg.svd(X, full_matrices=False)
    return U @ Vh


def _polar_gram(X: torch.Tensor) -> torch.Tensor:
    """S = (X X^T)^{-1/2} X from the r x r eigh (a candidate; squares X's condition)."""
    lam, V = torch.linalg.eigh(X @ X.mT)
    return (V * lam.rsqrt()[:, None, :]) @ V.mT @ X


def time_blocks(shape_name: str, device: str, quick: bool) -> str:
    """Median ms of each building block of the step at ``shape_name``, on ``device`` and
    on the CPU, as a markdown table."""
    shape = _server_shape(shape_name, quick)
    B, n, r, k = shape.layers, shape.clients * shape.rank, shape.rank, shape.k
    g = torch.Generator().manual_seed(0)
    wire = torch.randn(B, n + r, k, generator=g, dtype=torch.float32)
    if device == "cuda":
        wire = wire.pin_memory()
    T = wire.to(device=device, dtype=torch.float64)
    G = T[:, :n] @ T[:, :n].mT
    X = T[:, n:] @ T[:, :n].mT
    Tc, Gc, Xc = T[:, :n].cpu(), G.cpu(), X.cpu()  # the same inputs for the CPU column
    workers = min(B, os.cpu_count() or 1)
    rows = [
        ("host-to-device copy, float32", lambda: wire.to(device, non_blocking=True), None),
        ("Gram product, float64 bmm", lambda: T[:, :n] @ T[:, :n].mT, lambda: Tc @ Tc.mT),
        (
            "eigvalsh of the Grams",
            lambda: torch.linalg.eigvalsh(G),
            lambda: torch.linalg.eigvalsh(Gc),
        ),
        ("eigh of the Grams", lambda: torch.linalg.eigh(G), lambda: torch.linalg.eigh(Gc)),
        (
            "thin SVD of the cross products",
            lambda: torch.linalg.svd(X, full_matrices=False),
            lambda: torch.linalg.svd(Xc, full_matrices=False),
        ),
    ]
    if device == "cuda":  # candidate replacements, timed on the device only
        rows += [
            (
                "eigvalsh of the Grams, MAGMA backend",
                lambda: _on_library("magma", lambda: torch.linalg.eigvalsh(G)),
                None,
            ),
            (
                "eigvalsh of the Grams, float32",
                lambda: torch.linalg.eigvalsh(G.float()),
                None,
            ),
            (
                "eigh of the r x r X X^T (polar factor's route for r <= 32)",
                lambda: torch.linalg.eigh(X @ X.mT),
                None,
            ),
            (
                "Cholesky of the Grams (a full-rank test)",
                lambda: torch.linalg.cholesky_ex(G),
                None,
            ),
            (
                "polar factor of X via thin QR + r x r SVD",
                lambda: _polar_qr(X),
                None,
            ),
            (
                "polar factor of X via (X X^T)^(-1/2) X",
                lambda: _polar_gram(X),
                None,
            ),
            (
                "polar factor of X via the thin SVD (as now)",
                lambda: _polar_svd(X),
                None,
            ),
            (
                f"eigvalsh of the Grams on the host, {workers} threads, copies included",
                lambda: _on_host_pool(torch.linalg.eigvalsh, G, workers),
                None,
            ),
            (
                f"thin SVD of the cross products on the host, {workers} threads, copies included",
                lambda: _on_host_pool(
                    lambda x: torch.linalg.svd(x, full_matrices=False), X, workers
                ),
                None,
            ),
        ]
    lines = [
        f"## building blocks at {shape.name}: B = {B} layers, Nr = {n}, r = {r}, k = {k} "
        f"(median ms of 7; CPU with {torch.get_num_threads()} threads)",
        "",
        f"| block | {device} |" + ("" if device == "cpu" else " cpu |"),
        "|---|---|" + ("" if device == "cpu" else "---|"),
    ]
    for label, on_device, on_cpu in rows:
        dev_ms = _median_ms(on_device, device)
        row = f"| {label} | {dev_ms:.2f} |"
        if device != "cpu":
            row += " n/a |" if on_cpu is None else f" {_median_ms(on_cpu, 'cpu'):.2f} |"
        lines.append(row)
    if device == "cuda":  # how far each candidate lands from what the step computes now
        U, _, Vh = torch.linalg.svd(Xc, full_matrices=False)
        polar = U @ Vh
        lam = torch.linalg.eigvalsh(Gc)
        lines += ["", "max abs difference to the CPU float64 result (candidate: value)", ""]
        for label, got, want in (
            ("polar via QR + r x r SVD", _polar_qr(X), polar),
            ("polar via (X X^T)^(-1/2) X", _polar_gram(X), polar),
            ("polar via the thin SVD on CUDA", _polar_svd(X), polar),
            ("eigvalsh on CUDA (relative to lambda_1)", torch.linalg.eigvalsh(G), lam),
        ):
            diff = (got.cpu() - want).abs().amax()
            if got.dim() == 2:
                diff = ((got.cpu() - want).abs() / want[:, -1:]).amax()
            lines.append(f"- {label}: {float(diff):.2e}")
    return "\n".join(lines)


def time_eigh_sizes(batches: Sequence[int], sizes: Sequence[int], reps: int = 15) -> str:
    """Batched eigvalsh / eigh of B random symmetric float64 matrices of n rows on CUDA:
    cuSOLVER against ``florg_device.batched_eigh``'s host pool (copies included), the two
    routes interleaved, median (min) ms of ``reps`` -- where the step's routing rule
    (HOST_EIGH_MAX, HOST_EIGH_MIN_BATCH) comes from."""
    from strategies.florg.device import POOL_WORKERS, batched_eigh

    def timed(fn: Callable[[], Any]) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3

    lines = [
        f"## batched eigen problems on {torch.cuda.get_device_name(0)}: torch threads "
        f"{torch.get_num_threads()}, host pool {POOL_WORKERS} threads; median (min) ms of {reps}",
        "",
        "| B | n | vectors | cuSOLVER | host pool |",
        "|---|---|---|---|---|",
    ]
    for vectors in (False, True):
        for B in batches:
            for n in sizes:
                X = torch.randn(B, n, n + 8, dtype=torch.float64, device="cuda")
                G = X @ X.mT
                routes = [
                    lambda G=G, v=vectors: batched_eigh(G, v, on_host=False),
                    lambda G=G, v=vectors: batched_eigh(G, v, on_host=True),
                ]
                for route in routes:  # warm-up
                    route()
                    route()
                ms: list[list[float]] = [[], []]
                for _ in range(reps):
                    for i, route in enumerate(routes):
                        ms[i].append(timed(route))
                cells = " | ".join(f"{statistics.median(m):.1f} ({min(m):.1f})" for m in ms)
                lines.append(f"| {B} | {n} | {vectors} | {cells} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--shape", default="7b", help="roberta-large or 7b (default 7b)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--quick", action="store_true", help="the tiny shapes")
    parser.add_argument("--rows", type=int, default=25, help="operators shown (default 25)")
    parser.add_argument("--blocks", action="store_true", help="also time the building blocks")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1, as the core benchmark's server step: on a loaded "
        "machine a multi-threaded LAPACK spin-waits and its times mean little)",
    )
    parser.add_argument(
        "--eigh-sizes",
        action="store_true",
        help="CUDA only: time batched eigen problems per batch and size, cuSOLVER against "
        "the host pool, instead of the step",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.eigh_sizes:
        if device != "cuda":
            raise SystemExit("--eigh-sizes compares cuSOLVER with the host: it needs CUDA")
        print(time_eigh_sizes((8, 16, 32, 64), (48, 96, 160, 320, 512)), flush=True)
        return
    print(profile_step(args.shape, device, args.quick, args.rows), flush=True)
    if args.blocks:
        print("\n" + time_blocks(args.shape, device, args.quick), flush=True)


if __name__ == "__main__":
    main()
