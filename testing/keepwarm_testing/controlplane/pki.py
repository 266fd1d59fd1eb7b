"""Certificates and kubeconfigs for a throwaway control plane, made with the `openssl` CLI.

One CA signs the API server's serving certificate and one client certificate per identity (admin in
`system:masters`, the controller manager and the scheduler under their bootstrap RBAC names). The
service-account signing key is a separate RSA pair. Everything lives in one directory that the
control plane deletes when it stops.
"""

from __future__ import annotations

import base64
import ssl
import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

# Names the API server's serving certificate must answer to (loopback, and in-cluster DNS names for
# clients that were handed the in-cluster service address).
SERVING_NAMES = [
    "DNS:localhost",
    "DNS:kubernetes",
    "DNS:kubernetes.default",
    "DNS:kubernetes.default.svc",
    "DNS:kubernetes.default.svc.cluster.local",
    "IP:127.0.0.1",
    "IP:10.0.0.1",
]

# A fresh unencrypted P-256 key for `openssl req`.
NEW_EC_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


@dataclass(frozen=True)
class KeyPair:
    cert: Path  # PEM certificate signed by the CA
    key: Path  # PEM private key, unencrypted


def _openssl(*args: str, cwd: Path) -> None:
    proc = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args[:2])} failed: {proc.stderr.strip()}")


class PKI:
    """A CA plus helpers that issue leaf certificates into `root`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.ca = KeyPair(root / "ca.crt", root / "ca.key")
        _openssl(
            "req", "-x509", *NEW_EC_KEY, "-keyout", str(self.ca.key), "-out", str(self.ca.cert),
            "-days", "30", "-subj", "/CN=keepwarm-test-ca",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
            cwd=root,
        )  # fmt: skip
        self._serial = 1

    def issue(
        self, name: str, common_name: str, organization: str | None = None, alt_names: list[str] | None = None
    ) -> KeyPair:
        """A leaf certificate usable for both serving and client authentication."""
        self._serial += 1
        pair = KeyPair(self.root / f"{name}.crt", self.root / f"{name}.key")
        csr = self.root / f"{name}.csr"
        ext = self.root / f"{name}.ext"
        subject = (f"/O={organization}" if organization else "") + f"/CN={common_name}"
        lines = [
            "basicConstraints=CA:FALSE",
            "keyUsage=critical,digitalSignature,keyEncipherment",
            "extendedKeyUsage=serverAuth,clientAuth",
        ]
        if alt_names:
            lines.append("subjectAltName=" + ",".join(alt_names))
        ext.write_text("\n".join(lines) + "\n")
        key_out = ["-keyout", str(pair.key), "-out", str(csr)]
        _openssl("req", "-new", *NEW_EC_KEY, *key_out, "-subj", subject, cwd=self.root)
        _openssl(
            "x509", "-req", "-in", str(csr), "-CA", str(self.ca.cert), "-CAkey", str(self.ca.key),
            "-set_serial", str(self._serial), "-days", "30", "-extfile", str(ext), "-out", str(pair.cert),
            cwd=self.root,
        )  # fmt: skip
        return pair

    def service_account_keys(self) -> KeyPair:
        """RSA key pair the API server signs (and verifies) service-account tokens with."""
        pair = KeyPair(self.root / "sa.pub", self.root / "sa.key")
        _openssl("genrsa", "-out", str(pair.key), "2048", cwd=self.root)
        _openssl("rsa", "-in", str(pair.key), "-pubout", "-out", str(pair.cert), cwd=self.root)
        return pair


def client_ssl_context(ca: Path, client: KeyPair) -> ssl.SSLContext:
    """TLS context trusting the test CA and presenting `client` (httpx ignores `cert=` next to a CA path)."""
    ctx = ssl.create_default_context(cafile=str(ca))
    ctx.load_cert_chain(str(client.cert), str(client.key))
    return ctx


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def write_kubeconfig(
    path: Path,
    server: str,
    ca: Path,
    user: str,
    *,
    client: KeyPair | None = None,
    token: str | None = None,
    namespace: str = "default",
) -> Path:
    """A self-contained kubeconfig (credentials embedded) for one user of the test cluster."""
    creds: dict[str, str] = {}
    if client is not None:
        creds = {"client-certificate-data": _b64(client.cert), "client-key-data": _b64(client.key)}
    if token is not None:
        creds = {"token": token}
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "keepwarm-test", "cluster": {"server": server, "certificate-authority-data": _b64(ca)}}
        ],
        "users": [{"name": user, "user": creds}],
        "contexts": [
            {"name": user, "context": {"cluster": "keepwarm-test", "user": user, "namespace": namespace}}
        ],
        "current-context": user,
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)
    return path
