"""FedSBStrategy: the common strategy (R and the head averaged every round) plus round 0, the
federated initialisation of the fixed B and A, and their delivery to every node.

Round 0 (``initialise``, run by ``start`` before Flower's loop, only in a fresh run): a
QUERY message to the nodes a training round would sample; each answers with its summed
gradient of every adapted W0 (``gradient.py``). The server checks the replies
(``check_gradients``), adds them up and divides by the examples they cover, whatever
``aggregation-weights``, then per layer ``rule.initial_factors``: B and A kept here, R =
S_r the global R. Under dp=central round 0 is one more Gaussian mechanism recorded by the
accountant. Under secure aggregation round 0 is one SecAgg+ sum (``secure_round_0``): the
server learns only the sums. B and A travel once per node until its reply's ``basis-held``
says it holds them (``observe_replies``); a resumed run sends them again to every node.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict

from flower_app.wire.deployment_bytes import wire_bytes_each
from flower_app.wire.records import (
    declared_params,
    from_array_record,
    record_params,
    to_array_record,
)
from strategies.fed_sb.gradient import gradient_key
from strategies.fed_sb.keys import BASIS, BASIS_HELD
from strategies.fed_sb.rule import initial_factors
from strategies.server.central_dp import noise_std_mean, noised_mean
from strategies.server.ledger import traffic_metrics
from strategies.server.secure_outcome import SecureSumFailed, SecureSumTraffic
from strategies.server.secure_rounds import SecureRounds, contribution_bytes
from strategies.server.secure_sum import secure_sum
from strategies.server.strategy import AdapterStrategy

log = logging.getLogger("flwr.florg")
PREFIX = "fed-sb"  # the checkpoint's keys: 'fed-sb/B/<layer>', 'fed-sb/A/<layer>'
Shapes = dict[str, tuple[int, int]]


class FedSBStrategy(AdapterStrategy):
    def __init__(
        self,
        *args,
        init_examples: int,
        init_lr: float,
        base_shapes: Shapes | None = None,
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        # W0's (d_out, d_in) by layer: only a secure round 0 needs them (observe_server_model)
        self.base_shapes = base_shapes
        if init_examples < 1 or not init_lr > 0:
            raise ValueError(
                f"fed-sb-init-examples must be >= 1 and the init lr > 0; got {init_examples}, "
                f"{init_lr}"
            )
        self.init_examples, self.init_lr = int(init_examples), float(init_lr)
        self.basis: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # layer -> (B, A), float64
        self.node_synced: set[int] = set()  # nodes whose reply said they hold B and A

    def basis_state(self) -> dict[str, np.ndarray]:
        """{'<layer>.B': B, '<layer>.A': A} (empty before round 0)."""
        out: dict[str, np.ndarray] = {}
        for layer, (B, A) in self.basis.items():
            out[f"{layer}.B"], out[f"{layer}.A"] = B, A
        return out

    def observe_server_model(self, adapted: Any) -> None:
        """The shapes of every adapted W0 of the server's model (the server app hands it over
        before the run): a secure round 0's contribution, which the server fixes before it."""
        from flower_app.adapters.lora_sb.layer import lora_sb_layers

        layers = lora_sb_layers(adapted.model)
        self.base_shapes = {name: tuple(lr.base_layer.weight.shape) for name, lr in layers.items()}

    # -- round 0 ----------------------------------------------------------------------------
    def start(self, grid, initial_arrays, num_rounds=3, timeout=3600, *args, **kwargs):
        """Round 0 where no B and A are held yet (a fresh run; a resumed one restored them),
        then the rounds from the initial R; a run whose rounds all fail ends there."""
        initialised = None
        if not self.basis:
            # the run's lineage (the training messages' config) names the node-state folder
            # where a node keeps its DP-SGD ledger, which round 0 under dp=example composes
            train_config = kwargs.get("train_config") or {}
            self.initialise(grid, timeout, lineage=train_config.get("lineage"))
            initial_arrays = initialised = to_array_record(self.global_state)
        result = super().start(grid, initial_arrays, num_rounds, timeout, *args, **kwargs)
        if initialised is not None and not result.arrays:
            result.arrays = initialised
        return result

    def initialise(self, grid, timeout: float, lineage: str | None = None) -> None:
        """Round 0 (module docstring): query, check, average, factorise. ``lineage``: the
        run lineage the query carries (the node's state folder, as a training message's)."""
        t0 = time.perf_counter()
        node_ids = self.sampling.round_sample(
            grid,
            0,
            "round 0",
            fraction=self.fraction_train,
            min_train=self.min_train_nodes,
            min_available=self.min_available_nodes,
        )
        config = ConfigRecord({"server-round": 0, "fed-sb-init-examples": self.init_examples})
        if isinstance(lineage, str):
            config["lineage"] = lineage
        messages = [
            Message(
                content=RecordDict({"config": config}),
                message_type=MessageType.QUERY,
                dst_node_id=node,
            )
            for node in node_ids
        ]
        if isinstance(self.round_loop, SecureRounds):
            self.secure_round_0(grid, node_ids, config, timeout, t0)
            return
        replies = list(grid.send_and_receive(messages=messages, timeout=timeout))
        grads, sizes, counts = self.check_gradients(replies)
        metrics: dict[str, float] = {
            **counts,
            "clients": len(grads),
            "up-params": sum(declared_params(m.content) for m in replies if not m.has_error()),
            "down-params": sum(record_params(m.content) for m in messages),
            **traffic_metrics(wire_bytes_each(messages), wire_bytes_each(replies)),
            "examples": float(sum(sizes)),
            **self.sampling.metrics(0),
        }
        if self.example_dp is not None:  # dp=example: each client's epsilon after round 0
            metrics.update(self.example_dp.observe(0, replies))
            log.info(
                "round 0: dp-sgd epsilon max %.4g over %d clients (their gradient estimates)",
                metrics["dp-sgd-epsilon-max"], metrics["dp-sgd-clients"],
            )  # fmt: skip
        if not grads:
            raise RuntimeError("round 0: no client sent a valid gradient estimate; B and A unset")
        if self.dp is None:
            # each reply is a sum over the client's examples: their sum over the total count
            # is the pooled gradient the authors take the sign of, whatever the aggregation
            # weights (weighting a sum again by its count would count examples twice)
            total = float(sum(sizes))
            mean = {k: sum(g[k] for g in grads) / total for k in grads[0]}
        else:  # the Gaussian mechanism on the clipped sum (central_dp.py), m as a training
            # round's (private_divisor): the nodes queried, or q N under Poisson sampling
            self.communication.sampled[0] = len(messages)
            m, sampled = self.private_divisor(0, len(grads))
            mean = noised_mean(
                (self.dp.clip(g) for g in grads),
                self.dp.clipping_norm,
                self.dp.noise_multiplier,
                self.dp.rng,
                num_sampled=m,
            )
            std = noise_std_mean(self.dp.clipping_norm, self.dp.noise_multiplier, m)
            metrics.update({"dp-noise-std": std, **sampled, **self.dp.release()})
        self.factorise(mean, metrics, t0, len(grads))

    def factorise(self, mean: dict[str, np.ndarray], metrics: dict, t0: float, n: int) -> None:
        """B and A (kept here) and R = S_r (the global R) of every layer from the pooled
        gradient ``mean``; round 0's row."""
        r = self.router.largest_rank
        for layer in self.layers():
            B, R, A = initial_factors(mean[gradient_key(layer)], self.init_lr, r)
            self.basis[layer] = (B, A)
            self.global_state[f"{layer}.R"] = R
        metrics["init-seconds"] = time.perf_counter() - t0
        self.round_metrics[0] = {**self.round_metrics.get(0, {}), **metrics}
        log.info("round 0: B and A of %d layers from %d clients", len(self.basis), n)

    def secure_round_0(
        self, grid, node_ids: list[int], config: ConfigRecord, timeout: float, t0: float
    ) -> None:
        """Round 0 as one SecAgg+ sum of QUERY messages (the client mod answers the collect
        stage with ``FedSB.secure_query_contribution``): the server learns Σ wₙ gₙ / nₙ and
        Σ wₙ (wₙ = nₙ / max-weight), whose ratio is the plain round's Σ gₙ / Σ nₙ; under
        dp=central Σ clip(gₙ), noised here as ``noised_mean`` noises it, over m. No reply's
        arrays reach the server, so ``check_gradients`` does not run (the server checks each
        masked vector's names and shapes; the client refuses non-finite values)."""
        loop = self.round_loop
        shapes = self.base_shapes
        if not shapes:
            raise ValueError("secure round 0 needs the shapes of every adapted W0")
        contribution = {gradient_key(layer): tuple(shapes[layer]) for layer in self.layers()}
        size = contribution_bytes(contribution)
        if size > loop.settings.uplink_limit_bytes:
            raise ValueError(
                f"secure-uplink-limit-mb: fed-sb's round 0 would send {size / 2**20:.1f} MB a "
                f"client (its dense gradient of every adapted W0) under secure aggregation, "
                f"above the limit of {loop.settings.uplink_limit_bytes / 2**20:.1f} MB"
            )
        settings = loop.settings.secaggplus
        if settings.timeout is None:
            settings = replace(settings, timeout=timeout)
        traffic = SecureSumTraffic()
        try:
            summed = secure_sum(
                grid, node_ids, contribution, settings, message_type=MessageType.QUERY,
                collect_content={n: RecordDict({"config": config}) for n in node_ids},
                traffic=traffic,
            )  # fmt: skip
        except SecureSumFailed as err:
            reason = f"round 0: the secure sum failed; B and A unset: {err.reason}"
            raise RuntimeError(reason) from err
        replies = list(traffic.collected.values())
        survivors = set(summed.report.survivors)
        done = [m for m in replies if not m.has_error() and m.metadata.src_node_id in survivors]
        examples = sum(float(m.content["metrics"].get("num-examples", 0)) for m in done)
        metrics: dict[str, Any] = {
            "clients": len(survivors),
            "failures": sum(m.has_error() for m in replies),
            "rejected": 0,
            "secure-failed": 0,
            "up-params": len(survivors) * sum(int(np.prod(s)) for s in contribution.values()),
            "down-params": 0,
            **traffic_metrics(list(traffic.down_bytes.values()), list(traffic.up_bytes.values())),
            "examples": examples,
            **self.sampling.metrics(0),
        }
        if self.example_dp is not None:  # dp=example: each client's epsilon after round 0
            metrics.update(self.example_dp.observe(0, replies))
        if self.dp is None:
            mean = summed.weighted_mean()
        else:  # the clients clipped; the Gaussian mechanism on the sum, m as the plain round's
            self.communication.sampled[0] = len(node_ids)
            m, sampled = self.private_divisor(0, len(survivors))
            std = self.dp.noise_multiplier * self.dp.clipping_norm
            mean = {
                key: (value + self.dp.rng.normal(0.0, std, value.shape)) / m
                for key, value in summed.weighted_sums.items()
            }
            self.dp.clipped = sum(int(m.content["metrics"].get("dp-clipped", 0)) for m in done)
            metrics.update({"dp-noise-std": std / m, **sampled, **self.dp.release()})
        self.factorise(mean, metrics, t0, len(survivors))

    def check_gradients(
        self, replies: list[Message]
    ) -> tuple[list[dict[str, np.ndarray]], list[float], dict[str, float]]:
        """The valid replies' gradients (float64) and example counts, in partition order, and
        the counts of failed and rejected replies. Valid: every adapted layer's gradient,
        finite, of the shape most replies give it, at least r on each side; a positive
        example count."""
        keys = {gradient_key(layer) for layer in self.layers()}
        shapes: dict[str, Counter] = {k: Counter() for k in keys}
        candidates = []
        failures = rejected = 0
        for msg in replies:
            if msg.has_error():
                failures += 1
                log.warning("round 0: node %s failed: %s", msg.metadata.src_node_id,
                            msg.error.reason)  # fmt: skip
                continue
            try:
                arrays = from_array_record(msg.content["arrays"])
                metrics = msg.content["metrics"]
                n = float(metrics["num-examples"])
                part = int(metrics.get("partition-id", 0))
            except (KeyError, TypeError, ValueError) as err:
                rejected += 1
                log.warning("round 0: rejected reply of node %s: %s", msg.metadata.src_node_id,
                            err)  # fmt: skip
                continue
            candidates.append((part, msg.metadata.src_node_id, arrays, n))
            for k in keys & set(arrays):
                shapes[k][np.shape(arrays[k])] += 1
        common = {k: c.most_common(1)[0][0] for k, c in shapes.items() if c}
        r = self.router.largest_rank
        kept = []
        for part, node, arrays, n in sorted(candidates, key=lambda c: (c[0], c[1])):
            reason = None
            if set(arrays) != keys or set(common) != keys:
                reason = "its arrays are not one gradient per adapted layer"
            elif not (math.isfinite(n) and n > 0):
                reason = f"num-examples {n}"
            else:
                for k, g in arrays.items():
                    if g.shape != common[k] or g.ndim != 2 or min(g.shape) < r:
                        reason = f"{k}: shape {g.shape}, most replies {common[k]}, rank {r}"
                    elif not np.all(np.isfinite(g)):
                        reason = f"{k}: NaN or Inf"
                    if reason:
                        break
            if reason:
                rejected += 1
                log.warning("round 0: rejected gradient of partition %s (node %s): %s",
                            part, node, reason)  # fmt: skip
                continue
            kept.append(({k: np.asarray(v, np.float64) for k, v in arrays.items()}, n))
        counts = {"failures": failures, "rejected": rejected}
        return [g for g, _ in kept], [n for _, n in kept], counts

    # -- B and A, once per node ---------------------------------------------------------------
    def with_basis(self, message: Message) -> Message:
        """``message`` plus B and A where its node does not hold them yet."""
        node = message.metadata.dst_node_id
        if node in self.node_synced or not self.basis:
            return message
        content = RecordDict(dict(message.content.items()))
        content[BASIS] = to_array_record(self.basis_state())
        return Message(
            content=content, message_type=message.metadata.message_type, dst_node_id=node
        )

    def extend_train_message(self, server_round: int, message: Message) -> Message:
        return self.with_basis(message)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid
    ) -> Iterable[Message]:
        return [self.with_basis(m) for m in super().configure_evaluate(server_round, arrays,
                                                                        config, grid)]  # fmt: skip

    def aggregate_train(self, server_round, replies):
        replies = list(replies)
        self.observe_replies(replies)
        return super().aggregate_train(server_round, replies)

    def observe_replies(self, replies: Iterable[Message]) -> None:
        """The nodes whose reply's clear ``basis-held`` metric says they hold B and A: the
        plain round reads it here, a secure round (``SecureRounds``) hands it the collect
        stage's replies (their metrics travel beside the masked vector)."""
        for msg in replies:
            held = not msg.has_error() and "metrics" in msg.content.metric_records
            if held and msg.content["metrics"].get(BASIS_HELD) == 1:
                self.node_synced.add(msg.metadata.src_node_id)

    # -- checkpoint and resume: B and A ----------------------------------------------------------
    def state_arrays(self) -> dict[str, np.ndarray]:
        arrays = super().state_arrays()
        for layer, (B, A) in self.basis.items():
            arrays[f"{PREFIX}/B/{layer}"], arrays[f"{PREFIX}/A/{layer}"] = B, A
        return arrays

    def restore(self, arrays, state) -> None:
        """Resume: B and A from the checkpoint (round 0 is not run again); every node of the
        new Flower run is sent them again (``node_synced`` starts empty)."""
        super().restore(arrays, state)
        parts: dict[str, dict[str, np.ndarray]] = {}
        for key, value in arrays.items():
            if key.startswith(f"{PREFIX}/"):
                _, part, layer = key.split("/", 2)
                parts.setdefault(layer, {})[part] = np.asarray(value, np.float64)
        if set(parts) != set(self.layers()) or any(set(p) != {"A", "B"} for p in parts.values()):
            raise ValueError("checkpoint holds no B and A for every layer (round 0's)")
        self.basis = {layer: (p["B"], p["A"]) for layer, p in parts.items()}
        self.node_synced = set()
