"""Throwaway certificates for the TLS tests, made with the `openssl` CLI.

    certs = make_certs(tmp_path)
    certs.ca, certs.pod_cert, certs.pod_key, ...   # PEM file paths (str)

One test CA signs: `pod` (server and client use, SANs pdserve-pod, localhost,
127.0.0.1: what every pod and the router's listeners present) and `client`
(client use only: the router's identity towards pods). A second, unrelated
CA signs `rogue`, which a server trusting the first must refuse. EC P-256
keys, so making all of them takes well under a second.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

SERVER_NAME = "pdserve-pod"
_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


@dataclass(frozen=True)
class Certs:
    ca: str
    pod_cert: str
    pod_key: str
    client_cert: str
    client_key: str
    rogue_cert: str
    rogue_key: str


def _openssl(*args: str, cwd: Path) -> None:
    proc = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=30)
    if proc.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)} failed: {proc.stderr}")


def _ca(directory: Path, name: str) -> None:
    _openssl("req", "-x509", *_EC, "-keyout", f"{name}.key", "-out", f"{name}.crt",
             "-days", "2", "-subj", f"/CN={name}",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             "-addext", "subjectKeyIdentifier=hash", cwd=directory)


def _leaf(directory: Path, name: str, ca: str, usage: str, serial: int) -> None:
    ext = directory / f"{name}.ext"
    ext.write_text(
        "basicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\n"
        f"extendedKeyUsage={usage}\n"
        f"subjectAltName=DNS:{SERVER_NAME},DNS:localhost,IP:127.0.0.1\n"
        "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n")
    _openssl("req", "-new", *_EC, "-keyout", f"{name}.key", "-out", f"{name}.csr",
             "-subj", f"/CN={name}", cwd=directory)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
             "-set_serial", str(serial), "-days", "2", "-out", f"{name}.crt",
             "-extfile", ext.name, cwd=directory)


def make_certs(directory: Path) -> Certs:
    """Write the CA, pod, client and rogue certificates into `directory`."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is needed to make test certificates")
    directory.mkdir(parents=True, exist_ok=True)
    _ca(directory, "ca")
    _ca(directory, "rogue-ca")
    _leaf(directory, "pod", "ca", "serverAuth,clientAuth", 2)
    _leaf(directory, "client", "ca", "clientAuth", 3)
    _leaf(directory, "rogue", "rogue-ca", "serverAuth,clientAuth", 4)
    d = str(directory)
    return Certs(ca=f"{d}/ca.crt", pod_cert=f"{d}/pod.crt", pod_key=f"{d}/pod.key",
                 client_cert=f"{d}/client.crt", client_key=f"{d}/client.key",
                 rogue_cert=f"{d}/rogue.crt", rogue_key=f"{d}/rogue.key")
