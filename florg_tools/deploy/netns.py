"""Network namespaces that put each SuperNode behind its own interface on one machine.

``Namespaces(count)`` creates, for node i, a namespace with a veth pair: the host end
``<prefix>h<i>`` with ``10.B.i.1/24`` and the namespace end ``<prefix>n<i>`` with
``10.B.i.2/24`` (``B`` picked among unused ``10.200-249`` ranges). A SuperNode started
with ``ip netns exec NS`` then reaches the SuperLink only through its veth, at
``10.B.i.1``: traffic really crosses an interface. Leaving the context deletes the
namespaces and the host ends of the veths, also after an error. Needs root (or
CAP_NET_ADMIN) and ``ip`` (iproute2); ``NetnsUnavailable`` says why otherwise.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass, field

__all__ = ["NetnsUnavailable", "Namespace", "Namespaces"]


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be created here (the message says why)."""


@dataclass(frozen=True)
class Namespace:
    name: str
    host_veth: str
    node_veth: str
    host_address: str  # the SuperLink side, dialled from inside the namespace
    node_address: str


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise NetnsUnavailable(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")
    return proc


def _used_networks() -> list[ipaddress.IPv4Network]:
    out = _ip("-4", "-o", "addr", "show", check=False).stdout
    nets = []
    for line in out.splitlines():
        parts = line.split()
        if "inet" in parts:
            nets.append(ipaddress.ip_interface(parts[parts.index("inet") + 1]).network)
    return nets


@dataclass
class Namespaces:
    """``count`` namespaces, one veth pair each; a context manager."""

    count: int
    prefix: str = field(default_factory=lambda: "fl" + secrets.token_hex(3))
    created: list[Namespace] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not 1 <= self.count <= 250:
            raise ValueError(f"namespace count must be in 1..250, got {self.count}")
        if len(self.prefix) + 1 + len(str(self.count)) > 15:
            raise ValueError(f"prefix {self.prefix!r} too long for interface names")

    @staticmethod
    def check_available() -> None:
        """Raise NetnsUnavailable with the reason when namespaces cannot work here."""
        if shutil.which("ip") is None:
            raise NetnsUnavailable("the `ip` command (iproute2) is not installed")
        if hasattr(os, "geteuid") and os.geteuid() != 0:
            raise NetnsUnavailable("creating network namespaces needs root (CAP_NET_ADMIN)")

    def _pick_block(self) -> int:
        used = _used_networks()
        for second in range(200, 250):
            block = ipaddress.ip_network(f"10.{second}.0.0/16")
            if not any(net.overlaps(block) for net in used):
                return second
        raise NetnsUnavailable("no free 10.200-249.0.0/16 block for the veth addresses")

    def create(self) -> list[Namespace]:
        self.check_available()
        second = self._pick_block()
        try:
            for i in range(self.count):
                ns = Namespace(
                    name=f"{self.prefix}-{i}",
                    host_veth=f"{self.prefix}h{i}",
                    node_veth=f"{self.prefix}n{i}",
                    host_address=f"10.{second}.{i}.1",
                    node_address=f"10.{second}.{i}.2",
                )
                _ip("netns", "add", ns.name)
                self.created.append(ns)
                _ip("link", "add", ns.host_veth, "type", "veth", "peer", "name", ns.node_veth)
                _ip("link", "set", ns.node_veth, "netns", ns.name)
                _ip("addr", "add", f"{ns.host_address}/24", "dev", ns.host_veth)
                _ip("link", "set", ns.host_veth, "up")
                inside = ("netns", "exec", ns.name, "ip")
                _ip(*inside, "addr", "add", f"{ns.node_address}/24", "dev", ns.node_veth)
                _ip(*inside, "link", "set", ns.node_veth, "up")
                _ip(*inside, "link", "set", "lo", "up")
        except BaseException:
            self.delete()
            raise
        return list(self.created)

    def delete(self) -> list[str]:
        """Delete every namespace and veth made here; the names that could not be removed."""
        left: list[str] = []
        for ns in reversed(self.created):
            _ip("link", "del", ns.host_veth, check=False)  # removes its peer too
            _ip("netns", "del", ns.name, check=False)
            if _ip("netns", "pids", ns.name, check=False).returncode == 0:
                left.append(ns.name)
            if _ip("link", "show", ns.host_veth, check=False).returncode == 0:
                left.append(ns.host_veth)
        self.created.clear()
        return left

    def __enter__(self) -> list[Namespace]:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.delete()
