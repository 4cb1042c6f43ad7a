"""Deployment across network interfaces: each SuperNode in its own network namespace
behind a veth pair (node 10.B.i.2/24, host side 10.B.i.1/24); the SuperLink binds 0.0.0.0
with TLS (its certificate names every host-side address) and each node dials its own
host-side address, so all Fleet traffic crosses a veth. A full FLoRG run of the tiny model.

Skipped, with the reason, where namespaces cannot be made (not root, no ``ip``, EPERM).
The namespaces and veths are deleted at the end, also when the test fails.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from florg_tools.deploy.certs import certificate_sans, generate_certificates
from florg_tools.deploy.netns import Namespaces, NetnsUnavailable
from florg_tools.flwr_cli import run_flower_app
from tests.harness.deploy_harness import ROOT, deployment, logs, rows, run_settings, tiny_assets

pytestmark = pytest.mark.integration

NODES = 3


def _rx_bytes(interface: str) -> int:
    return int(Path(f"/sys/class/net/{interface}/statistics/rx_bytes").read_text())


@pytest.fixture
def namespaces():
    spaces = Namespaces(NODES)
    try:
        created = spaces.create()
    except NetnsUnavailable as err:
        pytest.skip(f"network namespaces unavailable here: {err}")
    try:
        yield created
    finally:
        left = spaces.delete()
        assert not left, f"could not delete {left}"
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert not any(ns.name in listed for ns in created)


def test_supernodes_in_network_namespaces_run_florg_over_tls(tmp_path, namespaces):
    model, task = tiny_assets(tmp_path)
    host_sides = [ns.host_address for ns in namespaces]
    certs = generate_certificates(tmp_path / "certs", host_sides)
    assert set(host_sides) <= set(certificate_sans(certs.server_cert))
    rx_before = {ns.host_veth: _rx_bytes(ns.host_veth) for ns in namespaces}
    with deployment(tmp_path, certs, bind_host="0.0.0.0", connection="netns-tls") as dep:
        dep.start_superlink()
        assert dep.superlink.argv[dep.superlink.argv.index("--host") + 1] == "0.0.0.0"
        for i, ns in enumerate(namespaces):
            node = dep.start_supernode(
                i, NODES, superlink_host=ns.host_address, netns=ns.name, wait=False
            )
            assert f"{ns.host_address}:{dep.port}" in node.argv
        assert sorted(dep.wait_registered()) == list(range(NODES))
        out = tmp_path / "outputs"
        outcome = run_flower_app(
            ROOT,
            dep.connection,
            run_settings(model, task, out, "netns", **{"num-server-rounds": 1}),
            dep.flwr_home,
            timeout=420,
            stream=None,
        )
        assert outcome.ok, f"{outcome.message}\n{outcome.log_text[-3000:]}\n{logs(dep)}"
        superlink_log = dep.superlink.log_text()

    history = rows(out / "netns")
    assert [r["round"] for r in history] == [0, 1]
    assert history[1]["partitions"] == [0, 1, 2] and history[1]["clients"] == NODES
    assert (out / "netns" / "adapter.safetensors").exists()
    for ns in namespaces:
        # The SuperLink saw each node's requests come from the namespace side of its veth,
        # and the host side of every veth received the node's traffic (TLS, model arrays).
        assert f"{ns.node_address}:" in superlink_log, ns
        assert _rx_bytes(ns.host_veth) - rx_before[ns.host_veth] > 20_000, ns
