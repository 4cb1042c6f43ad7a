"""Shared fixtures and the ``integration`` marker's guard.

Fixtures (session-scoped, built once per pytest process, offline):

- ``tiny_bert_config``: the tiny BERT's ``BertConfig`` (``florg_tools.synthetic``);
- ``tiny_bert_dir``: that model, randomly initialised, saved with its tokenizer;
- ``sentiment_task_dir``: the small synthetic sentiment task (train/validation jsonl).

Module-scoped, for the integration modules that run the app on those two
(``tests.harness.flower_harness.run_tiny_app``):

- ``tiny_assets``: (the tiny BERT, the sentiment task, a folder of the module's own);
- ``tiny_superlink``: one SuperLink of ``TINY_NUM_NODES`` SuperNodes for all the module's
  runs, on one private Ray cluster (tests/harness/ray_harness.py).

The folders are shared by every test of the session: read them, never write into them
(a test that needs its own copy or variant calls ``florg_tools.synthetic`` itself).

Markers: ``integration`` (pyproject.toml) marks the tests that start real Flower SuperLinks
or SuperNodes, Ray, a Docker engine or ``flwr`` processes; ``pytest -m "not integration"``
is the fast set. A test without the marker that starts one of those anyway fails (see
``_unmarked_server_start``), so the fast set stays fast.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

import strategies.registry  # noqa: F401  (every method registers with the core's registry)
from florg_tools import synthetic

pytest_plugins = ["pytester"]  # tests/deployment/test_integration_guard.py

# --------------------------------------------------------------------------- shared assets


@pytest.fixture(scope="session")
def tiny_bert_config():
    return synthetic.tiny_bert_config()


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory) -> Path:
    return synthetic.make_tiny_bert(tmp_path_factory.mktemp("tiny-bert") / "model")


@pytest.fixture(scope="session")
def tiny_client_settings(tiny_bert_dir, sentiment_task_dir) -> dict:
    """A client round's settings on the tiny BERT and the local sentiment task (rank 2,
    2 local steps of batch 8 on 32 examples): what tests calling ``train_round`` share."""
    return {
        "model": str(tiny_bert_dir), "task": "local", "data-path": str(sentiment_task_dir),
        "text-fields": "sentence", "rank": 2, "batch-size": 8, "local-steps": 2,
        "max-train-examples": 32, "max-eval-examples": 16, "progress-bar": False,
    }  # fmt: skip


@pytest.fixture(scope="session")
def sentiment_task_dir(tmp_path_factory) -> Path:
    return synthetic.make_sentiment_task(tmp_path_factory.mktemp("sentiment-task") / "task")


@pytest.fixture(scope="module")
def tiny_assets(tiny_bert_dir, sentiment_task_dir, tmp_path_factory, request):
    """(model, task, folder): the folder is the module's own, named after it."""
    folder = tmp_path_factory.mktemp(request.module.__name__.rpartition(".")[2])
    return tiny_bert_dir, sentiment_task_dir, folder


@pytest.fixture(scope="module")
def tiny_superlink(tiny_assets):
    """The module's SuperLink, stopped with its Ray cluster after the module's last test.
    The nodes keep their own state (FedSA-LoRA's B, DP-SGD's ledgers) under the module's
    folder, ``node-state/``, where a resumed run reads it back."""
    # Imported here: the harness brings psutil and the SuperLink tooling, which the fast
    # tests never need.
    from flower_app.client.node_state import NODE_STATE_ENV
    from tests.harness.flower_harness import TINY_NUM_NODES
    from tests.harness.ray_harness import shared_ray_simulation_superlink

    base = tiny_assets[2]
    env = {NODE_STATE_ENV: str(base / "node-state")}
    with shared_ray_simulation_superlink(
        base / "superlink", num_supernodes=TINY_NUM_NODES, extra_env=env
    ) as sim:
        yield sim


# --------------------------------------------------------------------------- integration guard

# Programs (argv[0]'s name) and ``python -m`` modules that only integration tests may start.
SERVER_PROGRAMS = frozenset(
    {"flower-superlink", "flower-supernode", "flower-simulation", "flwr", "ray", "dockerd"}
)
SERVER_MODULES = ("flwr", "ray", "florg_tools.launch", "florg_lab")
# ``florg COMMAND`` (florg_tools/cli.py) subcommands that start servers or runs.
SERVER_COMMANDS = frozenset({"launch", "experiments", "deploy"})

_watched: list[list[str]] = []  # the running unmarked test's record, when there is one
_popen_init = subprocess.Popen.__init__


def _server_start(args) -> str | None:
    """The command line, when ``args`` starts what only integration tests may start."""
    if isinstance(args, str):
        argv = shlex.split(args)
    elif isinstance(args, (bytes, os.PathLike)):
        argv = [os.fsdecode(args)]
    else:
        argv = [os.fsdecode(a) for a in args]
    if not argv:
        return None
    module = ""  # of python -m MODULE / -mMODULE
    if os.path.basename(argv[0]).startswith("python"):
        for i, a in enumerate(argv[1:], 1):
            if a.startswith("-m"):
                module = a[2:] or (argv[i + 1] if i + 1 < len(argv) else "")
                break
    if (
        os.path.basename(argv[0]) in SERVER_PROGRAMS
        or any(module == m or module.startswith(m + ".") for m in SERVER_MODULES)
        or ("-c" in argv and any("flwr.cli" in a for a in argv))  # launch's flwr fallback
        or (
            os.path.basename(argv[0]) == "florg"
            and SERVER_COMMANDS & set(argv[1:2])
            and not {"-h", "--help"} & set(argv)  # a command's help starts nothing
        )
    ):
        return shlex.join(argv)
    return None


def _guarded_popen_init(self, args, *rest, **kwargs):
    if _watched:
        try:
            started = _server_start(args)
        except Exception:  # never in the way of Popen itself: it reports bad args
            started = None
        if started:
            _watched[-1].append(started)
    _popen_init(self, args, *rest, **kwargs)


def pytest_configure(config: pytest.Config) -> None:
    subprocess.Popen.__init__ = _guarded_popen_init


def pytest_unconfigure(config: pytest.Config) -> None:
    subprocess.Popen.__init__ = _popen_init


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    # Watch from the start of setup: module fixtures (a SuperLink) start with the first test.
    _watched.clear()
    if item.get_closest_marker("integration") is None:
        _watched.append([])
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    result = yield
    _unmarked_server_start(item)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem):
    try:
        return (yield)
    finally:
        _watched.clear()


def _unmarked_server_start(item: pytest.Item) -> None:
    if _watched and _watched[-1]:
        started = "\n  ".join(_watched[-1])
        pytest.fail(
            f"{item.nodeid} is not marked integration but started:\n  {started}\n"
            "mark it @pytest.mark.integration (or the module: pytestmark = "
            "pytest.mark.integration)",
            pytrace=False,
        )
