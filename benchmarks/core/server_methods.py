"""Every method's server step, side by side: one round's aggregation of all adapted layers,
timed through the project's own server code at the paper's shapes.

    python -m benchmarks.core.server_methods --shape 7b --device cuda
    python -m benchmarks.core.server_methods --shape roberta-large --device cpu
    python -m benchmarks.core.server_methods --shape 7b --device cpu --layers 2
    python -m benchmarks.core.server_methods --shape quick --methods florg,fedit --repeats 3

For each method the script builds the strategy the ServerApp builds (``Method.build_strategy``
from the run settings, with ``rank`` and ``server-device`` set) over a seeded global state
of ``layers`` adapted layers (d_out = d_in = k), and the seeded replies of N clients, each
what the method's clients send up in round 1 (``Method.uplink``: its trained parts, float32
as they travel). It then times ``strategy.aggregate_adapter`` -- the call
``AdapterStrategy.aggregate_replies`` makes after the reply checks and the weighting, and
whose time (plus the head's FedAvg) is the round's ``agg-seconds`` -- the median of
``--repeats`` after one warm-up, every method once per repeat in a rotating order, so FLoRG
and the others share the machine's load and the ratios are side by side.

Where the strategy does more than the method's rule, the rule alone is timed too ("step
alone"): FLoRG's strategy runs its batched torch step (``aggregate_florg_layers``, the
production path; the numpy reference ``aggregate_florg`` is not timed) once more with the
other rank-mismatch policy for its ``fedavg_gap_*`` diagnostics, and FedEx-LoRA's and
FLoRA's strategies keep the server's dense cumulative fold for its evaluator.

Peak extra memory: on the host, the rise of the resident set's high-water mark over the
resident set before the call (``/proc/self/clear_refs``; measured in a pass after the
timings with glibc's mmap threshold fixed, so that freed arrays leave the resident set),
and on CUDA ``torch.cuda.max_memory_allocated`` over what was allocated before. Parameters
received per round: N clients x layers x ``Method.up_adapter_params`` (checked against the
payloads built). Only FLoRG's step runs on the server device; every other rule is numpy on
the host, whatever ``--device`` says (the "runs on" column).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import logging
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.core.rss import proc_status_kib, reset_peak_rss
from benchmarks.core.settings import QUICK_SERVER_SHAPES, SERVER_SHAPES, ServerShape

SHAPES: dict[str, ServerShape] = {
    "roberta-large": SERVER_SHAPES[0],
    "7b": SERVER_SHAPES[1],
    "quick": replace(QUICK_SERVER_SHAPES[0], name="quick"),  # tiny: the test's shape
}
BASELINE = "florg"
SERVER_ROUND = 1  # the default round: rolora trains B in odd rounds; fedsvd sends B only;
# fedrot-lora rotates nothing in round 1 (--round 2: A aligned, 3: B)
CLIENT_REL_NOISE = 0.05  # a client's arrays: the global ones plus 5 % noise (server.py's)

# What each method's server computes per round, in one phrase.
COMPUTES: dict[str, str] = {
    "florg": "Gram mean, eigh, Procrustes (batched torch), twice: + fedavg-gap diagnostics",
    "florg-no-procrustes": "Gram mean, eigh (batched torch), no Procrustes",
    "florg-signed": "FLoRG's step per sign block (2 blocks / layer), twice: + diagnostics",
    "fedit": "weighted mean of A and of B",
    "federa": "stack sqrt(w) B, A; thin QRs + SVD of the Nr x Nr core; rank r",
    "ffa-lora": "weighted mean of B",
    "fedsa-lora": "weighted mean of A",
    "fedex-lora": "means of A, B + dense residual sum w B A - mean B mean A; cumulative fold",
    "hetlora": "zero-pad to r_max (a no-op at one rank), weighted means of A, B",
    "flexlora": "stack sqrt(w) B, A; thin QRs + SVD of the Nr x Nr core; rank r",
    "rolora": "weighted mean of the round's factor (B in odd rounds)",
    "fedsvd": "weighted mean of B; SVD re-factorisation of B A (thin QRs)",
    "flora": "stack sqrt(w) B, A (exact update); dense cumulative fold; fresh LoRA",
    "fed-sb": "weighted mean of the r x r R",
    "fedrot-lora": "per client an r x r Procrustes SVD (A or B by round), rotate; means of A, B",
}


# --------------------------------------------------------------------------- setup


def set_blas_threads(n: int) -> bool:
    """Set numpy's OpenBLAS thread count (the library numpy loaded, found in
    /proc/self/maps) and torch's; False where no OpenBLAS setter was found."""
    torch.set_num_threads(n)
    done = False
    try:
        with open("/proc/self/maps") as fh:
            libs = {line.split()[-1] for line in fh if "openblas" in line.lower()}
    except OSError:
        return False
    for path in libs:
        lib = ctypes.CDLL(path)
        for symbol in (
            "scipy_openblas_set_num_threads64_",  # numpy >= 2's bundled OpenBLAS
            "openblas_set_num_threads64_",
            "openblas_set_num_threads",
        ):
            if hasattr(lib, symbol):
                getattr(lib, symbol)(int(n))
                done = True
                break
    return done


