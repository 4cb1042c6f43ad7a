"""A SuperNode whose Runtime API port, found free, is taken by another process before it
binds it (the race of any free-port search, seen when CI ran the deployment tests beside the
simulations) is started again on a new port (florg_tools/deploy/deployment.py, _registered):
here the first port handed out is held open by the test."""

from __future__ import annotations

import socket

import pytest

import florg_tools.deploy.deployment as deployment_module
from florg_tools.superlink import find_free_port
from tests.harness.deploy_harness import deployment

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("wait", [True, False])
def test_a_supernode_whose_port_was_taken_starts_again_on_another(tmp_path, monkeypatch, wait):
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    taken = held.getsockname()[1]
    handed = iter([taken])
    try:
        with deployment(tmp_path, None, connection="port-race") as dep:
            dep.start_superlink()
            # the next port handed out (the SuperNode's) is the one held
            monkeypatch.setattr(
                deployment_module, "find_free_port",
                lambda host: next(handed, None) or find_free_port(host),
            )  # fmt: skip
            first = dep.start_supernode(0, 1, wait=wait)
            registered = dep.wait_registered()
            node = dep.supernodes[0]
            assert list(registered) == [0] and node.alive()
            assert first is node if wait else first is not node  # wait: the one registered
            dead = [p for p in dep.retired if p.name == "supernode-0"]
            assert len(dead) == 1 and "address already in use" in dead[0].log_text()
            assert f"--port {taken}" in " ".join(dead[0].argv)
            assert f"--port {taken}" not in " ".join(node.argv)
    finally:
        held.close()
