"""The deployment argv (florg_tools.deploy.commands) as Flower's own parsers read it."""

from __future__ import annotations

import pytest
from flwr.common.config import parse_config_args
from flwr.supercore.cli.flower_superexec import _parse_args as superexec_parser
from flwr.superlink.cli.flower_superlink import _parse_args_run_superlink
from flwr.supernode.cli.flower_supernode import _parse_args_run_supernode

from florg_tools.deploy.commands import (
    DeployConfigError,
    ServerTLS,
    deployment_env,
    is_loopback,
    local_runtime_address,
    node_config_string,
    split_address,
    superexec_argv,
    superlink_argv,
    supernode_argv,
)

TLS = ServerTLS("/certs/ca.crt", "/certs/server.pem", "/certs/server.key")


def test_superlink_tls_argv_parses_as_flower_reads_it():
    argv = superlink_argv(
        host="0.0.0.0", port=9093, tls=TLS, isolation="process", enable_supernode_auth=True
    )
    assert argv[0] == "flower-superlink"
    args = _parse_args_run_superlink().parse_args(argv[1:])
    assert (args.host, args.port, args.isolation) == ("0.0.0.0", 9093, "process")
    assert (args.ssl_ca_certfile, args.ssl_certfile, args.ssl_keyfile) == (
        "/certs/ca.crt",
        "/certs/server.pem",
        "/certs/server.key",
    )
    assert args.enable_supernode_auth and not args.insecure
    assert args.runtime_dependency_install is False


def test_insecure_only_on_loopback():
    argv = superlink_argv(host="127.0.0.1", port=9093, insecure=True)
    assert "--insecure" in argv and "--ssl-certfile" not in argv
    for host in ("0.0.0.0", "10.200.1.1", "superlink", "::"):
        with pytest.raises(DeployConfigError, match="not a loopback address"):
            superlink_argv(host=host, port=9093, insecure=True)
    with pytest.raises(DeployConfigError, match="not a loopback address"):
        supernode_argv("10.200.1.1:9093", partition_id=0, num_partitions=2, insecure=True)
    with pytest.raises(DeployConfigError, match="not a loopback address"):
        superexec_argv("superlink:9093", insecure=True)
    # An explicit, documented private network (docker compose bridge) is allowed.
    assert "--insecure" in superexec_argv("superlink:9093", insecure=True, private_network=True)


def test_tls_xor_insecure_and_auth_needs_tls():
    with pytest.raises(DeployConfigError, match="not both and not neither"):
        superlink_argv(host="127.0.0.1", port=1)
    with pytest.raises(DeployConfigError, match="not both and not neither"):
        superlink_argv(host="127.0.0.1", port=1, tls=TLS, insecure=True)
    with pytest.raises(DeployConfigError, match="requires TLS"):
        superlink_argv(host="127.0.0.1", port=1, insecure=True, enable_supernode_auth=True)
    with pytest.raises(DeployConfigError, match="requires TLS"):
        supernode_argv(
            "127.0.0.1:1", partition_id=0, num_partitions=1, insecure=True, auth_private_key="k"
        )
    with pytest.raises(DeployConfigError, match="isolation"):
        superlink_argv(host="127.0.0.1", port=1, insecure=True, isolation="thread")
    with pytest.raises(DeployConfigError, match="port"):
        superlink_argv(host="127.0.0.1", port=70000, insecure=True)


def test_supernode_argv_parses_and_carries_the_node_config():
    argv = supernode_argv(
        "superlink:9093",
        partition_id=2,
        num_partitions=3,
        data_path="/data/my shop's reviews.jsonl",
        root_certificates="/certs/ca.crt",
        isolation="process",
        runtime_host="127.0.0.1",
        runtime_port=9195,
        auth_private_key="/keys/node2",
        max_retries=5,
    )
    args = _parse_args_run_supernode().parse_args(argv[1:])
    assert args.superlink == "superlink:9093" and args.root_certificates == "/certs/ca.crt"
    assert (args.host, args.port, args.isolation) == ("127.0.0.1", 9195, "process")
    assert args.auth_supernode_private_key == "/keys/node2" and args.max_retries == 5
    node_config = parse_config_args([args.node_config])
    assert node_config == {
        "partition-id": 2,
        "num-partitions": 3,
        "data-path": "/data/my shop's reviews.jsonl",
    }


def test_node_config_rejects_unknown_partition():
    with pytest.raises(DeployConfigError, match=r"partition-id 3 outside \[0, 3\)"):
        node_config_string(3, 3)
    with pytest.raises(DeployConfigError, match="num-partitions must be >= 1"):
        node_config_string(0, 0)
    with pytest.raises(DeployConfigError, match="partition-id must be an int"):
        node_config_string("0", 2)  # type: ignore[arg-type]
    assert parse_config_args([node_config_string(0, 1, "C:\\data\\x")]) == {
        "partition-id": 0,
        "num-partitions": 1,
        "data-path": "C:\\data\\x",
    }


def test_a_node_rank_travels_in_the_node_config_and_wins_over_client_ranks():
    """Issue 30: ``--rank R`` / ``--node-ranks`` put ``rank=R`` into the node-config, which
    the ClientApp reads over the run's ``client-ranks`` (flower_app/settings/client_ranks.py)."""
    from florg_tools.deploy.__main__ import parse_node_ranks
    from flower_app.settings.client_ranks import node_rank
    from flower_app.settings.config import resolve_config

    argv = supernode_argv("127.0.0.1:9093", partition_id=1, num_partitions=3, rank=8, insecure=True)
    node_config = parse_config_args([_parse_args_run_supernode().parse_args(argv[1:]).node_config])
    assert node_config == {"partition-id": 1, "num-partitions": 3, "rank": 8}
    config = resolve_config({}, {"client-ranks": "2,4,8"})
    assert node_rank(config, node_config, 1) == 8  # client-ranks alone would give 4
    assert parse_node_ranks("2,4,8", 3) == [2, 4, 8] and parse_node_ranks(None, 3) == []
    with pytest.raises(DeployConfigError, match="give 3 positive integer ranks"):
        parse_node_ranks("2,4", 3)
    with pytest.raises(DeployConfigError, match="rank must be a positive int"):
        node_config_string(0, 1, rank=0)


def test_superexec_argv_uses_the_1_41_flags():
    argv = superexec_argv("127.0.0.1:9093", root_certificates="/certs/ca.crt", parent_pid=42)
    args = superexec_parser().parse_args(argv[1:])
    assert args.runtime_api_address == "127.0.0.1:9093"
    assert args.root_certificates == "/certs/ca.crt" and args.parent_pid == 42
    assert "--plugin-type" not in argv and "--appio-api-address" not in argv


def test_address_helpers():
    assert split_address("[::1]:80") == ("::1", 80)
    assert split_address("superlink:9093") == ("superlink", 9093)
    for bad in ("superlink", "host:0", "::1:80", "host:x"):
        with pytest.raises(DeployConfigError):
            split_address(bad)
    assert is_loopback("127.0.0.5") and is_loopback("localhost") and is_loopback("[::1]")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.1")
    assert local_runtime_address("0.0.0.0", 9093) == "127.0.0.1:9093"
    assert deployment_env({"A": "1"})["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] == "1"
