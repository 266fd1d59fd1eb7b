"""Pod networking on this machine: one bridge per harness, a network namespace and veth per pod.

The harness owns a /16 (10.Y.0.0/16, Y chosen so nothing on the machine uses it); the bridge holds
10.Y.0.1 (the gateway, and the address pods reach the API server on), node n gets podCIDR 10.Y.n.0/24,
and a pod's eth0 gets an address from its node's range with the whole /16 on-link, so pods on different
fake nodes talk across the bridge without the host forwarding anything. No route or NAT leaves the
machine: the host reaches pod IPs over the bridge, and nothing else is configured.

Every name starts with `kwt` (bridge `kwt<4 hex>`, namespaces `kwt-<pod uid>`, veths `kwv<12 hex>`),
so a leak is easy to find: `ip netns | grep kwt`, `ip link | grep kwt`; `existing()` checks one
harness's own names (other harnesses may be running beside it).
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
import secrets
import socket
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

NETNS_DIR = Path("/run/netns")
PREFIX = "kwt"


class NetworkError(RuntimeError):
    """An `ip` command failed; the message carries the command and its stderr."""


def ip(*args: str, input: str | None = None, check: bool = True) -> str:
    """Run iproute2's `ip`; raise NetworkError with its stderr when it fails."""
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, input=input)
    if check and proc.returncode != 0:
        raise NetworkError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc.stdout


def _used_second_octets() -> set[int]:
    """Second octets of 10.x addresses and routes already on this machine."""
    text = ip("-o", "addr") + ip("route", "show", "table", "all", check=False)
    return {int(m) for m in re.findall(r"\b10\.(\d{1,3})\.\d{1,3}\.\d{1,3}", text)}


def netns_name(pod_uid: str) -> str:
    return f"{PREFIX}-{pod_uid}"


def veth_name(pod_uid: str) -> str:
    """Host side of a pod's veth: at most 15 characters (IFNAMSIZ)."""
    return PREFIX + "v" + hashlib.sha256(pod_uid.encode()).hexdigest()[:11]


@dataclass
class PodNetwork:
    """The bridge and the address plan; `setup()` creates the bridge, `teardown()` removes it."""

    second_octet: int = 0  # Y of 10.Y.0.0/16 (0: pick a free one in setup)
    bridge: str = field(default_factory=lambda: f"{PREFIX}{secrets.token_hex(2)}")
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _used: dict[int, set[int]] = field(default_factory=dict)  # node index -> host parts in use

    def __post_init__(self) -> None:
        if not self.second_octet:
            taken = _used_second_octets()
            free = [y for y in range(200, 250) if y not in taken]
            if not free:
                raise NetworkError("no free 10.Y.0.0/16 for the pod network (10.200-249 all in use)")
            self.second_octet = secrets.choice(free)

    @property
    def gateway(self) -> str:
        """The bridge's address: pods reach the host (and the API server proxy) here."""
        return f"10.{self.second_octet}.0.1"

    @property
    def cidr(self) -> str:
        return f"10.{self.second_octet}.0.0/16"

    def pod_cidr(self, node_index: int) -> str:
        if not 1 <= node_index <= 254:
            raise NetworkError(f"node index {node_index} outside 1..254")
        return f"10.{self.second_octet}.{node_index}.0/24"

    def setup(self, attempts: int = 5) -> None:
        """Create the bridge; if another harness took the same /16 meanwhile, pick another one."""
        ip("link", "add", self.bridge, "type", "bridge")
        for _ in range(attempts):
            ip("addr", "add", f"{self.gateway}/16", "dev", self.bridge)
            others = [
                line
                for line in ip("-o", "addr").splitlines()
                if f" 10.{self.second_octet}." in line and f" {self.bridge} " not in f" {line.split()[1]} "
            ]
            if not others:
                ip("link", "set", self.bridge, "up")
                return
            ip("addr", "flush", "dev", self.bridge)
            self.second_octet = 0
            self.__post_init__()
        self.teardown()
        raise NetworkError("no free 10.Y.0.0/16 for the pod network after several tries")

    def teardown(self) -> None:
        ip("link", "del", self.bridge, check=False)

    def allocate(self, node_index: int) -> str:
        """A free pod IP in the node's podCIDR (.2 .. .254)."""
        with self._lock:
            used = self._used.setdefault(node_index, set())
            for host in range(2, 255):
                if host not in used:
                    used.add(host)
                    return f"10.{self.second_octet}.{node_index}.{host}"
        raise NetworkError(f"podCIDR {self.pod_cidr(node_index)} is full")

    def release(self, address: str) -> None:
        parts = [int(p) for p in address.split(".")]
        with self._lock:
            self._used.get(parts[2], set()).discard(parts[3])

    def create_pod_netns(self, pod_uid: str, address: str, hostname: str) -> Path:
        """A network namespace with lo and eth0 (address/16 on the bridge); returns its path."""
        ns, host_if = netns_name(pod_uid), veth_name(pod_uid)
        peer = host_if.replace(f"{PREFIX}v", f"{PREFIX}p", 1)
        ipaddress.ip_address(address)  # refuse garbage before touching the machine
        ip("netns", "add", ns)
        try:
            ip("link", "add", host_if, "type", "veth", "peer", "name", peer)
            ip("link", "set", peer, "netns", ns)
            ip("link", "set", host_if, "master", self.bridge, "up")
            batch = (
                f"link set {peer} name eth0\n"
                f"addr add {address}/16 dev eth0\n"
                "link set eth0 up\n"
                "link set lo up\n"
                f"route add default via {self.gateway}\n"
            )
            ip("-n", ns, "-batch", "-", input=batch)
        except BaseException:
            self.delete_pod_netns(pod_uid)
            raise
        return NETNS_DIR / ns

    def delete_pod_netns(self, pod_uid: str) -> None:
        """Remove the namespace (its eth0 and so the veth pair go with it); idempotent."""
        ip("link", "del", veth_name(pod_uid), check=False)
        ip("netns", "del", netns_name(pod_uid), check=False)


def existing(bridge: str, pod_uids: set[str]) -> list[str]:
    """Which of this bridge and these pods' namespaces and veths still exist (for cleanup checks)."""
    links = set(re.findall(r"^\d+: ([\w-]+)", ip("-o", "link"), re.M))
    namespaces = {line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()}
    found = [bridge] if bridge in links else []
    found += [veth_name(uid) for uid in sorted(pod_uids) if veth_name(uid) in links]
    return found + [netns_name(uid) for uid in sorted(pod_uids) if netns_name(uid) in namespaces]


def wait_listening(address: str, port: int, timeout_s: float = 5.0) -> bool:
    """True once a TCP connect to address:port succeeds."""
    try:
        with socket.create_connection((address, port), timeout=timeout_s):
            return True
    except OSError:
        return False
