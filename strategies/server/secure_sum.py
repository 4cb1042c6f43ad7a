"""SecAgg+ secure summation on Flower's Message API: ``secure_sum`` drives the four stages.

Design: Flower's ``SecAggPlusWorkflow`` runs only in a LegacyContext; this is its server side
over ``Grid.send_and_receive``, against flower_app/secure/secaggplus_client.py, with Flower's
stage keys, Shamir shares, key agreement, masks and quantisation (no cryptography of ours).
Each client uploads its weighted contribution (w x per array, and w) quantised and masked;
the server adds the masked vectors, removes the survivors' self masks and the dropped
clients' pairwise masks (rebuilt from threshold-many key shares) and dequantises: it learns
sum w x and sum w over the survivors, never one client's vector. A client lost after sharing
its keys does not stop the round; too few live neighbours or shares raise
``SecureSumFailed``. The collect stage can carry each node's training message (the client
trains, then masks). Settings: flower_app/secure/settings.py; docs/secure-aggregation.md.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.app.message_type import MessageType
from flwr.common import bytes_to_ndarray
from flwr.common.secure_aggregation.crypto.shamir import combine_shares
from flwr.common.secure_aggregation.crypto.symmetric_encryption import generate_shared_key
from flwr.common.secure_aggregation.ndarrays_arithmetic import (
    get_parameters_shape,
    parameters_addition,
    parameters_mod,
    parameters_subtraction,
)
from flwr.common.secure_aggregation.quantization import dequantize
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen
from flwr.serverapp import Grid
from flwr.supercore.primitives.asymmetric import bytes_to_private_key, bytes_to_public_key

from flower_app.secure.secaggplus_client import KEY_CONTRIBUTION_NAMES, WEIGHT_KEY
from flower_app.secure.settings import SecAggPlusSettings
from flower_app.wire.deployment_bytes import wire_bytes
from strategies.server.secure_outcome import (
    SecureSumFailed,
    SecureSumReport,
    SecureSumResult,
    SecureSumTraffic,
)

log = logging.getLogger("flwr.florg")  # propagates to Flower's console handler


def resolve_shares(settings: SecAggPlusSettings, num_nodes: int) -> tuple[int, int]:
    """(shares, threshold) for ``num_nodes`` nodes, as Flower's workflow resolves them: the
    shares made odd (a symmetric neighbourhood), at most the nodes, all of them when two or
    fewer; the threshold at least 2 and at most the shares (else ``SecureSumFailed``)."""
    if num_nodes < 2:
        raise SecureSumFailed(f"secure summation needs at least 2 nodes, got {num_nodes}")
    shares = settings.num_shares
    shares = round(shares * num_nodes) if isinstance(shares, float) else shares
    shares = min(shares, num_nodes)
    if shares < num_nodes and shares % 2 == 0:
        shares += 1
    if shares <= 2:
        shares = num_nodes
    threshold = settings.reconstruction_threshold
    if isinstance(threshold, float):
        threshold = max(round(threshold * shares), 2)
    if threshold > shares:
        raise SecureSumFailed(
            f"reconstruction_threshold {threshold} exceeds the {shares} shares "
            f"{num_nodes} nodes allow"
        )
    return shares, threshold


def secure_sum(
    grid: Grid,
    nodes: Sequence[int],
    contribution_keys_and_shapes: Mapping[str, tuple[int, ...]],
    settings: SecAggPlusSettings,
    *,
    group_id: str = "",
    message_type: str = MessageType.TRAIN,
    rng: random.Random | None = None,
    collect_content: Mapping[int, RecordDict] | None = None,
    traffic: SecureSumTraffic | None = None,
) -> SecureSumResult:
    """Sum the weighted contributions of ``nodes`` by SecAgg+ (four send-and-receive
    exchanges). ``contribution_keys_and_shapes``: the arrays each client sends (the weight
    entry is added); ``rng`` shuffles the neighbourhoods (OS entropy by default);
    ``collect_content``: records each node's collect-stage message also carries (its
    training message); ``traffic``: filled with the bytes and the collect replies."""
    shapes = {name: tuple(shape) for name, shape in contribution_keys_and_shapes.items()}
    if shapes.setdefault(WEIGHT_KEY, (1,)) != (1,):
        raise ValueError(f"{WEIGHT_KEY!r} is the weight entry, of shape (1,)")
    sampled = sorted(set(nodes))
    if len(sampled) != len(nodes):
        raise ValueError("the nodes must be distinct")
    num_shares, threshold = resolve_shares(settings, len(sampled))
    if len(sampled) * settings.quantization_range >= settings.modulus_range:
        raise ValueError(
            f"{len(sampled)} nodes x quantization_range {settings.quantization_range} must "
            f"stay below modulus_range {settings.modulus_range}, or the sum wraps around"
        )
    order = list(sampled)
    (rng or random.SystemRandom()).shuffle(order)
    half = num_shares >> 1
    neighbours = {
        nid: {order[(idx + offset) % len(order)] for offset in range(-half, half + 1)}
        for idx, nid in enumerate(order)
    }
    report = SecureSumReport(tuple(sampled), num_shares=num_shares, threshold=threshold)
    traffic = SecureSumTraffic() if traffic is None else traffic
    run = _Run(grid, settings, sampled, neighbours, threshold, group_id, message_type, report,
               dict(collect_content or {}), traffic)  # fmt: skip
    return run.execute(dict(sorted(shapes.items())))


@dataclass
class _Run:
    """One secure sum's server state, stage by stage (Flower's ``WorkflowState``)."""

    grid: Grid
    settings: SecAggPlusSettings
    sampled: list[int]
    neighbours: dict[int, set[int]]  # node -> its neighbourhood, itself included
    threshold: int
    group_id: str
    message_type: str
    report: SecureSumReport
    collect_content: dict[int, RecordDict]  # node -> what its collect message also carries
    traffic: SecureSumTraffic
    errors: dict[int, str] = field(default_factory=dict)  # node -> why its reply was refused

    def _exchange(self, stage: str, configs: dict[int, dict[str, Any]]) -> dict[int, ConfigRecord]:
        """Send each node its stage configs; the valid replies by node (errors recorded)."""
        messages = []
        for nid, cfg in configs.items():
            content = RecordDict()
            if stage == Stage.COLLECT_MASKED_VECTORS:  # the round's training message
                for name, record in self.collect_content.get(nid, RecordDict()).items():
                    content[name] = record
            content[RECORD_KEY_CONFIGS] = ConfigRecord({Key.STAGE: stage, **cfg})
            messages.append(
                Message(
                    content, dst_node_id=nid, message_type=self.message_type, group_id=self.group_id
                )  # fmt: skip
            )
            down = self.traffic.down_bytes
            down[nid] = down.get(nid, 0) + wire_bytes(messages[-1])
        replies: dict[int, ConfigRecord] = {}
        answered: set[int] = set()
        for reply in self.grid.send_and_receive(messages, timeout=self.settings.timeout):
            src = reply.metadata.src_node_id
            if src not in configs or src in answered:
                continue  # not asked, or a second reply
            answered.add(src)
            self.traffic.up_bytes[src] = self.traffic.up_bytes.get(src, 0) + wire_bytes(reply)
            if stage == Stage.COLLECT_MASKED_VECTORS:
                self.traffic.collected[src] = reply
            if reply.has_error():
                self.errors[src] = f"{stage}: {reply.error.reason}"
            elif RECORD_KEY_CONFIGS not in reply.content.config_records:
                self.errors[src] = f"{stage}: the reply carries no SecAgg+ configs"
            else:
                replies[src] = reply.content.config_records[RECORD_KEY_CONFIGS]
        log.debug("SecAgg+ %s: %d of %d nodes replied", stage, len(replies), len(configs))
        return replies

    def _fail(self, reason: str, **report: Any) -> SecureSumFailed:
        self._update(threshold_met=False, **report)
        log.warning("SecAgg+ failed: %s", reason)
        return SecureSumFailed(reason, self.report)

    def _update(self, **report: Any) -> None:
        fields = {**vars(self.report), **report, "errors": dict(self.errors)}
        self.report = SecureSumReport(**fields)

    def _require(self, owners: set[int], holders: set[int], when: str, **report: Any) -> None:
        """Each owner's secrets need ``threshold`` live holders in its neighbourhood."""
        for nid in sorted(owners):
            if (live := len(self.neighbours[nid] & holders)) < self.threshold:
                raise self._fail(
                    f"{when}: node {nid} has {live} live neighbours (itself included), below "
                    f"the reconstruction threshold {self.threshold}",
                    **report,
                )

    def execute(self, shapes: dict[str, tuple[int, ...]]) -> SecureSumResult:
        public_keys = self._setup()
        keyed = set(public_keys)
        self._require(keyed, keyed, "after setup")
        forward = self._share_keys(public_keys)
        shared = set(forward)
        before = tuple(sorted(set(self.sampled) - shared))
        self._require(shared, shared, "after share keys", dropped_before=before)
        total, survivors = self._collect(forward, shapes)
        dead = shared - survivors
        report = {
            "survivors": tuple(sorted(survivors)),
            "dropped_after_keys": tuple(sorted(dead)),
            "dropped_before": before,
        }
        if not survivors:
            raise self._fail("no node sent a valid masked vector", **report)
        self._require(survivors | dead, survivors, "after collecting masked vectors", **report)
        total = self._unmask(total, survivors, dead, public_keys, report)
        m = len(survivors)
        # sum_n q_n (2c/Q) - c = sum_n x_n + (m - 1) c: remove the surplus offsets.
        sums = dequantize(total, self.settings.clipping_range, self.settings.quantization_range)
        offset = -(m - 1) * self.settings.clipping_range
        named = {name: arr + offset for name, arr in zip(shapes, sums, strict=True)}
        weight_sum = float(named.pop(WEIGHT_KEY)[0])
        self._update(threshold_met=True, **report)
        log.info("SecAgg+: summed %d contributions (%d dropped)", m, len(self.sampled) - m)
        return SecureSumResult(named, weight_sum, self.report)

    def _setup(self) -> dict[int, tuple[bytes, bytes]]:
        s = self.settings
        cfg = {
            Key.SAMPLE_NUMBER: len(self.sampled),
            Key.SHARE_NUMBER: self.report.num_shares,
            Key.THRESHOLD: self.threshold,
            Key.CLIPPING_RANGE: float(s.clipping_range),
            Key.TARGET_RANGE: s.quantization_range,
            Key.MOD_RANGE: s.modulus_range,
            Key.MAX_WEIGHT: float(s.max_weight),
        }
        replies = self._exchange(Stage.SETUP, {nid: cfg for nid in self.sampled})
        public_keys = {}
        for nid, rec in replies.items():
            pk1, pk2 = rec.get(Key.PUBLIC_KEY_1), rec.get(Key.PUBLIC_KEY_2)
            if isinstance(pk1, bytes) and isinstance(pk2, bytes):
                public_keys[nid] = (pk1, pk2)
            else:
                self.errors[nid] = f"{Stage.SETUP}: the reply lacks its two public keys"
        return public_keys

    def _share_keys(
        self, public_keys: dict[int, tuple[bytes, bytes]]
    ) -> dict[int, list[tuple[int, bytes]]]:
        """Broadcast each neighbourhood's public keys; the encrypted shares to forward, by
        destination (only between nodes that both shared)."""
        keyed = set(public_keys)
        configs = {
            nid: {str(j): list(public_keys[j]) for j in self.neighbours[nid] & keyed}
            for nid in keyed
        }
        replies = self._exchange(Stage.SHARE_KEYS, configs)
        outgoing: dict[int, list[tuple[int, bytes]]] = {}
        for src, rec in replies.items():
            dsts, ctxts = rec.get(Key.DESTINATION_LIST), rec.get(Key.CIPHERTEXT_LIST)
            expected = (self.neighbours[src] & keyed) - {src}
            # Every neighbour must get a share: a missing one would leave one side of a
            # pairwise mask uncancelled.
            if (
                not isinstance(dsts, list)
                or not isinstance(ctxts, list)
                or len(dsts) != len(ctxts)
                or len(set(dsts)) != len(dsts)
                or set(dsts) != expected
            ):
                self.errors[src] = f"{Stage.SHARE_KEYS}: not one share per live neighbour"
                continue
            outgoing[src] = list(zip(cast(list[int], dsts), cast(list[bytes], ctxts), strict=True))
        forward: dict[int, list[tuple[int, bytes]]] = {nid: [] for nid in outgoing}
        for src, pairs in outgoing.items():
            for dst, ciphertext in pairs:
                if dst in forward:
                    forward[dst].append((src, ciphertext))
        return forward

    def _collect(
        self, forward: dict[int, list[tuple[int, bytes]]], shapes: dict[str, tuple[int, ...]]
    ) -> tuple[list[np.ndarray], set[int]]:
        """Forward the shares, collect and add up the masked vectors (mod the modulus)."""
        configs = {
            nid: {
                Key.CIPHERTEXT_LIST: [ciphertext for _, ciphertext in pairs],
                Key.SOURCE_LIST: [src for src, _ in pairs],
            }
            for nid, pairs in forward.items()
        }
        replies = self._exchange(Stage.COLLECT_MASKED_VECTORS, configs)
        total = [np.zeros(shape, dtype=np.int64) for shape in shapes.values()]
        survivors = set()
        for nid, rec in replies.items():
            vector = self._masked_vector(rec, shapes)
            if isinstance(vector, str):
                self.errors[nid] = f"{Stage.COLLECT_MASKED_VECTORS}: {vector}"
                continue
            total = parameters_mod(parameters_addition(total, vector), self.settings.modulus_range)
            survivors.add(nid)
        return total, survivors

    def _masked_vector(
        self, rec: ConfigRecord, shapes: dict[str, tuple[int, ...]]
    ) -> list[np.ndarray] | str:
        """A reply's masked vector, or why it is refused (then that node counts as dropped)."""
        if rec.get(KEY_CONTRIBUTION_NAMES) != list(shapes):
            return f"the arrays are not {list(shapes)}"
        blobs = rec.get(Key.MASKED_PARAMETERS)
        if not isinstance(blobs, list) or len(blobs) != len(shapes):
            return "not one masked array per name"
        vector = [bytes_to_ndarray(blob) for blob in cast(list[bytes], blobs)]
        for (name, shape), arr in zip(shapes.items(), vector, strict=True):
            if arr.shape != shape or arr.dtype.kind not in "iu":
                return f"{name!r}: {arr.dtype} {arr.shape}, expected integers {shape}"
            if arr.size and (arr.min() < 0 or arr.max() >= self.settings.modulus_range):
                return f"{name!r}: values outside [0, modulus_range)"
        return [arr.astype(np.int64) for arr in vector]

    def _unmask(
        self,
        total: list[np.ndarray],
        survivors: set[int],
        dead: set[int],
        public_keys: dict[int, tuple[bytes, bytes]],
        report: dict[str, Any],
    ) -> list[np.ndarray]:
        """Collect the survivors' mask-seed shares and the dropped nodes' private-key shares,
        rebuild the secrets and remove their masks from the sum."""
        configs = {
            nid: {
                Key.ACTIVE_NODE_ID_LIST: sorted(self.neighbours[nid] & survivors),
                Key.DEAD_NODE_ID_LIST: sorted(self.neighbours[nid] & dead),
            }
            for nid in survivors
        }
        replies = self._exchange(Stage.UNMASK, configs)
        report["silent_at_unmask"] = tuple(sorted(survivors - set(replies)))
        shares: dict[int, list[bytes]] = {nid: [] for nid in survivors | dead}
        for nid, rec in replies.items():
            owners, values = rec.get(Key.NODE_ID_LIST), rec.get(Key.SHARE_LIST)
            asked = set(configs[nid][Key.ACTIVE_NODE_ID_LIST] + configs[nid][Key.DEAD_NODE_ID_LIST])
            if not (
                isinstance(owners, list)
                and isinstance(values, list)
                and len(owners) == len(values)
                and len(set(owners)) == len(owners)
                and set(owners) <= asked
            ):
                self.errors[nid] = f"{Stage.UNMASK}: the shares do not match the request"
                continue
            for owner, share in zip(
                cast(list[int], owners), cast(list[bytes], values), strict=True
            ):
                shares[owner].append(share)
        for owner, owned in sorted(shares.items()):
            if len(owned) < self.threshold:
                raise self._fail(
                    f"unmask: {len(owned)} shares of node {owner}'s secret, below the "
                    f"reconstruction threshold {self.threshold}",
                    **report,
                )
        dims = get_parameters_shape(total)
        mod = self.settings.modulus_range
        try:
            for nid in sorted(survivors):  # the self masks
                total = parameters_subtraction(
                    total, pseudo_rand_gen(combine_shares(shares[nid]), mod, dims)
                )
            for nid in sorted(dead):  # the pairwise masks the survivors added for them
                private_key = bytes_to_private_key(combine_shares(shares[nid]))
                for other in sorted(self.neighbours[nid] & survivors):
                    shared_key = generate_shared_key(
                        private_key, bytes_to_public_key(public_keys[other][0])
                    )
                    mask = pseudo_rand_gen(shared_key, mod, dims)
                    if nid > other:  # the survivor subtracted it
                        total = parameters_addition(total, mask)
                    else:
                        total = parameters_subtraction(total, mask)
        except ValueError as exc:  # shares that do not combine into a valid secret
            raise self._fail(f"unmask: a secret could not be rebuilt ({exc})", **report) from exc
        return parameters_mod(total, mod)