@contextlib.contextmanager
def blas_threads(n: int) -> Iterator[bool]:
    """Run a block with torch and OpenBLAS at n threads (steady timings on a shared machine),
    then put torch's count back for a caller that goes on: the thread counts are the
    process's, and the tests and the encodings benchmark call these benchmarks in-process.
    Yields whether an OpenBLAS setter was found; OpenBLAS's default count is torch's."""
    before = torch.get_num_threads()
    try:
        yield set_blas_threads(n)
    finally:
        set_blas_threads(before)


def layer_names(layers: int) -> list[str]:
    """A decoder's q, v projections: 'layer0.query', 'layer0.value', 'layer1.query', ..."""
    return [f"layer{i // 2}.{'query' if i % 2 == 0 else 'value'}" for i in range(layers)]


@dataclass
class Case:
    """One method's round: its strategy, the clients' payloads and weights."""

    name: str
    method: Any  # flower_app.methods.contract.Method
    strategy: Any  # the method's AdapterStrategy
    payloads: list[dict[str, np.ndarray]]
    weights: np.ndarray
    runs_on: str  # where its server math runs
    step: Callable[[], Any] | None = None  # the rule alone, where the round does more
    received_params: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    server_round: int = SERVER_ROUND  # the round whose replies are aggregated

    def round(self) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """The round's adapter aggregation, as ``aggregate_replies`` calls it."""
        return self.strategy.aggregate_adapter(self.server_round, self.payloads, self.weights)

    def folds(self) -> dict[str, np.ndarray]:
        """The dense folds into W0 the last ``round`` recorded ({} for a method without)."""
        residuals = getattr(self.strategy, "residuals", {}).get(self.server_round, {})
        return {layer: res.to_dense() for layer, res in residuals.items()}


