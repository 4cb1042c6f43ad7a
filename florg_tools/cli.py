"""``florg``: one command for the project's tooling (``main``, ``COMMANDS``).

    florg launch ...       run the app with `flwr run`, fail unless it completes
    florg deploy ...       SuperLink + SuperNodes with TLS and node auth
    florg experiments ...  experiment grids (the lab's, lab/: pip install -e lab)
    florg assets ...       fetch / check the offline models and datasets
    florg flwr-home ...    write $FLWR_HOME/config.toml connections
    florg flowertune ...   FlowerTune LLM leaderboard: projected communication per track

``florg X ...`` is ``python -m florg_tools.X ...`` (``florg experiments``: ``python -m
florg_lab``): the rest of the command line goes to that module's ``main``, so ``florg X
--help`` shows X's own options (docs/usage.md, "The launcher and the florg command").
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

__all__ = ["COMMANDS", "main"]

# The experiment grids, their tools and the published evidence are the lab's, a package
# of its own beside the app (lab/README.md); the app installs without it.
LAB_PACKAGE = "florg_lab"
LAB_MISSING = (
    "florg experiments: the lab (florg_lab, the experiment grids and their tools) is not "
    "installed; from a clone of the repository: pip install -e lab"
)

# name -> (module with main(argv) -> int, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "launch": (
        "florg_tools.launch",
        "run the Flower App with `flwr run` and fail unless the run completes",
    ),
    "deploy": (
        "florg_tools.deploy.__main__",
        "start a SuperLink / SuperNodes (TLS, node auth), write connections, make certificates",
    ),
    "experiments": (
        "florg_lab.__main__",
        "experiment grids: run, report, list, evidence (the lab, lab/; pip install -e lab)",
    ),
    "assets": ("florg_tools.assets", "fetch or check the offline models and datasets"),
    "flwr-home": ("florg_tools.flwr_home", "write simulation connections into $FLWR_HOME"),
    "flowertune": (
        "florg_tools.flowertune",
        "FlowerTune LLM leaderboard: every method's projected communication per track",
    ),
}


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="florg",
        description="FLoRG tooling. `florg COMMAND --help` shows a command's options; "
        "each is also `python -m florg_tools.<module>`.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name, (module, text) in COMMANDS.items():
        shown = module.removesuffix(".__main__")
        sub.add_parser(name, help=f"{text} (python -m {shown})", add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    parser = _build_parser()
    if not args:
        parser.print_help(sys.stderr)
        return 2
    if args[0] not in COMMANDS:
        parser.parse_args(args)  # exits: 0 after --help, 2 for anything else
        return 2
    module, _ = COMMANDS[args[0]]
    try:
        command = importlib.import_module(module)
    except ModuleNotFoundError as err:
        if (err.name or "").split(".")[0] != LAB_PACKAGE:  # not a missing lab: re-raise
            raise
        print(LAB_MISSING, file=sys.stderr)
        return 2
    return int(command.main(args[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
