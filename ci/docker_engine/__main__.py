"""``python -m ci.docker_engine start|stop``: the private engine by hand
(needs root); see ``ci.docker_engine``."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from ci.docker_engine.client import (
    DockerEngineError,
    cache_root,
    engine_prerequisites,
)
from ci.docker_engine.engine import STORAGE_DRIVERS, PrivateDockerd, start_engine
from ci.docker_engine.pids import proc_stat


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ci.docker_engine")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("start", help="start a private dockerd in its own network namespace")
    s.add_argument("--state-dir", type=Path, default=Path("/tmp/florg-dockerd"))
    s.add_argument(
        "--data-root",
        type=Path,
        default=None,
        help="folder of the data-roots, one per storage driver (default: the cache's; "
        "do not share it with a test run in progress)",
    )
    s.add_argument("--storage-driver", choices=STORAGE_DRIVERS, default=None)
    t = sub.add_parser("stop", help="stop the dockerd started with `start` (by pid)")
    t.add_argument("--state-dir", type=Path, default=Path("/tmp/florg-dockerd"))
    args = p.parse_args(argv)
    state_dir = args.state_dir.resolve()
    if args.command == "start":
        problems = engine_prerequisites()
        if problems:
            print("error: " + "; ".join(problems), file=sys.stderr)
            return 2
        data_base = args.data_root or cache_root() / "engine"
        drivers = (args.storage_driver,) if args.storage_driver else STORAGE_DRIVERS
        try:
            # Not tied to this command's life: it exits, the engine runs on until `stop`.
            engine = start_engine(state_dir, data_base.resolve(), drivers, die_with_starter=False)
        except DockerEngineError as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        env = engine.env({})
        for key in ("DOCKER_HOST", "DOCKER_CONFIG", "DOCKER_BUILDKIT", "COMPOSE_DOCKER_CLI_BUILD"):
            print(f"export {key}={shlex.quote(env[key])}")
        print(f'export PATH={shlex.quote(str(state_dir / "bin"))}:"$PATH"')
        print(f"# dockerd pid {engine.pid} ({engine.storage_driver}); host commands that dial")
        print(f"# the published ports: {shlex.join(engine.netns())} COMMAND")
        # Leave it running: `stop` finds it by its recorded pid.
        engine._popen = None
        engine._tracked = None
        return 0
    try:
        state: dict[str, Any] = json.loads((state_dir / "engine.json").read_text())
    except (OSError, ValueError) as err:
        print(f"error: no engine state in {state_dir}: {err}", file=sys.stderr)
        return 1
    st = proc_stat(int(state["pid"]))
    if st is None or st[1] != int(state["start"]):
        print(f"no dockerd with pid {state['pid']} is running", file=sys.stderr)
        return 0
    engine = PrivateDockerd(state_dir, Path(state["data_root"]), state["driver"])
    engine.pid = int(state["pid"])
    survivors = engine.stop()
    for line in survivors:
        print(f"survived: {line}", file=sys.stderr)
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