def build_case(
    name: str, shape: ServerShape, layers: int, device: str, seed: int = 0,
    server_round: int = SERVER_ROUND,
) -> Case:  # fmt: skip
    """``name``'s strategy as the ServerApp builds it and its clients' seeded payloads of
    ``server_round`` at ``shape`` with ``layers`` adapted layers (ValueError: unknown
    method)."""
    from flower_app.methods.registry import get_method
    from flower_app.settings.config import resolve_config
    from strategies.shared.validation import normalize_weights

    method = get_method(name)
    k, r, n = shape.k, shape.rank, shape.clients
    # a seed per method name, so one method's arrays do not depend on the list run
    rng = np.random.default_rng([seed, *name.encode()])
    state: dict[str, np.ndarray] = {}
    for layer in layer_names(layers):
        for part in method.shared:
            key = f"{layer}.{method.kind.part_key(part)}"
            state[key] = 0.02 * rng.standard_normal(method.kind.parts[part].shape(k, k, r))
    config = resolve_config({}, {"method": name, "rank": r, "server-device": device})
    flwr_log = logging.getLogger("flwr")
    level = flwr_log.level
    flwr_log.setLevel(logging.ERROR)  # FedAvg warns that no client evaluates: not news here
    try:
        strategy = method.build_strategy(config, state)
    finally:
        flwr_log.setLevel(level)
    payloads = []
    for _ in range(n):
        client = {
            key: (g + CLIENT_REL_NOISE * 0.02 * rng.standard_normal(g.shape)).astype(np.float32)
            for key, g in state.items()
        }
        payloads.append(dict(method.uplink(client, server_round)))
    weights = normalize_weights(rng.integers(50, 500, size=n).astype(np.float64), n)
    received = n * layers * method.up_adapter_params(k, k, r, server_round)
    sent_up = sum(int(a.size) for p in payloads for a in p.values())
    if received != sent_up:  # the method's counting and its uplink must agree
        raise AssertionError(f"{name}: counted {received} parameters up, payloads hold {sent_up}")
    runs_on = str(getattr(strategy, "server_device", "cpu"))
    case = Case(name, method, strategy, payloads, weights, runs_on, received_params=received,
                server_round=server_round)  # fmt: skip
    case.step = rule_alone(case)
    return case


def rule_alone(case: Case) -> Callable[[], Any] | None:
    """The method's rule without what its strategy adds to the round (None: nothing)."""
    strategy, payloads, w = case.strategy, case.payloads, case.weights
    if hasattr(strategy, "server_step"):  # FLoRG: its batched step, the run's policy
        if not strategy.procrustes:  # no fedavg-gap diagnostics: the round is the step
            return None
        return lambda: strategy.server_step(payloads, w, strategy.rank_mismatch)
    if case.name == "fedex-lora":
        from flower_app.methods.contract import stacked
        from strategies.fedex_lora.rule import aggregate_fedex_lora

        def fedex() -> dict[str, Any]:
            return {
                layer: aggregate_fedex_lora(
                    stacked(payloads, f"{layer}.lora_B"),
                    stacked(payloads, f"{layer}.lora_A"),
                    w,
                    strategy.residual_mode,
                )
                for layer in strategy.layers()
            }

        return fedex
    if case.name == "flora":
        from flower_app.methods.contract import stacked
        from strategies.flora.rule import stack_flora

        def flora() -> dict[str, Any]:
            return {
                layer: stack_flora(
                    stacked(payloads, f"{layer}.lora_B"), stacked(payloads, f"{layer}.lora_A"), w
                )
                for layer in strategy.layers()
            }

        return flora
    return None


# --------------------------------------------------------------------------- timing


def _sync(case: Case) -> None:
    if case.runs_on.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(case: Case, fn: Callable[[], Any]) -> float:
    """Wall seconds of one call (garbage collection held off during it)."""
    gc.collect()
    gc.disable()
    try:
        _sync(case)
        t0 = time.perf_counter()
        fn()
        _sync(case)
        return time.perf_counter() - t0
    finally:
        gc.enable()


