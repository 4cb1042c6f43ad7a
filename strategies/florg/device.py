"""The FLoRG server step's device side: where the stack of client matrices lives, how it gets
there, and the products whose fastest backend differs between CPU and CUDA.

``resolve_server_device`` reads the setting ``server-device``. ``stack_layers`` stacks each
layer's A_1; ...; A_N with A_prev as its last r rows, in a buffer kept between calls
(``STAGING``, ``release_staging_buffers``); for CUDA pinned on the host, in the wire's dtype,
converted to float64 on the device. ``gram_and_cross`` gives G = M M^T and A_prev A^T from
one symmetric product (BLAS syrk through NumPy on CPU, bmm on CUDA), ``times_stack`` the
skinny S A, ``batched_eigh`` the eigenproblems (on CUDA, batches of small Grams go back to
LAPACK on the host's thread pool, ``host_pool``). Results equal the CPU path's up to
rounding. Why, with the measurements: docs/benchmarks.md, "Where the server step's time goes".
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np
import torch

from strategies.shared.validation import AggregationInputError

SERVER_DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda")
F64 = torch.float64


def resolve_server_device(device: str | torch.device = "auto") -> torch.device:
    """'auto' -> CUDA when torch sees a GPU, else CPU; 'cuda' without a GPU is an error."""
    if isinstance(device, torch.device):
        return device
    name = str(device)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"server device {name!r} requested but CUDA is not available")
        return torch.device(name)
    raise ValueError(f"server device must be one of {SERVER_DEVICES}, got {name!r}")


# --------------------------------------------------------------------------- staging


class _Staging:
    """Reusable flat buffers, one per (device, dtype, pinned), for the stacked matrices.

    The server aggregates the same shapes every round; a fresh stack of that size (335 MiB
    for a 7B decoder's q, v with N = 20, r = 8) costs more in page faults than the batched
    products on it (measured here: 0.94 s vs 0.38 s for the whole step on one CPU core), so
    the buffer is kept and reused.  ``release_staging_buffers`` frees them.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, bool], torch.Tensor] = {}
        self.lock = threading.Lock()

    def get(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, pin: bool = False
    ) -> torch.Tensor:
        key = (str(device), dtype, pin)
        numel = math.prod(shape)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            self._buffers.pop(key, None)  # free the smaller one before allocating
            buf = torch.empty(numel, dtype=dtype, device=device, pin_memory=pin)
            self._buffers[key] = buf
        return buf[:numel].view(shape)

    def clear(self) -> None:
        self._buffers.clear()


STAGING = _Staging()  # one per process; aggregate_layers_torch holds its lock for a step


def release_staging_buffers() -> None:
    """Free the stacking buffers kept between calls (they are re-allocated when needed)."""
    with STAGING.lock:
        STAGING.clear()


def stack_layers(
    names: Sequence[str],
    mats: Mapping[str, list[np.ndarray]],
    prevs: Mapping[str, np.ndarray],
    device: torch.device,
) -> torch.Tensor:
    """(B x (Nr + r) x k) float64 on ``device``: layer b's A_1; ...; A_N; A_prev.

    A_prev rides along as the last r rows so that one symmetric product gives both
    G = M M^T and A_prev M^T (see ``gram_and_cross``).  The result is a view of a reused
    buffer (valid until the next call).  For CUDA the host side is pinned and float32 when
    every client input is float32 (exact: float32 -> float64 is lossless; half the bytes
    to move), copied as it is and converted on the device: torch's cross-device ``copy_``
    with a dtype change converts on the CPU, into pageable memory (H100, 7B shape: 270 ms
    of the step's 400, against 3 ms for the float32 copy).  Raises naming a non-finite
    input.
    """
    first = mats[names[0]]
    n, (r, k) = len(first), first[0].shape
    shape = (len(names), (n + 1) * r, k)
    if device.type == "cpu":
        stacked = STAGING.get(shape, F64, device)
        host = stacked.numpy()
    else:
        all_f32 = all(a.dtype == np.float32 for name in names for a in mats[name])
        host_t = STAGING.get(shape, torch.float32 if all_f32 else F64, torch.device("cpu"), True)
        host = host_t.numpy()
    fill_stack(host, names, mats, prevs)
    if device.type != "cpu":
        stacked = STAGING.get(shape, F64, device)
        if host_t.dtype == F64:
            stacked.copy_(host_t, non_blocking=True)
        else:
            # The copy in the wire's dtype, then the conversion on the device: copy_ with a
            # dtype change across devices would convert on the host (see the docstring).
            wire = STAGING.get(shape, host_t.dtype, device)
            wire.copy_(host_t, non_blocking=True)
            stacked.copy_(wire)
            # A_prev is float64 and must not be rounded
            prev = np.stack([prevs[name] for name in names])
            stacked[:, n * r :] = torch.from_numpy(prev).to(device)
    # A NaN/Inf entry makes its client's sum non-finite; one reduction instead of a mask
    # the size of the stack.  (A non-finite sum of finite entries, an overflow, is told
    # apart by the exact check below and passes.)
    clients = stacked[:, : n * r].reshape(len(names), n, r * k)
    if not bool(torch.isfinite(clients.sum(dim=2)).all()):
        finite = torch.isfinite(clients).all(dim=2)
        if not bool(finite.all()):
            b, i = (int(x) for x in torch.nonzero(~finite)[0])
            raise AggregationInputError(f"{names[b]}[client {i}]: contains NaN/Inf entries")
    return stacked


