"""A network namespace reached over a veth pair, whose link a test can cut and restore.

Before the namespace side gets its address, the host routes the test subnet into a blackhole (at a worse
metric than the veth's own route): while the link is down, no packet for that subnet can leave by the
default route. Everything made here is removed on exit, processes inside the namespace included.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Namespace:
    name: str
    host_link: str
    inner_link: str
    host_address: str
    address: str
    subnet: str

    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]

    def set_link(self, up: bool) -> None:
        """Take the namespace side of the veth pair down (a cut) or up again."""
        _ip("-n", self.name, "link", "set", self.inner_link, "up" if up else "down")

    def pids(self) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.name], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]


def netns_unavailable() -> str | None:
    """None when this process can create namespaces and veth pairs, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the ip command is missing (apt-get install iproute2)"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _unused_subnet() -> ipaddress.IPv4Network:
    """A /24 under 10.213.0.0/16 that no route of this host mentions."""
    routes = subprocess.run(["ip", "-4", "route", "show", "table", "all"], capture_output=True, text=True).stdout
    for _ in range(100):
        subnet = ipaddress.IPv4Network(f"10.213.{secrets.randbelow(256)}.0/24")
        if str(subnet.network_address)[:-1] not in routes:
            return subnet
    raise RuntimeError("no free 10.213.x.0/24 subnet for the test namespace")


@contextlib.contextmanager
def network_namespace() -> Iterator[Namespace]:
    tag = secrets.token_hex(3)
    subnet = _unused_subnet()
    host_address, address = (str(a) for a in list(subnet.hosts())[:2])
    ns = Namespace(f"ddt-{tag}", f"ddth{tag}", f"ddtn{tag}", host_address, address, str(subnet))
    cleanups: list[list[str]] = []
    try:
        _ip("route", "add", "blackhole", ns.subnet, "metric", "1000")
        cleanups.append(["route", "del", "blackhole", ns.subnet, "metric", "1000"])
        _ip("netns", "add", ns.name)
        cleanups.append(["netns", "del", ns.name])
        _ip("link", "add", ns.host_link, "type", "veth", "peer", "name", ns.inner_link)
        cleanups.append(["link", "del", ns.host_link])
        _ip("link", "set", ns.inner_link, "netns", ns.name)
        _ip("addr", "add", f"{host_address}/{subnet.prefixlen}", "dev", ns.host_link)
        _ip("link", "set", ns.host_link, "up")
        _ip("-n", ns.name, "link", "set", "lo", "up")
        _ip("-n", ns.name, "addr", "add", f"{address}/{subnet.prefixlen}", "dev", ns.inner_link)
        _ip("-n", ns.name, "link", "set", ns.inner_link, "up")
        yield ns
    finally:
        for pid in ns.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for args in reversed(cleanups):
            subprocess.run(["ip", *args], capture_output=True)  # the veth may already be gone with the namespace
