"""The run settings' declarations, grouped by what they configure.

Each group is a frozen dataclass of ``setting(...)`` fields, in the module of its concern:
``model_and_data.py`` (the method, the model, the task and its data, the adapter),
``rounds.py`` (the federation, local training, precision, evaluation, screening),
``privacy.py`` (central DP and DP-SGD), ``secure.py`` (secure aggregation) and ``run.py``
(the run folder and console; the testing-only fault injection, apart). ``RunSettings``
(run_settings.py) is all of them together, so a setting has one declaration and one obvious
group; ``RunConfig`` (config.py) adds the registered methods' own. ``setting`` records a
field's help, the check of its values and the cached artefacts it ``affects``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import field
from typing import Any

# Groups of settings a derived artefact depends on; every setting names the groups it
# affects (``affects=``, required, so a new setting cannot be forgotten by the caches in
# flower_app/cache/disk.py: their keys hash every setting of their groups).
DATA = "data"  # which examples there are and which of them each client gets
TOKENISATION = "tokenisation"  # how examples become model inputs (the tokeniser, lengths)
MODEL = "model"  # the adapted model before any training (base model, adapter, init)
GROUPS = (DATA, TOKENISATION, MODEL)


def setting(
    default: Any,
    help: str,  # noqa: A002 - the word the generated pyproject comments use
    *,
    affects: tuple[str, ...],
    check: Callable[[Any], bool] | None = None,
) -> Any:
    """One run setting: a ``RunConfig`` field carrying its default, its help, the check of
    its values and the groups (``DATA``, ``TOKENISATION``, ``MODEL``) it ``affects``
    (``()``: it changes how a run is carried out, not what is built before training)."""
    unknown = set(affects) - set(GROUPS)
    if unknown:
        raise ValueError(f"unknown setting group(s) {sorted(unknown)}; groups: {GROUPS}")
    metadata = {"help": help, "check": check, "affects": frozenset(affects)}
    return field(default=default, metadata=metadata)
