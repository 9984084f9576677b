"""Hosts on one machine for tests that need a real network between processes: each host a
network namespace (`ip netns`) with one veth port on a bridge, and a partition that drops
every packet to and from a host, the way a cut cable or a dead switch port does.

    with Network() as net:            # the bridge, and this (root) namespace as host "main"
        a = net.add_host("a")         # a namespace; a.ip is its address on the bridge
        p = subprocess.Popen(a.run(["ds3", "ingester", "--host", a.ip, ...]))
        net.cut(a)                    # a's port leaves the bridge: packets vanish both ways
        net.heal(a)                   # back on the bridge; TCP's retransmissions get through

A cut is a blackhole, not a refusal: a connection in flight neither fails nor finishes (what
was sent and not yet acknowledged is retransmitted, and may arrive after the heal), and a new
connection's SYN goes unanswered. Neighbour (ARP) entries are made permanent so that no
"No route to host" gives the cut away. The addresses (10.213.N.0/24, N from the pid) exist only
inside this machine's namespaces; servers bind them and nothing else. Needs root and iproute2
with bridge and veth support: `available()` says why not.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from dataclasses import dataclass
from types import TracebackType
from typing import Self


def _ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def available() -> str | None:
    """None if network namespaces can be made here, else why not."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    name = f"ds3probe{os.getpid()}"
    try:
        _ip("netns", "add", name)
        try:
            _ip("-n", name, "link", "add", "br0", "type", "bridge")
            _ip("-n", name, "link", "add", "v0", "type", "veth", "peer", "name", "v1")
        finally:
            _ip("netns", "del", name)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        return f"cannot make a namespace with a bridge and veth: {e}"
    return None


@dataclass(frozen=True)
class Host:
    name: str  # short name given by the test
    netns: str | None  # None: the root namespace (the test process itself)
    ip: str
    port_name: str  # its veth end on the bridge (in the bridge's namespace)

    def run(self, argv: list[str]) -> list[str]:
        """`argv` as a command line that runs on this host."""
        return argv if self.netns is None else ["ip", "netns", "exec", self.netns, *argv]


class Network:
    """A bridge in a namespace of its own; the root namespace joins it as host "main"."""

    def __init__(self) -> None:
        n = os.getpid() % 250 + 1
        self.tag = f"d3t{os.getpid()}"
        self.subnet = f"10.213.{n}"
        self.bridge_ns = f"{self.tag}-br"
        self.hosts: dict[str, Host] = {}
        self._made_ns: list[str] = []
        self._root_link: str | None = None
        self.main: Host | None = None

    def __enter__(self) -> Self:
        try:
            _ip("netns", "add", self.bridge_ns)
            self._made_ns.append(self.bridge_ns)
            _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
            self.main = self._join("main", None)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def add_host(self, name: str) -> Host:
        ns = f"{self.tag}-{name}"
        _ip("netns", "add", ns)
        self._made_ns.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")
        return self._join(name, ns)

    def _join(self, name: str, ns: str | None) -> Host:
        index = len(self.hosts) + 1
        outer, inner = f"{self.tag[-6:]}p{index}", f"{self.tag[-6:]}h{index}"  # <= 15 characters
        # Made here (the root namespace), then each end moved to where it belongs.
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        _ip("link", "set", outer, "netns", self.bridge_ns)
        if ns is None:
            self._root_link = inner
        else:
            _ip("link", "set", inner, "netns", ns)
        _ip("-n", self.bridge_ns, "link", "set", outer, "master", "br0")
        _ip("-n", self.bridge_ns, "link", "set", outer, "up")
        host = Host(name, ns, f"{self.subnet}.{index}", outer)
        at = [] if ns is None else ["-n", ns]
        _ip(*at, "addr", "add", f"{host.ip}/24", "dev", inner)
        _ip(*at, "link", "set", inner, "up")
        mac = _ip(*at, "-br", "link", "show", inner).split()[2]
        # Permanent neighbour entries both ways, so a cut looks like silence, not "no route".
        for other in self.hosts.values():
            other_at = [] if other.netns is None else ["-n", other.netns]
            other_dev = self._dev(other)
            other_mac = _ip(*other_at, "-br", "link", "show", other_dev).split()[2]
            _ip(*at, "neigh", "replace", other.ip, "lladdr", other_mac, "dev", inner, "nud", "permanent")
            _ip(*other_at, "neigh", "replace", host.ip, "lladdr", mac, "dev", other_dev, "nud", "permanent")
        self.hosts[name] = host
        return host

    def _dev(self, host: Host) -> str:
        index = list(self.hosts).index(host.name) + 1
        return f"{self.tag[-6:]}h{index}"

    def cut(self, host: Host) -> None:
        """Drop every packet to and from `host` (its port leaves the bridge)."""
        _ip("-n", self.bridge_ns, "link", "set", host.port_name, "nomaster")

    def heal(self, host: Host) -> None:
        _ip("-n", self.bridge_ns, "link", "set", host.port_name, "master", "br0")

    def close(self) -> None:
        for ns in reversed(self._made_ns):
            # Processes still in a namespace keep it alive; the test stops them first.
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                _ip("netns", "del", ns)
        self._made_ns.clear()
        if self._root_link is not None:  # normally gone with its peer in the bridge's namespace
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                _ip("link", "del", self._root_link)
            self._root_link = None
