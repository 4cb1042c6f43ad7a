"""The ClientApp mod of secure aggregation: SecAgg+'s stages, training inside the collect one.

A message without SecAgg+'s configs record passes through untouched. Setup, share keys and
unmask are answered by ``secaggplus_client``; the collect stage carries the round's training
message, so the mod calls the next handler (training), turns the reply's arrays into the
method's contribution (``Method.secure_contribution``, weight 1), masks it and sends the
masked vector with the training reply's metrics; the reply's arrays never leave the node.
"""

from __future__ import annotations

from collections.abc import Callable

from flwr.app import Context, Message, RecordDict
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage

from flower_app.methods.registry import get_method
from flower_app.secure.secaggplus_client import secaggplus_client, weighted_contribution
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
    method = get_method(str(context.run_config["method"]))
    server_round = int(msg.content["config"].get("server-round", 0))
    arrays = from_array_record(reply.content["arrays"])  # uplink-encoding is fp32 here
    contribution = weighted_contribution(method.secure_contribution(arrays, server_round), 1.0)
    masked = secaggplus_client(msg, context, contribution)
    content = RecordDict({RECORD_KEY_CONFIGS: masked.content.config_records[RECORD_KEY_CONFIGS]})
    for name, record in reply.content.metric_records.items():
        content[name] = record
    return Message(content, reply_to=msg)