def host_pool() -> ThreadPoolExecutor:
    """The process's threads for host-side batched work (filling the stack, small LAPACK
    problems): one per core, at most 16, created on first use."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(POOL_WORKERS, "florg-server")
        return _POOL


POOL_WORKERS = min(16, os.cpu_count() or 1)
_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def fill_stack(
    host: np.ndarray,
    names: Sequence[str],
    mats: Mapping[str, list[np.ndarray]],
    prevs: Mapping[str, np.ndarray],
) -> None:
    """Writes layer b's A_1; ...; A_N; A_prev into host[b], layers spread over the host
    pool's threads (NumPy's copies release the GIL)."""
    n, r = len(mats[names[0]]), prevs[names[0]].shape[0]

    def fill(part: range) -> None:
        for b in part:
            name = names[b]
            for i, a in enumerate(mats[name]):
                host[b, i * r : (i + 1) * r] = a
            host[b, n * r :] = prevs[name]

    parts = [p for p in _split(len(names), POOL_WORKERS) if len(p)]
    if len(parts) <= 1:  # one layer or one core: no pool to start
        fill(range(len(names)))
    else:
        list(host_pool().map(fill, parts))


def _split(count: int, parts: int) -> list[range]:
    """range(count) in ``parts`` contiguous pieces of near-equal size."""
    bounds = np.linspace(0, count, parts + 1).round().astype(int)
    return [range(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


# Where the host pool beats cuSOLVER (H100 machine, 16 host threads; lab/evidence/
# gpu-h100/server-step-2/eigh_sizes.txt): batches of at least HOST_EIGH_MIN_BATCH matrices of
# 33..HOST_EIGH_MAX rows (64 of 160 x 160: eigvalsh 7.8 ms against 69.6, eigh 16.6 against
# 76.4; at 512 rows the two are even, at 8 matrices of 160 the GPU wins).  Up to 32 x 32
# torch batches the problems on the GPU with Jacobi.
HOST_EIGH_MAX = 320
HOST_EIGH_MIN_BATCH = 16


@contextmanager
def _one_lapack_thread() -> Iterator[None]:
    """torch's (and its LAPACK's) CPU threads set to one while the host pool runs, then
    restored: sixteen pool threads each starting sixteen LAPACK threads made the host
    route sixteen times slower (H100 machine, 64 Grams of 160 x 160: 155 ms against 9.8)."""
    with _THREADS_LOCK:
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(before)


_THREADS_LOCK = threading.Lock()


def batched_eigh(
    S: torch.Tensor, vectors: bool, on_host: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """torch.linalg.eigh (or eigvalsh) of a batch of symmetric matrices, ascending, on
    S's device.  ``on_host`` None: on CUDA, batches of at least HOST_EIGH_MIN_BATCH
    matrices of 33..HOST_EIGH_MAX rows are solved on the host, the batch split over the
    host pool's threads, and copied back (cuSOLVER solves each matrix above 32 x 32 on its
    own, a chain of small kernels; the comment above ``HOST_EIGH_MAX``); True / False force
    the route (tests)."""
    n = S.shape[-1]
    if on_host is None:
        on_host = (
            S.device.type == "cuda"
            and 32 < n <= HOST_EIGH_MAX
            and S.shape[0] >= HOST_EIGH_MIN_BATCH
        )
    if not on_host:
        if vectors:
            return torch.linalg.eigh(S)
        return torch.linalg.eigvalsh(S), None
    host = S.cpu()
    pool = host_pool()
    parts = [p for p in _split(S.shape[0], POOL_WORKERS) if len(p)]

    def solve(part: range) -> tuple[torch.Tensor, torch.Tensor | None]:
        block = host[part.start : part.stop]
        if vectors:
            return torch.linalg.eigh(block)
        return torch.linalg.eigvalsh(block), None

    with _one_lapack_thread():
        results = list(pool.map(solve, parts))
    lam = torch.cat([lam for lam, _ in results]).to(S.device, non_blocking=True)
    if not vectors:
        return lam, None
    U = torch.cat([u for _, u in results if u is not None]).to(S.device, non_blocking=True)
    return lam, U


def gram_and_cross(T: torch.Tensor, rows: int) -> torch.Tensor:
    """T T[:, :rows]^T for the stack T = [A; A_prev]: [[A A^T], [A_prev A^T]] per layer.

    On CPU through NumPy's matmul on the same memory (no copy): it recognises T T^T and
    calls BLAS ``syrk``, half the flops of torch's ``bmm``, which has no symmetric variant
    (measured: 227 ms vs 357 ms for 64 layers of 160 x 4096, one thread).  On CUDA, bmm.
    """
    if T.device.type == "cpu":
        Tn = T.numpy()
        return torch.from_numpy(np.matmul(Tn, Tn.transpose(0, 2, 1)))[:, :, :rows]
    return T @ T[:, :rows].mT


def times_stack(C: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    """C @ A for a few rows C (B x m x Nr) times the stack A (B x Nr x k).

    On CPU through NumPy's matmul (OpenBLAS runs this skinny product about twice as fast
    as torch's bmm here); on CUDA, bmm.
    """
    if C.device.type == "cpu":
        return torch.from_numpy(np.matmul(C.contiguous().numpy(), A.numpy()))
    return C @ A
