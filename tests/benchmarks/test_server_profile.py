"""Smoke test of the server-step profile (benchmarks/core/server_profile.py): the tiny 7B
stand-in shape on the CPU, one profiled step. It checks what the script prints (the shape,
the wall times, the operator table); no timing is asserted."""

from __future__ import annotations

import re

import pytest

from benchmarks.core.server_profile import profile_step, time_blocks


def test_quick_profile_prints_shape_walls_and_operators():
    text = profile_step("7b", "cpu", quick=True, rows=10)
    assert text.startswith("# FLoRG server step, shape 7b (4 layers, k = 96, N = 5, r = 8) on CPU")
    walls = re.search(r"wall ms of 5 steps: ([\d., ]+) \(min ([\d.]+)\)", text)
    assert walls, text
    assert len(walls.group(1).split(",")) == 5 and float(walls.group(2)) > 0
    assert "Self CPU" in text
    assert "aten::_linalg_eigh" in text or "aten::linalg_eigvalsh" in text, text


def test_unknown_shape_is_refused_with_the_known_ones():
    with pytest.raises(SystemExit, match=r"unknown shape '13b'; shapes: roberta-large, 7b"):
        profile_step("13b", "cpu", quick=True, rows=5)


def test_building_blocks_table_has_every_block_with_a_time():
    text = time_blocks("7b", "cpu", quick=True)
    assert text.startswith("## building blocks at 7b: B = 4 layers, Nr = 40, r = 8, k = 96")
    rows = [line for line in text.splitlines() if line.startswith("| ") and "block |" not in line]
    labels = [row.split("|")[1].strip() for row in rows]
    assert labels == [
        "host-to-device copy, float32",
        "Gram product, float64 bmm",
        "eigvalsh of the Grams",
        "eigh of the Grams",
        "thin SVD of the cross products",
    ]
    assert all(float(row.split("|")[2]) >= 0 for row in rows)
