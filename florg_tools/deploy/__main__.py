"""Command line for deployments: certificates, a SuperLink with SuperNodes, one SuperNode.

    python -m florg_tools.deploy certs --out DIR --san HOST [--node-keys N]
    python -m florg_tools.deploy up --nodes 3 [--certs DIR | --insecure] [options]
    python -m florg_tools.deploy superlink --certs DIR [--host H] [--port P] [--node-auth]
    python -m florg_tools.deploy node --superlink HOST:PORT --partition-id I --num-partitions N
        (--root-certificates CA | --insecure) [--data-path P] [--rank R] [--auth-key KEY]
    python -m florg_tools.deploy connection --name NAME --address HOST:PORT (... | --insecure)

``up`` starts everything on this machine, writes the connection NAME into $FLWR_HOME and
waits; Ctrl-C stops every process it started, by pid. ``superlink`` and ``node`` replace
themselves with the one Flower process (``exec``). Options: docs/deploy-superlink.md.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

from florg_tools.deploy import certs as certs_cli
from florg_tools.deploy.certs import (
    CertificateSet,
    generate_certificates,
    generate_node_keys,
    require_files,
)
from florg_tools.deploy.commands import (
    DEFAULT_SUPERLINK_PORT,
    DeployConfigError,
    ServerTLS,
    deployment_env,
    is_loopback,
    superlink_argv,
    supernode_argv,
)
from florg_tools.flwr_cli import LaunchError, console_script
from florg_tools.flwr_cli import resolve_flwr_home as _flwr_home
from florg_tools.flwr_home import write_tls_connection


def _exec(argv: list[str]) -> int:
    """Replace this process with ``argv`` (resolved in this venv) and the deployment env."""
    command = [*console_script(argv[0]), *argv[1:]]
    env = deployment_env(os.environ)
    print("$ " + " ".join(command), file=sys.stderr, flush=True)
    os.execvpe(command[0], command, env)
    return 1  # not reached


def _server_tls(directory: Path) -> ServerTLS:
    tls = ServerTLS(directory / "ca.crt", directory / "server.pem", directory / "server.key")
    require_files(tls.ca_certfile, tls.certfile, tls.keyfile)
    return tls


def cmd_superlink(args: argparse.Namespace) -> int:
    tls = None if args.insecure else _server_tls(args.certs)
    argv = superlink_argv(
        host=args.host,
        port=args.port,
        tls=tls,
        insecure=args.insecure,
        isolation=args.isolation,
        enable_supernode_auth=args.node_auth,
        database=args.database,
    )
    return _exec(argv)


def cmd_node(args: argparse.Namespace) -> int:
    if args.root_certificates is not None:
        require_files(args.root_certificates, what="root certificate")
    if args.auth_key is not None:
        require_files(args.auth_key, what="SuperNode private key")
    if args.data_path is not None and not Path(args.data_path).expanduser().exists():
        raise DeployConfigError(f"--data-path {args.data_path} does not exist on this machine")
    argv = supernode_argv(
        args.superlink,
        partition_id=args.partition_id,
        num_partitions=args.num_partitions,
        data_path=Path(args.data_path).expanduser().resolve() if args.data_path else None,
        rank=args.rank,
        root_certificates=args.root_certificates,
        insecure=args.insecure,
        isolation=args.isolation,
        runtime_port=args.runtime_port,
        auth_private_key=args.auth_key,
    )
    return _exec(argv)


def cmd_connection(args: argparse.Namespace) -> int:
    path = write_tls_connection(
        _flwr_home(args.flwr_home),
        args.name,
        args.address,
        root_certificates=args.root_certificates,
        insecure=args.insecure,
        set_default=not args.no_default,
    )
    print(f"# wrote connection '{args.name}' -> {args.address} into {path}", file=sys.stderr)
    print(f"export FLWR_HOME={path.parent}")
    return 0


def parse_node_ranks(text: str | None, nodes: int) -> list[int]:
    """``--node-ranks 2,4,8``: one positive rank per node (``[]`` without the option)."""
    if not text:
        return []
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != nodes or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise DeployConfigError(
            f"--node-ranks {text!r}: give {nodes} positive integer ranks, one per node"
        )
    return [int(p) for p in parts]


def cmd_up(args: argparse.Namespace) -> int:
    from florg_tools.deploy.deployment import Deployment, register_node, thread_env
    from florg_tools.deploy.netns import Namespaces

    directory = args.dir.expanduser().resolve()
    node_ranks = parse_node_ranks(args.node_ranks, args.nodes)
    if args.netns and is_loopback(args.host):
        # The nodes dial the host side of their veth: the SuperLink must listen there too.
        print("[deploy] --netns: the SuperLink binds 0.0.0.0 (TLS)", file=sys.stderr)
        args.host = "0.0.0.0"
    namespaces = Namespaces(args.nodes) if args.netns else None
    spaces = namespaces.create() if namespaces is not None else []
    certs: CertificateSet | None = None
    try:
        cert_dir = (args.certs or directory / "certs").expanduser().resolve()
        if not args.insecure:
            bound = [] if args.host in ("0.0.0.0", "::") else [args.host]
            sans = [*args.san, *bound, *(ns.host_address for ns in spaces)]
            certs = generate_certificates(cert_dir, sans)
        # Existing pairs (e.g. from `python -m florg_tools.deploy.certs --node-keys N`) are kept.
        keys = generate_node_keys(cert_dir / "node-keys", args.nodes) if args.node_auth else []
        env = thread_env(args.threads_per_node or max(1, (os.cpu_count() or 1) // args.nodes))
        with Deployment(
            directory,
            certs=certs,
            bind_host=args.host,
            port=args.port,
            isolation=args.isolation,
            node_auth=args.node_auth,
            connection=args.connection,
            cwd=Path.cwd(),
            extra_env=env,
        ) as deployment:
            deployment.start_superlink()
            for key in keys:
                register_node(deployment.flwr_home, deployment.connection, key.public_key)
            for i in range(args.nodes):
                data_path = args.data_path_template.format(i=i) if args.data_path_template else None
                deployment.start_supernode(
                    i,
                    args.num_partitions or args.nodes,
                    superlink_host=spaces[i].host_address if spaces else None,
                    netns=spaces[i].name if spaces else None,
                    data_path=Path(data_path).resolve() if data_path else None,
                    rank=node_ranks[i] if node_ranks else None,
                    auth_key=keys[i] if keys else None,
                    wait=False,
                )
            deployment.wait_registered()
            home = _flwr_home(args.flwr_home)
            write_tls_connection(
                home,
                args.connection,
                deployment.address,
                root_certificates=deployment.ca_cert,
                insecure=certs is None,
            )
            print(
                f"[deploy] SuperLink {deployment.address} ({'TLS' if certs else 'insecure'}), "
                f"{args.nodes} SuperNodes {deployment.node_ids()}; logs in "
                f"{deployment.logs}\n[deploy] run the app with:\n"
                f"  FLWR_HOME={home} flwr run . {args.connection} --stream\n"
                f"  python -m florg_tools.launch --flwr-home {home} "
                f"--connection {args.connection}\n[deploy] Ctrl-C stops everything.",
                flush=True,
            )
            stop = threading.Event()
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: stop.set())
            while not stop.wait(1.0):
                if deployment.superlink is None or not deployment.superlink.alive():
                    print("[deploy] the SuperLink exited", file=sys.stderr)
                    return 1
    finally:
        if namespaces is not None:
            namespaces.delete()
    return 0


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="florg deploy", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("certs", help="generate a demo CA, server certificate and node keys")

    up = sub.add_parser("up", help="SuperLink + N SuperNodes on this machine")
    up.add_argument("--nodes", type=int, required=True)
    up.add_argument(
        "--num-partitions",
        type=int,
        default=None,
        help="partitions in the federation (default: --nodes); more when other machines "
        "run the remaining partitions with `node`",
    )
    up.add_argument("--certs", type=Path, default=None, help="cert folder (made if missing)")
    up.add_argument("--insecure", action="store_true", help="no TLS (loopback --host only)")
    up.add_argument("--tls", action="store_true", help="TLS (the default; for clarity)")
    up.add_argument("--host", default="127.0.0.1", help="SuperLink bind address")
    up.add_argument("--port", type=int, default=None, help="SuperLink port (default: free)")
    up.add_argument("--san", action="append", default=[], help="extra certificate name")
    up.add_argument("--node-auth", action="store_true", help="SuperNode authentication")
    up.add_argument("--isolation", choices=("subprocess", "process"), default="subprocess")
    up.add_argument("--netns", action="store_true", help="each SuperNode in its own netns")
    up.add_argument("--data-path-template", default=None, help="per-node data, e.g. d/{i}")
    up.add_argument(
        "--node-ranks",
        default=None,
        help="per-node adapter ranks, one per node (node-config rank; e.g. 2,4,8)",
    )
    up.add_argument("--dir", type=Path, default=Path(".deploy"), help="logs, state, keys")
    up.add_argument("--connection", default="deployment", help="connection name")
    up.add_argument("--flwr-home", type=Path, default=None)
    up.add_argument("--threads-per-node", type=int, default=None)

    link = sub.add_parser("superlink", help="run flower-superlink (server machine)")
    link.add_argument("--certs", type=Path, default=None, help="folder with ca.crt, server.*")
    link.add_argument("--insecure", action="store_true", help="no TLS (loopback --host only)")
    link.add_argument("--host", default="0.0.0.0")
    link.add_argument("--port", type=int, default=DEFAULT_SUPERLINK_PORT)
    link.add_argument("--node-auth", action="store_true")
    link.add_argument("--isolation", choices=("subprocess", "process"), default="subprocess")
    link.add_argument("--database", default=None, help="SQLite state file (default: memory)")

    node = sub.add_parser("node", help="run one flower-supernode (client machine)")
    node.add_argument("--superlink", required=True, help="HOST:PORT")
    node.add_argument("--partition-id", type=int, required=True)
    node.add_argument("--num-partitions", type=int, required=True)
    node.add_argument("--data-path", default=None, help="this node's own data")
    node.add_argument("--rank", type=int, default=None, help="this node's adapter rank")
    node.add_argument("--root-certificates", type=Path, default=None, help="the CA certificate")
    node.add_argument("--insecure", action="store_true", help="no TLS (loopback only)")
    node.add_argument("--auth-key", type=Path, default=None, help="node private key")
    node.add_argument("--isolation", choices=("subprocess", "process"), default="subprocess")
    node.add_argument("--runtime-port", type=int, default=None, help="node Runtime API port")

    conn = sub.add_parser("connection", help="write a TLS connection into FLWR_HOME")
    conn.add_argument("--name", required=True)
    conn.add_argument("--address", required=True, help="HOST:PORT of the SuperLink")
    conn.add_argument("--root-certificates", type=Path, default=None)
    conn.add_argument("--insecure", action="store_true")
    conn.add_argument("--flwr-home", type=Path, default=None)
    conn.add_argument("--no-default", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["certs"]:
        return certs_cli.main(argv[1:])
    args = _build_parser().parse_args(argv)
    if getattr(args, "insecure", False) and getattr(args, "tls", False):
        print("error: --tls and --insecure exclude each other", file=sys.stderr)
        return 2
    if args.command == "superlink" and not args.insecure and args.certs is None:
        print("error: superlink needs --certs DIR (or --insecure on loopback)", file=sys.stderr)
        return 2
    handlers = {
        "up": cmd_up,
        "superlink": cmd_superlink,
        "node": cmd_node,
        "connection": cmd_connection,
    }
    try:
        return handlers[args.command](args)
    except (DeployConfigError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except LaunchError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
