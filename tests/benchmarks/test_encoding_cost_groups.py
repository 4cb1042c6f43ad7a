"""benchmarks/core/encoding_cost.py with ``--encodings all`` on the tiny shape: the grouped
encodings get their rows, under int8's bytes (int8-g) and about half of them (int4-g)."""

from __future__ import annotations

import pytest

from benchmarks.core import encoding_cost
from flower_app.wire.encoding import ENCODINGS


def test_all_encodings_have_a_row_and_the_grouped_ones_send_the_fewest_bytes(capsys):
    assert encoding_cost.main(["--quick", "--methods", "fedit", "--repeats", "1",
                               "--encodings", "all"]) == 0  # fmt: skip
    # the codec's table: the one before the byte count's (which lists the encodings again)
    codec = capsys.readouterr().out.split("byte count of the metrics rows")[0]
    rows = [line.split("|")[1:-1] for line in codec.splitlines()]
    rows = [[c.strip() for c in r] for r in rows if r and r[0].strip() == "fedit"]
    assert [r[1] for r in rows] == list(ENCODINGS)
    ratio = {r[1]: float(r[-1]) for r in rows}
    assert ratio["int8-g"] < ratio["int8"] and ratio["int4-g"] < 0.6 * ratio["int8-g"], ratio


def test_an_unknown_encoding_is_refused():
    with pytest.raises(SystemExit):
        encoding_cost.main(["--quick", "--encodings", "int3"])
