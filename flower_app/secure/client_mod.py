"""The ClientApp mod of secure aggregation: SecAgg+'s stages, training inside the collect one.

A message without SecAgg+'s configs record passes through untouched. Setup, share keys and
unmask are answered by ``secaggplus_client``; the collect stage carries the round's training
message, so the mod calls the next handler (training), turns the reply's arrays into the
method's contribution (``Method.secure_contribution``, given the state sent, decoded when a
method reads it, and the run's settings) times the client's weight (``client_weight``),
masks it and sends the masked vector with the reply's metrics; the reply's arrays never
leave the node. Under dp=central the contribution is made from the update clipped here
(``Method.secure_private_contribution``); the server adds the noise to the sum. A QUERY's
collect stage (a method's round 0) masks the method's ``secure_query_contribution``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MessageType, RecordDict
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage

from flower_app.methods.registry import get_method
from flower_app.secure.secaggplus_client import secaggplus_client, weighted_contribution
from flower_app.secure.settings import client_weight
from flower_app.settings.config import resolve_config
from flower_app.wire.encoding import decode_record
from flower_app.wire.records import from_array_record


def secure_aggregation_mod(
    msg: Message, context: Context, call_next: Callable[[Message, Context], Message]
) -> Message:
    """The client mod (module docstring); a training reply that failed goes back as it is,
    which the server counts as this node dropping out after sharing its keys."""
    if RECORD_KEY_CONFIGS not in msg.content.config_records:
        return call_next(msg, context)
    stage = msg.content.config_records[RECORD_KEY_CONFIGS].get(Key.STAGE)
    if stage != Stage.COLLECT_MASKED_VECTORS:
        return secaggplus_client(msg, context)
    reply = call_next(msg, context)
    if reply.has_error():
        return reply
    config = resolve_config(context.run_config)
    method = get_method(config.method)
    server_round = int(msg.content["config"].get("server-round", 0))
    arrays = from_array_record(reply.content["arrays"])  # uplink-encoding is fp32 here
    examples = float(reply.content["metrics"].get("num-examples", 0))
    if msg.metadata.message_type == MessageType.QUERY:  # a method's round 0 as a secure sum
        query = getattr(method, "secure_query_contribution", None)
        if query is None:
            raise ValueError(f"method {config.method!r} answers no query under secure aggregation")
        contribution, weight, clipped = query(config, arrays, examples)
        if config.dp == "central" and config.dp_unnoised_metrics == "send":
            reply.content["metrics"]["dp-clipped"] = int(clipped)
        return _masked_reply(msg, context, reply, weighted_contribution(contribution, weight))
    # the state the server sent, as the client decodes it: the reference of dp=central's
    # update and of a contribution that reads it (a rotation toward the state sent); most
    # contributions never read it, so it is decoded only when one does
    received = ReceivedState(msg.content["arrays"], config.downlink_encoding)
    if config.dp == "central":  # clipped here, noised on the server's unmasked sum
        contribution, clipped = method.secure_private_contribution(
            arrays, received, config.dp_clipping_norm, server_round, config=config
        )
        if config.dp_unnoised_metrics == "send":
            reply.content["metrics"]["dp-clipped"] = int(clipped)
    else:
        contribution = method.secure_contribution(
            arrays, server_round, received=received, config=config
        )
    weight = client_weight(config, examples)
    return _masked_reply(msg, context, reply, weighted_contribution(contribution, weight))


def _masked_reply(
    msg: Message, context: Context, reply: Message, contribution: dict[str, np.ndarray]
) -> Message:
    """The collect stage's answer: the masked ``contribution`` and the reply's metrics, never
    its arrays."""
    masked = secaggplus_client(msg, context, contribution)
    content = RecordDict({RECORD_KEY_CONFIGS: masked.content.config_records[RECORD_KEY_CONFIGS]})
    for name, record in reply.content.metric_records.items():
        content[name] = record
    return Message(content, reply_to=msg)


class ReceivedState(Mapping[str, np.ndarray]):
    """The state a training message carried (``record``, sent under ``encoding``) as arrays,
    decoded once, the first time it is read."""

    def __init__(self, record: ArrayRecord, encoding: str) -> None:
        self._record, self._encoding = record, encoding
        self._state: dict[str, np.ndarray] | None = None

    @property
    def decoded(self) -> bool:
        return self._state is not None

    def _arrays(self) -> dict[str, np.ndarray]:
        if self._state is None:
            self._state = from_array_record(decode_record(self._record, self._encoding))
        return self._state

    def __getitem__(self, key: str) -> np.ndarray:
        return self._arrays()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._arrays())

    def __len__(self) -> int:
        return len(self._arrays())
