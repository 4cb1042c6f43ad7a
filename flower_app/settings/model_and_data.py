"""Settings: what runs (the method, the model, the task) and its data, and the adapter."""

from __future__ import annotations

from dataclasses import dataclass

from flower_app.methods.registry import RegisteredMethod
from flower_app.settings import DATA, MODEL, TOKENISATION, setting
from flower_app.settings.checks import (
    empty,
    non_negative,
    one_of,
    positive,
    rank_list,
)


@dataclass(frozen=True)
class WhatRuns:
    """Settings: what runs: the method, the model and the task."""

    preset: str = setting(
        "",
        "must be '': a preset is the file conf/NAME.toml, --run-config conf/NAME.toml",
        check=empty,
        affects=(),
    )
    method: str = setting(
        "florg",
        "federated method (strategies/)",
        check=RegisteredMethod(),
        affects=(MODEL,),
    )
    model: str = setting(
        "all-MiniLM-L6-v2",
        "Hub name, local folder or registered name",
        affects=(MODEL, TOKENISATION),
    )
    task: str = setting(
        "snli", "task name (GLUE, registered local task) or 'local'", affects=(DATA,)
    )
    task_kind: str = setting(
        "",
        "task kind (flower_app/task_kinds/: classification, extractive-qa, causal-lm); "
        "'' = the task's own (local data: classification)",
        affects=(DATA,),
    )
    seed: int = setting(
        0,
        "run seed (L, R, A init, partitioning, shuffling)",
        check=non_negative,
        affects=(MODEL, DATA),
    )


@dataclass(frozen=True)
class LocalData:
    """Settings: local data (task 'local')."""

    data_path: str = setting("", "local data file/folder for task 'local'", affects=(DATA,))
    text_fields: str = setting("", "comma-separated text columns for task 'local'", affects=(DATA,))
    label_field: str = setting("label", "label column for task 'local'", affects=(DATA,))
    num_labels: int = setting(
        0,
        "label count for task 'local' (0 = infer)",
        check=non_negative,
        affects=(DATA,),
    )


@dataclass(frozen=True)
class DataSettings:
    """Settings: the data each client gets, and the evaluation splits."""

    partitioner: str = setting(
        "iid", "how data is split", check=one_of("dirichlet", "iid"), affects=(DATA,)
    )
    dirichlet_alpha: float = setting(
        0.5, "Dirichlet concentration rho", check=positive, affects=(DATA,)
    )
    max_train_examples: int = setting(
        2000, "training pool size (0 = all)", check=non_negative, affects=(DATA,)
    )
    max_eval_examples: int = setting(
        1000, "validation subset size (0 = all)", check=non_negative, affects=(DATA,)
    )
    max_test_examples: int = setting(
        0,
        "held-out test subset scored by the server (0 = no test)",
        check=non_negative,
        affects=(DATA,),
    )
    max_seq_length: int = setting(
        128, "tokeniser max length", check=positive, affects=(TOKENISATION,)
    )
    prompt_template: str = setting(
        "plain",
        "causal-lm: the prompt's layout, 'plain' text or the tokenizer's 'chat' template",
        check=one_of("plain", "chat"),
        affects=(TOKENISATION,),
    )
    prompt_format: str = setting(
        "alpaca",
        "causal-lm instruction data: 'alpaca' (### Instruction / ### Input / ### Response "
        "sections) or 'flowertune' (the FlowerTune LLM templates' prompt: their preamble, the "
        "text-fields joined by a space as the instruction, '### Response:')",
        check=one_of("alpaca", "flowertune"),
        affects=(DATA,),
    )
    max_new_tokens: int = setting(
        32,
        "causal-lm: greedy generation's length limit when scoring gen-exact-match / gen-f1",
        check=positive,
        affects=(),
    )
    doc_stride: int = setting(
        64,
        "extractive QA: token overlap of context windows",
        check=non_negative,
        affects=(TOKENISATION,),
    )


@dataclass(frozen=True)
class AdapterSettings:
    """Settings: the adapter (flower_app/adapters/) and the clients' ranks
    (flower_app/settings/client_ranks.py)."""

    target_modules: str = setting(
        "",
        "comma-separated module names to adapt ('' = the task kind's own: query,value; "
        "q_proj,v_proj for causal-lm); a value given always wins",
        affects=(MODEL,),
    )
    head_modules: str = setting(
        "", "comma-separated task-head modules ('' = auto)", affects=(MODEL,)
    )
    train_head: bool = setting(True, "train and FedAvg the task head", affects=(MODEL,))
    rank: int = setting(4, "adapter rank r", check=positive, affects=(MODEL,))
    alpha: float = setting(
        16.0,
        "scaling numerator: s = alpha / r (LoRA-SB keeps its authors' s = 1 whatever alpha)",
        check=positive,
        affects=(MODEL,),
    )
    client_ranks: str = setting(
        "",
        "per-client adapter ranks, a comma list cycled over partition ids ('' = every "
        "client uses rank; a SuperNode's node-config rank=R wins); s = alpha / rank for all",
        check=rank_list,
        affects=(),
    )
    a_init_std: float = setting(
        0.02,
        "FLoRG: std of the initial A (A = 0 is excluded)",
        check=positive,
        affects=(MODEL,),
    )
    projection_init: str = setting(
        "semi-orthogonal",
        "FLoRG: initialisation of L and R",
        check=one_of("semi-orthogonal", "kaiming", "svd"),
        affects=(MODEL,),
    )
    subtract_init: bool = setting(False, "FLoRG: subtract s L A1^T A1 R from W0", affects=(MODEL,))
    projection_sharing: str = setting(
        "shape",
        "FLoRG: one L, R per layer shape (from seed + shape) or per module (seed + name)",
        check=one_of("shape", "module"),
        affects=(MODEL,),
    )
