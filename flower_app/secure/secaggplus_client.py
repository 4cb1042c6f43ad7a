"""SecAgg+ on the client: one node's answer to each stage of Flower's SecAgg+ protocol.

``secaggplus_client(msg, context, contribution)`` answers one stage message (``setup``,
``share_keys``, ``collect_masked_vectors``, ``unmask``, the keys of Flower's
``secaggplus_constants``) and keeps the node's protocol state in ``context.state`` under
Flower's ``RECORD_KEY_STATE``, as Flower's ``secaggplus_mod`` does. Setup, share keys and
unmask are the mod's own stage functions. The collect stage masks a dict of float arrays, a
client's weighted contribution (``weighted_contribution``: w * x per key plus w under
``WEIGHT_KEY``), quantised with Flower's ``quantize`` and masked with the self mask and the
pairwise masks exactly as the mod does. The server: strategies/server/secure_sum.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, cast

import numpy as np
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.app.typing import ConfigRecordValues
from flwr.client.mod.secure_aggregation.secaggplus_mod import (
    SecAggPlusState,
    _setup,
    _share_keys,
    _unmask,
    check_configs,
    check_stage,
)
from flwr.common import ndarray_to_bytes
from flwr.common.secure_aggregation.crypto.symmetric_encryption import (
    decrypt,
    generate_shared_key,
)
from flwr.common.secure_aggregation.ndarrays_arithmetic import (
    parameters_addition,
    parameters_mod,
    parameters_subtraction,
)
from flwr.common.secure_aggregation.quantization import quantize
from flwr.common.secure_aggregation.secaggplus_constants import (
    RECORD_KEY_CONFIGS,
    RECORD_KEY_STATE,
    Key,
    Stage,
)
from flwr.common.secure_aggregation.secaggplus_utils import (
    pseudo_rand_gen,
    share_keys_plaintext_separate,
)
from flwr.supercore.primitives.asymmetric import bytes_to_private_key, bytes_to_public_key

# The contribution's entry holding the client's weight w (a one-entry array): its sum over
# the survivors is the denominator of the weighted mean.
WEIGHT_KEY = "secaggplus.weight"
# Not one of Flower's keys: the contribution's array names, in the order of the masked
# vectors under Key.MASKED_PARAMETERS (sorted), so the server can check what it adds up.
KEY_CONTRIBUTION_NAMES = "contribution_names"

# A contribution: array name -> float array (array-likes are accepted).
Contribution = Mapping[str, Any]
# Given as the arrays, or as a function computing them, called only at the collect stage
# (the later ClientApp trains there, as Flower's mod calls the next handler there).
ContributionSource = Contribution | Callable[[], Contribution]


def weighted_contribution(arrays: Contribution, weight: float) -> dict[str, np.ndarray]:
    """A client's contribution to a weighted sum: ``weight * x`` per array, plus the weight
    itself under ``WEIGHT_KEY``; the secure sum of these gives sum w x and sum w."""
    if WEIGHT_KEY in arrays:
        raise ValueError(f"the arrays may not use the reserved name {WEIGHT_KEY!r}")
    if isinstance(weight, bool) or not isinstance(weight, int | float):
        raise ValueError(f"the weight must be a number, got {weight!r}")
    if not math.isfinite(weight) or weight < 0:
        raise ValueError(f"the weight must be finite and >= 0, got {weight!r}")
    out = {name: weight * np.asarray(arr, dtype=np.float64) for name, arr in arrays.items()}
    out[WEIGHT_KEY] = np.array([weight], dtype=np.float64)
    return out


def secaggplus_client(
    msg: Message, context: Context, contribution: ContributionSource | None = None
) -> Message:
    """Answer one SecAgg+ stage message; ``contribution`` is read at the collect stage only.

    A stage out of order, a malformed config or a refused contribution raises (the ClientApp
    turns that into an error reply, which the server counts as this node dropping out)."""
    records = context.state.config_records
    if RECORD_KEY_STATE not in records:
        records[RECORD_KEY_STATE] = ConfigRecord({})
    state = SecAggPlusState(**records[RECORD_KEY_STATE])

    # A copy: the stage key is popped, and the incoming message stays as it was sent.
    configs = ConfigRecord(dict(msg.content.config_records[RECORD_KEY_CONFIGS]))
    check_stage(state.current_stage, configs)
    state.current_stage = cast(str, configs.pop(Key.STAGE))
    check_configs(state.current_stage, configs)

    if state.current_stage == Stage.SETUP:
        state.nid = msg.metadata.dst_node_id
        if Key.MAX_WEIGHT not in configs:  # the mod's _setup reads it unchecked
            raise KeyError(f"Stage {Stage.SETUP}: the required key '{Key.MAX_WEIGHT}' is missing")
        res = _setup(state, configs)
    elif state.current_stage == Stage.SHARE_KEYS:
        res = _share_keys(state, configs)
    elif state.current_stage == Stage.COLLECT_MASKED_VECTORS:
        if contribution is None:
            raise ValueError("the collect-masked-vectors stage needs the node's contribution")
        arrays = contribution() if callable(contribution) else contribution
        res = _collect_masked_vectors(state, configs, arrays)
    else:  # Stage.UNMASK (check_configs refuses any other stage)
        # Never both shares of one node: its mask seed and its private key together would
        # unmask its vector (the mod does not check this).
        active = set(cast(list[int], configs[Key.ACTIVE_NODE_ID_LIST]))
        if active & set(cast(list[int], configs[Key.DEAD_NODE_ID_LIST])):
            raise ValueError(f"Node {state.nid}: a node listed both active and dropped")
        res = _unmask(state, configs)

    # Saved only once the stage succeeded, as the mod does.
    records[RECORD_KEY_STATE] = ConfigRecord(state.to_dict())
    return Message(RecordDict({RECORD_KEY_CONFIGS: ConfigRecord(res, False)}), reply_to=msg)


def checked_contribution(
    contribution: Contribution, clipping_range: float, max_weight: float
) -> tuple[list[str], list[np.ndarray]]:
    """The names (sorted) and float64 arrays of a contribution, refused with a ValueError
    unless every value is finite and within [-clipping_range, clipping_range] (quantize
    would clip it silently, a wrong sum) and the weight is one value in [0, max_weight]."""
    if not isinstance(contribution, Mapping) or not contribution:
        raise ValueError("the contribution must be a non-empty mapping name -> array")
    if WEIGHT_KEY not in contribution:
        raise ValueError(
            f"the contribution has no weight ({WEIGHT_KEY!r}): see weighted_contribution"
        )
    names = sorted(contribution)
    if not all(isinstance(name, str) for name in names):
        raise ValueError("the contribution's names must be strings")
    arrays = []
    for name in names:
        arr = np.asarray(contribution[name], dtype=np.float64)
        if not np.all(np.isfinite(arr)):
            raise ValueError(f"contribution {name!r}: contains NaN/Inf entries")
        # The error reaches the server as the reason of an error reply: name the array
        # and the range, never the values.
        if arr.size and float(np.max(np.abs(arr))) > clipping_range:
            raise ValueError(
                f"contribution {name!r}: values beyond the clipping range {clipping_range:g}; "
                "scale it down (a smaller weight) or raise clipping_range"
            )
        arrays.append(arr)
    weight = arrays[names.index(WEIGHT_KEY)]
    if weight.shape != (1,) or not 0 <= weight[0] <= max_weight:
        raise ValueError(
            f"the weight ({WEIGHT_KEY!r}) must be one value in [0, max_weight={max_weight:g}]"
        )
    return names, arrays


def _collect_masked_vectors(
    state: SecAggPlusState, configs: ConfigRecord, contribution: Contribution
) -> dict[str, ConfigRecordValues]:
    """The mod's ``_collect_masked_vectors`` for a weighted float contribution: store the
    neighbours' key shares, quantise, add the self mask and the pairwise masks, mod."""
    ciphertexts = cast(list[bytes], configs[Key.CIPHERTEXT_LIST])
    srcs = cast(list[int], configs[Key.SOURCE_LIST])
    if len(ciphertexts) != len(srcs):
        raise ValueError("the ciphertext and source lists differ in length")
    if len(ciphertexts) + 1 < state.threshold:
        raise ValueError("Not enough available neighbour clients.")

    # Decrypt each neighbour's shares of its mask seed and first private key, checking
    # that they come from whom the server says and are meant for this node.
    neighbours: list[int] = []
    for src, ciphertext in zip(srcs, ciphertexts, strict=True):
        if src not in state.ss2_dict:
            raise ValueError(f"Node {state.nid}: key shares from node {src}, not a neighbour")
        plaintext = decrypt(state.ss2_dict[src], ciphertext)
        actual_src, dst, rd_seed_share, sk1_share = share_keys_plaintext_separate(plaintext)
        if actual_src != src or dst != state.nid:
            raise ValueError(
                f"Node {state.nid}: shares from node {actual_src} for node {dst}, "
                f"forwarded as from node {src}"
            )
        state.rd_seed_share_dict[src] = rd_seed_share
        state.sk1_share_dict[src] = sk1_share
        neighbours.append(src)

    names, arrays = checked_contribution(contribution, state.clipping_range, state.max_weight)
    # Stochastic quantisation of [-c, c] onto [0, target_range] (Flower's quantize).
    masked = quantize(arrays, state.clipping_range, state.target_range)
    dimensions = [arr.shape for arr in masked]

    # The self mask, from the seed whose shares the neighbours hold.
    self_mask = pseudo_rand_gen(state.rd_seed, state.mod_range, dimensions)
    masked = parameters_addition(masked, self_mask)
    # One pairwise mask per neighbour, added by the larger node ID and subtracted by the
    # smaller: they cancel in the sum of two survivors.
    private_key = bytes_to_private_key(state.sk1)
    for node_id in neighbours:
        shared_key = generate_shared_key(
            private_key, bytes_to_public_key(state.public_keys_dict[node_id][0])
        )
        pairwise_mask = pseudo_rand_gen(shared_key, state.mod_range, dimensions)
        if state.nid > node_id:
            masked = parameters_addition(masked, pairwise_mask)
        else:
            masked = parameters_subtraction(masked, pairwise_mask)
    masked = parameters_mod(masked, state.mod_range)
    return {
        Key.MASKED_PARAMETERS: [ndarray_to_bytes(arr) for arr in masked],
        KEY_CONTRIBUTION_NAMES: names,
    }
