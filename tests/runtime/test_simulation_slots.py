"""Flower's simulation engine runs at most min(32, CPUs + 4) ClientApp tasks at once (its
workers share a default ``ThreadPoolExecutor``), whatever Ray's CPUs: an async run in a
simulation whose ``async-concurrency`` exceeds that logs one warning at its start
(strategies/server/simulation_slots.py)."""

from __future__ import annotations

import inspect
import logging
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
from flwr.server.superlink.fleet.vce import vce_api
from flwr.superlink.grid import InMemoryGrid

import strategies.server.buffered_rounds as buffered_rounds
import strategies.server.simulation_slots as slots_module
from strategies.server.simulation_slots import simulation_task_slots, warn_simulation_slots
from tests.runtime.test_async_loop import Grid, async_strategy, run


def simulation_grid() -> InMemoryGrid:
    """The grid Flower's simulation engine hands the ServerApp (no LinkState behind it)."""
    return InMemoryGrid(SimpleNamespace(state=lambda: None))


def test_flowers_engine_still_runs_its_workers_in_a_default_thread_pool():
    """What the cap is read from: a Flower release that sizes the pool fails here."""
    source = inspect.getsource(vce_api.run_api)
    assert "with ThreadPoolExecutor() as executor:" in source
    assert "for _ in range(backend.num_workers)" in source


def test_the_slots_are_those_of_a_default_thread_pool(monkeypatch):
    with ThreadPoolExecutor() as pool:
        assert simulation_task_slots() == pool._max_workers
    monkeypatch.setattr(slots_module.os, "cpu_count", lambda: 2)
    assert simulation_task_slots() == 6
    monkeypatch.setattr(slots_module.os, "cpu_count", lambda: 64)
    assert simulation_task_slots() == 32
    monkeypatch.setattr(slots_module.os, "cpu_count", lambda: None)
    assert simulation_task_slots() == 5


@pytest.mark.parametrize(
    ("simulation", "concurrency", "warned"),
    [(True, 20, True), (True, 6, False), (False, 20, False)],
)
def test_a_simulation_asked_for_more_clients_than_slots_warns_once(
    monkeypatch, caplog, simulation, concurrency, warned
):
    monkeypatch.setattr(slots_module.os, "cpu_count", lambda: 2)  # 6 slots
    grid = simulation_grid() if simulation else SimpleNamespace()
    with caplog.at_level(logging.WARNING, logger="flwr.florg"):
        assert warn_simulation_slots(grid, concurrency) is warned
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == int(warned)
    if warned:
        message = warnings[0].getMessage()
        assert "async-concurrency 20 exceeds the 6 ClientApp tasks" in message
        assert "min(32, 2 CPUs + 4)" in message


class SimulationGrid(Grid, InMemoryGrid):
    """The loop's stand-in grid (tests/runtime/test_async_loop.py) as a simulation's."""


def test_an_async_run_in_a_simulation_warns_at_its_start(monkeypatch, caplog):
    monkeypatch.setattr(buffered_rounds, "POLL_SECONDS", 0.01)
    monkeypatch.setattr(slots_module.os, "cpu_count", lambda: 2)  # 6 slots
    strategy = async_strategy(8, 8, 4)
    with caplog.at_level(logging.WARNING, logger="flwr.florg"):
        run(strategy, SimulationGrid(list(range(1, 9))), 2)
    warned = [r for r in caplog.records if "ClientApp tasks" in r.getMessage()]
    assert len(warned) == 1 and "async-concurrency 8 exceeds the 6" in warned[0].getMessage()
    assert sorted(strategy.round_metrics) == [1, 2]