def _fix_mmap_threshold() -> bool:
    """glibc: serve every allocation above 128 KiB by mmap, so a freed array leaves the
    resident set at once (glibc otherwise raises the threshold after a large free and keeps
    the memory, which would hide a later call's peak)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(-3, 128 * 1024))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def _trim_heap() -> None:
    """Give the heap's free memory back to the system (glibc ``malloc_trim``), so the
    resident set before a call holds no freed arrays the call could reuse unseen."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def peak_memory(case: Case) -> dict[str, float | None]:
    """Peak extra MiB of one round: host (VmHWM over VmRSS before; None where the kernel
    does not reset the mark) and, on CUDA, the device's allocator."""
    gc.collect()
    _trim_heap()
    on_cuda = case.runs_on.startswith("cuda")
    if on_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base_dev = torch.cuda.memory_allocated()
    base = proc_status_kib("VmRSS")
    ok = reset_peak_rss()
    case.round()
    _sync(case)
    host = (proc_status_kib("VmHWM") - base) / 1024 if ok else None
    dev = (torch.cuda.max_memory_allocated() - base_dev) / 2**20 if on_cuda else None
    return {"host_mib": host, "device_mib": dev}


def run(
    shape_name: str,
    device: str = "cpu",
    methods: list[str] | None = None,
    repeats: int = 5,
    layers: int | None = None,
    threads: int = 0,
    memory: bool = True,
    seed: int = 0,
    server_round: int = SERVER_ROUND,
) -> dict[str, Any]:
    """Time every method's round (and rule alone) at ``shape_name``; the result as a dict
    (``table`` formats it). ValueError: unknown shape or method, CUDA asked for without it."""
    from flower_app.methods.registry import get_method, method_names

    if shape_name not in SHAPES:
        raise ValueError(f"unknown shape {shape_name!r}; shapes: {', '.join(SHAPES)}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: CUDA is not available to torch on this machine")
    shape = SHAPES[shape_name]
    layers = shape.layers if layers is None else int(layers)
    if layers < 1 or repeats < 1 or server_round < 1:
        raise ValueError("--layers, --repeats and --round must be >= 1")
    names = list(methods) if methods else list(method_names())
    for name in names:
        get_method(name)  # ValueError naming the registered methods
    if BASELINE not in names:  # the ratios need FLoRG timed in the same run
        names.insert(0, BASELINE)
    names = list(dict.fromkeys(names))
    threads = threads or (1 if device == "cpu" else (os.cpu_count() or 1))
    with blas_threads(threads) as blas_set:
        return _timed_cases(names, shape, layers, device, repeats, memory, seed, server_round) | {
            "threads": threads,
            "blas_threads_set": blas_set,
        }


def _timed_cases(
    names: list[str],
    shape: ServerShape,
    layers: int,
    device: str,
    repeats: int,
    memory: bool,
    seed: int,
    server_round: int = SERVER_ROUND,
) -> dict[str, Any]:
    """``run``'s measurement once its threads are set: every case's rounds and steps timed,
    rotated, then its peak memory; the result dict without the thread fields."""
    cases = {name: build_case(name, shape, layers, device, seed, server_round) for name in names}
    for case in cases.values():  # warm-up: imports, thread pools, FLoRG's staging buffer
        case.round()
        if case.step is not None:
            case.step()
    times: dict[str, list[float]] = {name: [] for name in names}
    steps: dict[str, list[float]] = {name: [] for name in names if cases[name].step}
    for rep in range(repeats):
        shift = rep % len(names)  # rotate the order: no method always runs first
        for name in names[shift:] + names[:shift]:
            case = cases[name]
            times[name].append(_timed(case, case.round))
            if case.step is not None:
                steps[name].append(_timed(case, case.step))
    mem: dict[str, dict[str, float | None]] = {}
    if memory:
        fixed = _fix_mmap_threshold()
        for name in names:
            mem[name] = peak_memory(cases[name]) if fixed else {"host_mib": None}
            if device == "cuda" and not cases[name].runs_on.startswith("cuda"):
                mem[name]["device_mib"] = 0.0

    base = statistics.median(times[BASELINE])
    base_step = statistics.median(steps[BASELINE]) if BASELINE in steps else base
    rows = []
    for name in names:
        case = cases[name]
        med = statistics.median(times[name])
        step = statistics.median(steps[name]) if name in steps else None
        rows.append(
            {
                "method": name,
                "computes": COMPUTES.get(name, case.method.summary),
                "runs_on": case.runs_on,
                "round_s": med,
                "round_s_per_layer": med / layers,
                "ratio_to_florg": med / base,
                "step_alone_s": step,
                "step_ratio_to_florg_step": (step if step is not None else med) / base_step,
                "times_s": times[name],
                "received_params": case.received_params,
                **{f"peak_{k}": v for k, v in mem.get(name, {}).items()},
            }
        )
    return {
        "shape": {**shape.__dict__, "layers": layers, "shape_layers": shape.layers},
        "device": device,
        "device_name": torch.cuda.get_device_name(0) if device == "cuda" else "CPU",
        "repeats": repeats,
        "server_round": server_round,
        "load_avg": os.getloadavg(),
        "rows": rows,
    }


