"""The test cluster's pod network: one Linux bridge on this machine, pods attached by the CNI bridge plugin.

The harness owns a /16 (10.Y.0.0/16, Y chosen so nothing on the machine uses it); the bridge holds
10.Y.0.1, the address pods reach this host on (the API server through a forwarder, a loopback Hub,
the cluster DNS: CoreDNS on port 53, UDP and TCP, node/addons.py).
Node n's pods get addresses from 10.Y.n.0/24 (the host-local IPAM plugin), with the whole /16 on-link,
so pods on different nodes talk across the bridge.

Nothing a pod sends leaves the machine: the bridge plugin runs with `isGateway: false`, so it never
turns on IP forwarding, and a pod has no default route. Its one route off the /16 leads to the Service
range through the bridge address, where kube-proxy's DNAT (on this host, before routing) turns the
`kubernetes` Service into the API server's forwarder; any other Service address is dropped here, as the
host does not forward.

Every name starts with `kwt` (bridge `kwt<4 hex>`), so a leak is easy to find: `ip link | grep kwt`.
"""

from __future__ import annotations

import re
import secrets
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PREFIX = "kwt"
CNI_VERSION = "1.0.0"


class NetworkError(RuntimeError):
    """An `ip` command failed; the message carries the command and its stderr."""


def ip(*args: str, check: bool = True) -> str:
    """Run iproute2's `ip`; raise NetworkError with its stderr when it fails."""
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise NetworkError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc.stdout


def _used_second_octets() -> set[int]:
    """Second octets of 10.x addresses and routes already on this machine."""
    text = ip("-o", "addr") + ip("route", "show", "table", "all", check=False)
    return {int(m) for m in re.findall(r"\b10\.(\d{1,3})\.\d{1,3}\.\d{1,3}", text)}


@dataclass
class Bridge:
    """The bridge and the address plan; `setup()` creates the bridge, `teardown()` removes it."""

    second_octet: int = 0  # Y of 10.Y.0.0/16 (0: pick a free one)
    name: str = field(default_factory=lambda: f"{PREFIX}{secrets.token_hex(2)}")

    def __post_init__(self) -> None:
        if not self.second_octet:
            free = [y for y in range(200, 250) if y not in _used_second_octets()]
            if not free:
                raise NetworkError("no free 10.Y.0.0/16 for the pod network (10.200-249 all in use)")
            self.second_octet = secrets.choice(free)

    @property
    def gateway(self) -> str:
        """The bridge's address: pods reach this host here."""
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
        ip("link", "add", self.name, "type", "bridge")
        for _ in range(attempts):
            ip("addr", "add", f"{self.gateway}/16", "dev", self.name)
            others = [
                line
                for line in ip("-o", "addr").splitlines()
                if f" 10.{self.second_octet}." in line and line.split()[1] != self.name
            ]
            if not others:
                ip("link", "set", self.name, "up")
                return
            ip("addr", "flush", "dev", self.name)
            self.second_octet = 0
            self.__post_init__()
        self.teardown()
        raise NetworkError("no free 10.Y.0.0/16 for the pod network after several tries")

    def teardown(self) -> None:
        ip("link", "del", self.name, check=False)

    def ports(self) -> list[str]:
        """The interfaces attached to the bridge (pods' host-side veths): none once every pod is gone."""
        return re.findall(
            r"^\d+: ([\w.-]+)@", ip("-o", "link", "show", "master", self.name, check=False), re.M
        )


def cni_config(
    bridge: Bridge, node: str, node_index: int, service_cidr: str, ipam_dir: Path
) -> dict[str, Any]:
    """The CNI network list one node's containerd attaches its pods with (see the module docstring)."""
    return {
        "cniVersion": CNI_VERSION,
        "name": f"keepwarm-{node}",
        "plugins": [
            {
                "type": "bridge",
                "bridge": bridge.name,
                "isGateway": False,
                "ipMasq": False,
                "ipam": {
                    "type": "host-local",
                    "dataDir": str(ipam_dir),
                    "ranges": [
                        [
                            {
                                "subnet": bridge.cidr,
                                "rangeStart": f"10.{bridge.second_octet}.{node_index}.2",
                                "rangeEnd": f"10.{bridge.second_octet}.{node_index}.254",
                                "gateway": bridge.gateway,
                            }
                        ]
                    ],
                    "routes": [{"dst": service_cidr, "gw": bridge.gateway}],
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }
