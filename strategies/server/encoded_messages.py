"""The training messages' arrays as the run's encodings send them (``uplink-encoding``,
``downlink-encoding``; the encodings: flower_app/wire/encoding.py): the server encodes what it
sends down and decodes what comes up, before anything reads it (``MessageEncodings``, held
by the common strategy)."""

from __future__ import annotations

from flwr.app import ArrayRecord, Message

from flower_app.wire.encoding import DOWN, decode_record, encode_record, encoding_rng
from flower_app.wire.records import from_array_record


def encode_downlink(messages: list[Message], encoding: str, seed: int, server_round: int) -> bool:
    """Each message's global arrays as ``encoding`` sends them, in place: one rounding
    stream for every node, so equal arrays are encoded, and decoded by every node, alike;
    what a method adds beside them (its folds, its fixed bases) stays float32. Messages may
    share one content (Flower's FedAvg sends one record to every node): each record is
    encoded once. Whether anything was encoded (fp32: nothing, the messages as they are)."""
    if encoding == "fp32":
        return False
    encoded: dict[int, tuple[ArrayRecord, ArrayRecord]] = {}  # id -> (record, encoded)
    for message in messages:
        record = message.content["arrays"]
        if id(record) not in encoded:
            rng = encoding_rng(seed, server_round, DOWN)
            new = encode_record(from_array_record(record), encoding, rng)
            encoded[id(record)] = (record, new)
            encoded[id(new)] = (new, new)  # a shared content already holds it
        message.content["arrays"] = encoded[id(record)][1]
    return True


def decode_reply(message: Message, encoding: str) -> None:
    """A reply's arrays back to float32 under their own names, in place, before anything
    reads them; a reply that cannot be decoded is left as it came, and the reply checks
    reject it (its arrays are not the ones the round expects)."""
    if encoding == "fp32" or message.has_error():
        return
    if "arrays" not in message.content.array_records:
        return
    try:
        message.content["arrays"] = decode_record(message.content["arrays"], encoding)
    except (ValueError, TypeError):
        return


class MessageEncodings:
    """The run's encodings of the training messages' arrays (``uplink-encoding``,
    ``downlink-encoding``, flower_app/wire/encoding.py), held by the common strategy."""

    def __init__(self, uplink: str = "fp32", downlink: str = "fp32", seed: int = 0) -> None:
        self.uplink, self.downlink, self.seed = uplink, downlink, seed

    def encode(self, messages: list[Message], server_round: int) -> bool:
        """The messages' arrays encoded by ``downlink-encoding``, in place; False (nothing
        done) at fp32."""
        return encode_downlink(messages, self.downlink, self.seed, server_round)

    def decode(self, message: Message) -> None:
        """A reply's arrays decoded by ``uplink-encoding``, in place."""
        decode_reply(message, self.uplink)
