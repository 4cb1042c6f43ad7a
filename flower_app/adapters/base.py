"""What an adapter kind is: the trainable structure a method's clients add to each targeted
W0, as one object that owns its parts and their shapes, how it is injected and initialised
from the run's settings, what of it travels, and how it is exported.

A kind is one module in this folder ending with ``KINDS = (...)`` plus its line in
``KIND_MODULES`` (``__init__.py``). A method names its kind (``Method.adapter``); the
adapted model (``flower_app/adapted.py``), the method contract's checks and the
communication count ask the kind and never test its name.

Kind modules import nothing heavy at module level (torch, PEFT and the layers are imported
inside the hooks): the method registry validates each method's parts against its kind when
the run config is read, which must cost nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # types only: the settings and the methods import this module
    from torch.nn import Module as Model

    from flower_app.methods.contract import Method
    from flower_app.settings.run_settings import RunSettings


@dataclass(frozen=True)
class Part:
    """One matrix of a layer's adapter: its state key suffix ('<layer>.<key>') and its shape
    for a W0 of d_out x d_in at rank r."""

    key: str
    shape: Callable[[int, int, int], tuple[int, ...]]


@dataclass(frozen=True)
class AdapterKind:
    """One adapter kind; subclass it and implement the model hooks."""

    name: str
    summary: str
    parts: Mapping[str, Part]

    # -- parts and shapes (read by the method contract and the communication count) -------
    def part_key(self, part: str) -> str:
        return self.parts[part].key

    def part_params(self, parts: Iterable[str], d_out: int, d_in: int, r: int) -> int:
        """The parameters of ``parts`` of one layer of W0 d_out x d_in at rank r."""
        return sum(int(np.prod(self.parts[p].shape(d_out, d_in, r))) for p in parts)

    def part_rows(self, parts: Iterable[str], d_out: int, d_in: int, r: int) -> int:
        """The rows of ``parts`` of one layer (a 1-D part is one row): int8 messages carry a
        float32 scale per row (flower_app/wire/encoding.py)."""
        shapes = [self.parts[p].shape(d_out, d_in, r) for p in parts]
        return sum(int(shape[0]) if len(shape) > 1 else 1 for shape in shapes)

    def check_method(self, method: Method) -> None:
        """A method's declared parts are this kind's, and it shares at least one."""
        declared = set(method.shared) | set(method.local) | set(method.frozen)
        if not declared <= set(self.parts) or not method.shared:
            raise ValueError(
                f"method {method.name!r}: parts of a {self.name} adapter are "
                f"{sorted(self.parts)}; shared={method.shared} local={method.local} "
                f"frozen={method.frozen}"
            )

    # -- settings ------------------------------------------------------------------------
    def check_settings(self, config: RunSettings, method: Method) -> None:
        """Checks of the run's settings this kind needs, each ValueError naming its key."""

    def check_node_rank(self, config: RunSettings, r: int, r_max: int) -> None:
        """A node training at rank ``r`` in a run whose largest rank is ``r_max``: ValueError
        when this kind cannot (the message names the setting)."""

    # -- the model -------------------------------------------------------------------------
    def inject(self, model: Model, config: RunSettings, method: Method) -> Model:
        """The adapter injected into ``model`` (in place where the kind can), initialised
        from the run's settings; returns the model carrying it."""
        raise NotImplementedError

    def shared_state(
        self, model: Model, config: RunSettings, method: Method
    ) -> dict[str, np.ndarray]:
        """What travels (client -> server -> client): the method's shared parts and the head,
        as float32 arrays by state key."""
        raise NotImplementedError

    def load_shared_state(
        self,
        model: Model,
        arrays: Mapping[str, np.ndarray],
        config: RunSettings,
        method: Method,
    ) -> None:
        """Load ``arrays`` (the keys and shapes of ``shared_state``, exactly)."""
        raise NotImplementedError

    def train_parts(self, model: Model, trained: set[str]) -> None:
        """Train ``trained`` of the parts and freeze the others (a kind with one trained
        matrix has nothing to freeze)."""

    def local_state(self, model: Model, parts: tuple[str, ...]) -> dict[str, np.ndarray]:
        """A method's personal parts (``Method.local``), kept on the client."""
        raise NotImplementedError(f"a {self.name} adapter keeps no personal parts")

    def load_local_state(
        self, model: Model, arrays: Mapping[str, np.ndarray], parts: tuple[str, ...]
    ) -> None:
        raise NotImplementedError(f"a {self.name} adapter keeps no personal parts")

    def delta_weights(self, model: Model) -> dict[str, tuple[Any, Any]]:
        """{layer: (its frozen weight, the adapter's update s x (its product))}, detached
        float64 tensors, for every adapted layer (analyses and benchmarks)."""
        raise NotImplementedError

    def subtracts_initial_update(self, config: RunSettings, method: Method) -> bool:
        """Whether injection subtracted the adapter's initial update from W0 (so the model
        starts at W0 and the frozen weight is W0 minus it)."""
        return False

    def fingerprint(self, model: Model) -> int:
        """An integer that identifies the fixed parts every node must share (0: none)."""
        return 0

    # -- export ----------------------------------------------------------------------------
    def save_peft(self, model: Model, out_dir: Path, base_model: str) -> Path:
        """The model as a PEFT LoRA folder for ``PeftModel.from_pretrained`` on the unchanged
        base ``base_model``."""
        raise NotImplementedError

    def export_peft(self, model: Model, out_dir: Path, base_model: str) -> bool:
        """Write the model as a standard PEFT LoRA folder where the kind is not PEFT's own
        (True); False for a PEFT adapter, whose arrays are saved as they are."""
        return False
