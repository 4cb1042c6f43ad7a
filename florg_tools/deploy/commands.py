"""The argv of every Flower deployment process, the single source of truth: ``superlink_argv``,
``supernode_argv``, ``superexec_argv``, ``node_config_string`` and ``deployment_env``.

Every function here is pure: addresses, ports, certificate paths, partition ids and the
isolation mode in, an argv list (or an environment mapping) out; nothing is read from disk
and nothing is started. ``florg_tools.deploy.deployment`` runs these commands, the docker
compose files are generated from them (``compose_gen``) and docs/deploy-superlink.md
shows them, with the processes, their ports and flags. Policy: TLS everywhere by default;
``insecure=True`` only where the address bound or dialled is a loopback address
(127.0.0.0/8, ::1, localhost), else ``DeployConfigError`` naming the address, unless the
caller states ``private_network=True`` (an isolated network that publishes no port, such
as a docker compose bridge network; never the internet).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import PurePath

__all__ = [
    "DEFAULT_SUPERLINK_PORT",
    "DEFAULT_SUPERNODE_RUNTIME_PORT",
    "ISOLATION_MODES",
    "DeployConfigError",
    "ServerTLS",
    "deployment_env",
    "format_address",
    "is_loopback",
    "local_runtime_address",
    "node_config_string",
    "split_address",
    "superexec_argv",
    "superlink_argv",
    "supernode_argv",
]

DEFAULT_SUPERLINK_PORT = 8000
DEFAULT_SUPERNODE_RUNTIME_PORT = 9094
ISOLATION_MODES = ("subprocess", "process")

PathLike = str | PurePath


class DeployConfigError(ValueError):
    """A deployment setting that cannot work or is unsafe; the message says which."""


@dataclass(frozen=True)
class ServerTLS:
    """A TLS server's files: the CA certificate, its certificate and its private key."""

    ca_certfile: PathLike
    certfile: PathLike
    keyfile: PathLike


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an IP address or ``localhost``) only reaches this machine."""
    host = host.strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def split_address(address: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` -> ``(host, port)``; raises on anything else."""
    host, sep, port_text = address.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise DeployConfigError(f"address {address!r} is not HOST:PORT")
    port = int(port_text)
    if not 0 < port < 65536:
        raise DeployConfigError(f"address {address!r}: port {port} outside 1..65535")
    if host.startswith("["):
        if not host.endswith("]"):
            raise DeployConfigError(f"address {address!r}: unbalanced '[' in an IPv6 host")
        host = host[1:-1]
    elif ":" in host:
        raise DeployConfigError(f"address {address!r}: write IPv6 hosts as [ADDR]:PORT")
    return host, port


def format_address(host: str, port: int) -> str:
    """``(host, port)`` -> ``host:port`` (``[host]:port`` for IPv6)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _bind_target(host: str) -> str:
    """Where a local client reaches a server bound to ``host`` (what Flower itself dials:
    ``0.0.0.0`` -> ``127.0.0.1``, ``::`` -> ``::1``)."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)


def _check_port(port: int, what: str) -> None:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise DeployConfigError(f"{what}: port must be an int in 1..65535, got {port!r}")


def _check_isolation(isolation: str) -> None:
    if isolation not in ISOLATION_MODES:
        raise DeployConfigError(
            f"isolation must be one of {', '.join(ISOLATION_MODES)}, got {isolation!r}"
        )


def _refuse_insecure(what: str, host: str, private_network: bool) -> None:
    if is_loopback(host) or private_network:
        return
    raise DeployConfigError(
        f"{what}: refusing --insecure on {host!r}, which is not a loopback address; "
        "outside loopback use TLS (certificates from `python -m florg_tools.deploy.certs`), "
        "or pass private_network=True only for an isolated network that publishes no port"
    )


