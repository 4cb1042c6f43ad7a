"""Core benchmark: the problem shapes, sizes and repetition counts of one run (``Settings``,
the full and the ``--quick`` ones), passed to the workers as JSON."""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

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