# --------------------------------------------------------------------------- report


def _mib(x: float | None) -> str:
    return "n/a" if x is None else f"{x:,.1f}"


def table(result: dict[str, Any]) -> str:
    """The result as a markdown table, with a header line naming the shape and machine."""
    s = result["shape"]
    cut = "" if s["layers"] == s["shape_layers"] else f" of the shape's {s['shape_layers']}"
    head = (
        f"# server step of every method, shape {s['name']}: {s['layers']} layers{cut}, "
        f"k = {s['k']}, N = {s['clients']}, r = {s['rank']}; --device {result['device']} "
        f"({result['device_name']}), {result['threads']} threads, median of "
        f"{result['repeats']} after one warm-up, round {result['server_round']}; load average "
        f"{', '.join(f'{x:.1f}' for x in result['load_avg'])}"
    )
    cuda = result["device"] == "cuda"
    lines = [
        head,
        "",
        "| method | what its server computes | runs on | s / round | s / layer | × FLoRG "
        "| step alone s | step × FLoRG step | peak extra host MiB "
        + ("| peak extra device MiB " if cuda else "")
        + "| params received / round |",
        "|---|---|---|---|---|---|---|---|---|" + ("---|" if cuda else "") + "---|",
    ]
    for row in result["rows"]:
        step = "=" if row["step_alone_s"] is None else f"{row['step_alone_s']:.4g}"
        cells = [
            row["method"],
            row["computes"],
            row["runs_on"],
            f"{row['round_s']:.4g}",
            f"{row['round_s_per_layer']:.3g}",
            f"{row['ratio_to_florg']:.3g}",
            step,
            f"{row['step_ratio_to_florg_step']:.3g}",
            _mib(row.get("peak_host_mib")),
        ]
        if cuda:
            cells.append(_mib(row.get("peak_device_mib")))
        cells.append(f"{row['received_params']:,}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.core.server_methods",
        description="Every registered method's server round, side by side with FLoRG's.",
    )
    p.add_argument("--shape", default="7b", choices=list(SHAPES))
    p.add_argument("--device", default="cpu", help="cpu or cuda (FLoRG's step device)")
    p.add_argument("--methods", default="", help="comma-separated names (default: all)")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds (median) per method")
    p.add_argument("--layers", type=int, default=None, help="adapted layers (default: shape's)")
    p.add_argument(
        "--threads", type=int, default=0, help="BLAS, torch threads (0: 1 on cpu, all on cuda)"
    )
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory pass")
    p.add_argument(
        "--round", type=int, default=SERVER_ROUND,
        help="the round whose replies are aggregated (default 1; fedrot-lora rotates from 2)",
    )  # fmt: skip
    p.add_argument("--json", type=Path, default=None, help="write the result here")
    args = p.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    try:
        result = run(
            args.shape,
            args.device,
            methods,
            args.repeats,
            args.layers,
            args.threads,
            memory=not args.no_memory,
            server_round=args.round,
        )
    except ValueError as err:
        raise SystemExit(f"server_methods: {err}") from None
    print(table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nwritten: {args.json}")


if __name__ == "__main__":
    main()