def deployment_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment variables every deployment process (SuperLink, SuperNode, SuperExec,
    ``flwr`` CLI) needs, merged over ``base``: no runtime ``uv sync`` of the app's
    dependencies (it would build a fresh environment and pull CUDA torch), no update
    check, no telemetry, unbuffered logs."""
    env = dict(base or {})
    env.update(
        {
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "FLWR_TELEMETRY_ENABLED": "0",
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def superlink_argv(
    *,
    host: str = "0.0.0.0",
    port: int = DEFAULT_SUPERLINK_PORT,
    tls: ServerTLS | None = None,
    insecure: bool = False,
    isolation: str = "subprocess",
    enable_supernode_auth: bool = False,
    database: PathLike | None = None,
    private_network: bool = False,
    executable: str = "flower-superlink",
) -> list[str]:
    """``flower-superlink`` on ``host:port`` (Fleet, Control and Runtime APIs).

    Exactly one of ``tls`` and ``insecure`` must be given; ``insecure`` only on a loopback
    ``host``. ``isolation="process"`` expects a separate ``superexec_argv`` for the
    ServerApp. ``enable_supernode_auth`` needs ``tls``. State is in memory unless
    ``database`` (an SQLite file) is given.
    """
    _check_port(port, "flower-superlink")
    _check_isolation(isolation)
    if (tls is None) == (not insecure):
        raise DeployConfigError(
            "flower-superlink: give either TLS files (tls=ServerTLS(ca, cert, key)) "
            "or insecure=True (loopback only), not both and not neither"
        )
    argv = [executable]
    if insecure:
        _refuse_insecure("flower-superlink", host, private_network)
        if enable_supernode_auth:
            raise DeployConfigError(
                "flower-superlink: --enable-supernode-auth requires TLS (Flower refuses "
                "it with --insecure)"
            )
        argv.append("--insecure")
    else:
        assert tls is not None
        argv += [
            "--ssl-ca-certfile",
            str(tls.ca_certfile),
            "--ssl-certfile",
            str(tls.certfile),
            "--ssl-keyfile",
            str(tls.keyfile),
        ]
    argv += ["--host", host, "--port", str(port), "--isolation", isolation]
    if enable_supernode_auth:
        argv.append("--enable-supernode-auth")
    if database is not None:
        argv += ["--database", str(database)]
    argv.append("--disable-runtime-dependency-installation")
    return argv


def _node_config_value(key: str, value: str | int | float | bool) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    text = str(value)
    if "'" not in text:
        return f"'{text}'"  # TOML literal string: backslashes stay as they are
    if '"' in text or "\\" in text:
        raise DeployConfigError(f"node-config {key}: cannot quote {text!r} (mixes ' and \")")
    return f'"{text}"'


def node_config_string(
    partition_id: int,
    num_partitions: int,
    data_path: PathLike | None = None,
    extra: Mapping[str, str | int | float | bool] | None = None,
    rank: int | None = None,
) -> str:
    """The ``--node-config`` value: ``partition-id=I num-partitions=N [data-path='P']
    [rank=R]`` (``rank``: the node's adapter rank, issue 30; it wins over the run's
    ``client-ranks``)."""
    for name, value in (("partition-id", partition_id), ("num-partitions", num_partitions)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise DeployConfigError(f"{name} must be an int, got {value!r}")
    if num_partitions < 1:
        raise DeployConfigError(f"num-partitions must be >= 1, got {num_partitions}")
    if not 0 <= partition_id < num_partitions:
        raise DeployConfigError(
            f"partition-id {partition_id} outside [0, {num_partitions}) "
            f"(num-partitions={num_partitions})"
        )
    items: dict[str, str | int | float | bool] = {
        "partition-id": partition_id,
        "num-partitions": num_partitions,
    }
    if data_path is not None:
        if not str(data_path):
            raise DeployConfigError("data-path must not be empty")
        items["data-path"] = str(data_path)
    if rank is not None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise DeployConfigError(f"rank must be a positive int, got {rank!r}")
        items["rank"] = rank
    for key, value in (extra or {}).items():
        if key in items or not key or any(c in key for c in " =\"'"):
            raise DeployConfigError(f"node-config key {key!r} is reserved or malformed")
        items[key] = value
    return " ".join(f"{k}={_node_config_value(k, v)}" for k, v in items.items())


def supernode_argv(
    superlink: str,
    *,
    partition_id: int,
    num_partitions: int,
    data_path: PathLike | None = None,
    rank: int | None = None,
    root_certificates: PathLike | None = None,
    insecure: bool = False,
    isolation: str = "subprocess",
    runtime_host: str | None = None,
    runtime_port: int | None = None,
    runtime_tls: ServerTLS | None = None,
    auth_private_key: PathLike | None = None,
    max_retries: int | None = None,
    max_wait_time: float | None = None,
    private_network: bool = False,
    node_config: Mapping[str, str | int | float | bool] | None = None,
    executable: str = "flower-supernode",
) -> list[str]:
    """``flower-supernode`` for partition ``partition_id`` of ``num_partitions``.

    ``superlink`` is the SuperLink's ``host:port``. Exactly one of ``root_certificates``
    (the CA that signed the SuperLink's certificate) and ``insecure`` (only towards a
    loopback SuperLink). ``data_path`` is this node's own data (read by its ClientApp
    instead of the run config's ``data-path``); ``rank`` its adapter rank (node-config
    ``rank``, issue 30). ``runtime_host``/``runtime_port`` is the
    node's own Runtime API (default ``127.0.0.1:9094``; give each node on one host its own
    port); with ``isolation="process"`` a separate ``superexec_argv`` connects there, and a
    non-loopback ``runtime_host`` then needs ``runtime_tls`` (or ``private_network``).
    ``auth_private_key``: the node's EC private key for SuperNode authentication.
    ``node_config``: further node-config keys (``slowdown``: a straggler for trials).
    """
    host, _ = split_address(superlink)
    _check_isolation(isolation)
    if (root_certificates is None) == (not insecure):
        raise DeployConfigError(
            "flower-supernode: give either root_certificates (the CA certificate) or "
            "insecure=True (loopback SuperLink only), not both and not neither"
        )
    argv = [executable]
    if insecure:
        _refuse_insecure(f"flower-supernode --superlink {superlink}", host, private_network)
        if auth_private_key is not None:
            raise DeployConfigError(
                "flower-supernode: SuperNode authentication requires TLS "
                "(root_certificates), not insecure=True"
            )
        argv.append("--insecure")
    else:
        argv += ["--root-certificates", str(root_certificates)]
    argv += ["--superlink", superlink]
    argv += [
        "--node-config",
        node_config_string(partition_id, num_partitions, data_path, node_config, rank=rank),
    ]
    argv += ["--isolation", isolation]
    if runtime_host is not None:
        if runtime_tls is None:
            _refuse_insecure(
                f"flower-supernode Runtime API on {runtime_host}", runtime_host, private_network
            )
        argv += ["--host", runtime_host]
    if runtime_port is not None:
        _check_port(runtime_port, "flower-supernode Runtime API")
        argv += ["--port", str(runtime_port)]
    if runtime_tls is not None:
        argv += [
            "--ssl-certfile",
            str(runtime_tls.certfile),
            "--ssl-keyfile",
            str(runtime_tls.keyfile),
            "--ssl-ca-certfile",
            str(runtime_tls.ca_certfile),
        ]
    if auth_private_key is not None:
        argv += ["--auth-supernode-private-key", str(auth_private_key)]
    if max_retries is not None:
        argv += ["--max-retries", str(int(max_retries))]
    if max_wait_time is not None:
        argv += ["--max-wait-time", str(float(max_wait_time))]
    return argv


def superexec_argv(
    runtime_api_address: str,
    *,
    root_certificates: PathLike | None = None,
    insecure: bool = False,
    parent_pid: int | None = None,
    private_network: bool = False,
    executable: str = "flower-superexec",
) -> list[str]:
    """``flower-superexec`` for ``--isolation process``: it runs the ServerApps of the
    SuperLink, or the ClientApps of the SuperNode, whose Runtime API is at
    ``runtime_api_address`` (the SuperLink's ``host:port``, or the SuperNode's
    ``--host:--port``). Exactly one of ``root_certificates`` (the CA of that server's
    certificate) and ``insecure`` (loopback only). ``parent_pid``: exit with that process.
    """
    host, _ = split_address(runtime_api_address)
    if (root_certificates is None) == (not insecure):
        raise DeployConfigError(
            "flower-superexec: give either root_certificates or insecure=True "
            "(loopback Runtime API only), not both and not neither"
        )
    argv = [executable]
    if insecure:
        _refuse_insecure(
            f"flower-superexec --runtime-api-address {runtime_api_address}",
            host,
            private_network,
        )
        argv.append("--insecure")
    else:
        argv += ["--root-certificates", str(root_certificates)]
    argv += ["--runtime-api-address", runtime_api_address]
    if parent_pid is not None:
        argv += ["--parent-pid", str(int(parent_pid))]
    return argv


def local_runtime_address(host: str, port: int) -> str:
    """The address a process on the same machine dials for a server bound to host:port."""
    return format_address(_bind_target(host), port)
