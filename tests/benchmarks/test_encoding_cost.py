"""benchmarks/core/encoding_cost.py on the tiny shape: one row per encoding, the server's
codec and the aggregation timed side by side, the replies' bytes against fp32's; and one row
per encoding for the byte count of the metrics rows, timed against the same aggregation."""

from __future__ import annotations

import logging

import torch

from benchmarks.core import encoding_cost


def table_rows(text: str) -> list[list[str]]:
    rows = [line.split("|")[1:-1] for line in text.splitlines()]
    return [[c.strip() for c in r] for r in rows if r and r[0].strip() in ("florg", "fedit")]


def test_every_encoding_has_a_row_and_fewer_bytes_than_fp32(capsys):
    assert encoding_cost.main(["--quick", "--methods", "florg,fedit", "--repeats", "1"]) == 0
    codec, count = capsys.readouterr().out.split("byte count of the metrics rows")
    rows = table_rows(codec)
    expected = [(m, e) for m in ("florg", "fedit") for e in ("fp32", "bf16", "fp16", "int8")]
    assert [(r[0], r[1]) for r in rows] == expected
    for method, encoding, agg, codec, share, _client, _size, ratio in rows:
        assert float(agg) >= 0 and float(codec) >= 0 and share.endswith("%")
        if encoding == "fp32":
            assert float(ratio) == 1.0
        else:  # half (16-bit) or about a quarter plus scales (int8) of the payload
            assert float(ratio) < 0.7, (method, encoding)
    counted = table_rows(count)
    assert [(r[0], r[1]) for r in counted] == expected
    for method, encoding, agg, seconds, share, reply, vs_reply, sent, vs_sent in counted:
        assert float(agg) >= 0 and float(seconds) >= 0 and share.endswith("%")
        # a deployment's objects: the protobuf's bytes plus headers, child ids and metadata
        assert int(reply.replace(",", "")) > 0 and int(sent.replace(",", "")) > 0
        assert 1.0 <= float(vs_reply) < 3.0 and 1.0 <= float(vs_sent) < 3.0, (method, encoding)


def test_the_benchmark_puts_back_what_it_sets_for_the_process():
    """Flower's logger level and torch's threads are the process's: a caller that goes on
    (the unit set in one process) must find them as they were."""
    flwr_log = logging.getLogger("flwr")
    level, threads = flwr_log.level, torch.get_num_threads()
    try:
        flwr_log.setLevel(logging.DEBUG)
        torch.set_num_threads(2)
        assert encoding_cost.main(["--quick", "--methods", "fedit", "--repeats", "1"]) == 0
        assert flwr_log.level == logging.DEBUG
        assert torch.get_num_threads() == 2
    finally:
        flwr_log.setLevel(level)
        torch.set_num_threads(threads)
