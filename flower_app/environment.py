"""What a run ran on: library versions, the CPU and its vector instructions, the GPU.

Every run's ``summary.json`` carries this as ``environment`` (the ServerApp's machine; in
the simulation engine the ClientApps run there too). Runs are deterministic on one machine
type, not across them: PyTorch's CPU kernels take different code paths with and without
AVX-512 (bf16 matrix products without ``avx512_bf16`` fall back to a slow reference kernel),
so the same settings can give results that differ in the last bits, and very different
times, on another CPU. A report that reuses or compares runs can tell them apart by this.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
from pathlib import Path
from typing import Any

__all__ = [
    "KERNEL_FLAGS",
    "PACKAGES",
    "describe_environment",
    "environment_label",
    "package_versions",
]

PACKAGES = ("flwr", "torch", "transformers", "peft", "datasets")
# the CPU features that change which kernels PyTorch's CPU backend (oneDNN, its own BLAS
# fallbacks) runs, so a run's speed and its last bits
KERNEL_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")


def package_versions(packages: tuple[str, ...] = PACKAGES) -> dict[str, str]:
    """Installed versions, read from package metadata (importing a library to read its
    ``__version__`` can cost seconds: PEFT's import does)."""
    versions = {}
    for package in packages:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[package] = importlib.metadata.version(package)
    return versions


def _cpu_model_and_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> tuple[str, list[str]]:
    """The CPU's model name and which of ``KERNEL_FLAGS`` it has (Linux); elsewhere the
    platform's processor name and no flags."""
    model, flags = "", set()
    with contextlib.suppress(OSError):
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and not model:
                model = value.strip()
            elif key == "flags" and not flags:
                flags = set(value.split())
    model = model or platform.processor() or platform.machine()
    return model, [flag for flag in KERNEL_FLAGS if flag in flags]


def describe_environment() -> dict[str, Any]:
    """The software and hardware of this process's machine, JSON-ready."""
    import torch  # loaded already in every process that records a run

    model, flags = _cpu_model_and_flags()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "python": platform.python_version(),
        **package_versions(),
        "os": platform.platform(terse=True),
        "cpu": model,
        "cpu-flags": flags,
        "cpu-count": os.cpu_count(),
        "torch-threads": torch.get_num_threads(),
        "gpu": gpu,
    }


def environment_label(environment: dict[str, Any]) -> str:
    """One line for a report: what decides a run's speed and its last bits."""
    flags = "+".join(environment.get("cpu-flags") or []) or "no AVX flags recorded"
    gpu = environment.get("gpu") or "no GPU"
    return (
        f"{environment.get('cpu-count')} x {environment.get('cpu') or 'unknown CPU'} "
        f"({flags}), {gpu}, torch {environment.get('torch', '?')}, "
        f"flwr {environment.get('flwr', '?')}"
    )
