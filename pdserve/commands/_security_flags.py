"""Transport security flags (docs/deploy.md, Security), and their translation
into `proto.tls.TlsFiles` / `PodSecurity`.

Pods (`pdserve prefill|decode|serve`): `--tls-cert-file/--tls-key-file` serve
pod gRPC over TLS, `--tls-ca-file` requires callers' certificates signed by it
(unless `--no-tls-client-cert`) and verifies peer pods; `--pod-token-file` (or
`--pod-token`, default $PDSERVE_POD_TOKEN) makes every call but health checks
carry the token; the same TLS secures the TCP KV streams unless `--no-kv-tls`
(docs/kv_transfer.md, "TLS on the TCP KV streams"). The router: `--tls-*`
are its public listeners' files, `--pod-tls-*` and `--pod-token*` how it
reaches the pods. File paths are what a Kubernetes Secret mounts (tls.crt,
tls.key, ca.crt). This module and the command modules are the only readers
of the environment.
"""

from __future__ import annotations

import argparse
import os

from proto.tls import PodSecurity, TlsFiles, read_token

_TOKEN_ENV = "PDSERVE_POD_TOKEN"


def _add_token_arguments(g: argparse._ArgumentGroup) -> None:
    token = g.add_mutually_exclusive_group()
    token.add_argument("--pod-token-file", default=None, metavar="PATH",
                       help="File holding the shared pod token (a mounted Secret); needs TLS.")
    token.add_argument("--pod-token", default=None, metavar="TOKEN",
                       help=f"The pod token itself (default: ${_TOKEN_ENV}); prefer "
                            "--pod-token-file, which keeps it out of `ps`.")


def _token(args: argparse.Namespace) -> str | None:
    if args.pod_token_file:
        return read_token(args.pod_token_file)
    return args.pod_token or os.environ.get(_TOKEN_ENV) or None


def add_pod_security_arguments(parser: argparse.ArgumentParser) -> None:
    """The pods' flags: their gRPC server's TLS, and the token they require."""
    g = parser.add_argument_group("security (docs/deploy.md, Security)")
    g.add_argument("--tls-cert-file", default=None, metavar="PATH",
                   help="Serve pod gRPC over TLS with this certificate (PEM, e.g. tls.crt); "
                        "also this pod's client certificate towards other pods.")
    g.add_argument("--tls-key-file", default=None, metavar="PATH",
                   help="The certificate's private key (PEM, e.g. tls.key).")
    g.add_argument("--tls-ca-file", default=None, metavar="PATH",
                   help="CA (PEM, e.g. ca.crt): callers must present a certificate it "
                        "signed (mutual TLS), and peer pods' certificates are checked "
                        "against it.")
    g.add_argument("--tls-client-cert", action=argparse.BooleanOptionalAction, default=True,
                   help="With --tls-ca-file: require callers' certificates (default); "
                        "--no-tls-client-cert leaves authentication to --pod-token-file.")
    g.add_argument("--tls-server-name", default=None, metavar="NAME",
                   help="Name checked in peer pods' certificates instead of the address "
                        "dialled (pods are dialled by IP).")
    g.add_argument("--kv-tls", action=argparse.BooleanOptionalAction, default=True,
                   help="With --tls-cert-file: the TCP KV streams use the same TLS "
                        "(mutual with --tls-ca-file) (default); --no-kv-tls sends KV in "
                        "plaintext, for a trusted network where the encryption's CPU cost "
                        "matters. Prefill and decode pods must agree.")
    _add_token_arguments(g)
    g.add_argument("--health-port", type=int, default=None, metavar="PORT",
                   help="Also serve the gRPC health service alone, in plaintext, on this "
                        "port (0 = any), for probes that cannot speak TLS (kubelet).")


def pod_security_from_args(args: argparse.Namespace) -> PodSecurity:
    tls = None
    if args.tls_cert_file or args.tls_key_file or args.tls_ca_file:
        tls = TlsFiles(cert_file=args.tls_cert_file, key_file=args.tls_key_file,
                       ca_file=args.tls_ca_file, require_client_cert=args.tls_client_cert,
                       server_name=args.tls_server_name, kv_streams=args.kv_tls)
        if tls.cert_file is None:
            raise ValueError("--tls-ca-file needs --tls-cert-file and --tls-key-file: the "
                             "pod's own certificate")
    return PodSecurity(tls=tls, token=_token(args))


def add_router_security_arguments(parser: argparse.ArgumentParser) -> None:
    """The router's flags: its listeners' TLS, and how it reaches the pods."""
    g = parser.add_argument_group("security (docs/deploy.md, Security)")
    g.add_argument("--tls-cert-file", default=None, metavar="PATH",
                   help="Serve HTTPS and gRPC over TLS with this certificate (PEM).")
    g.add_argument("--tls-key-file", default=None, metavar="PATH",
                   help="The certificate's private key (PEM).")
    g.add_argument("--tls-ca-file", default=None, metavar="PATH",
                   help="Require clients to present a certificate this CA signed.")
    g.add_argument("--pod-tls-ca-file", default=None, metavar="PATH",
                   help="Reach pods over TLS, verifying their certificates with this CA.")
    g.add_argument("--pod-tls-cert-file", default=None, metavar="PATH",
                   help="The router's client certificate towards pods (mutual TLS).")
    g.add_argument("--pod-tls-key-file", default=None, metavar="PATH",
                   help="Its private key.")
    g.add_argument("--pod-tls-server-name", default=None, metavar="NAME",
                   help="Name checked in pods' certificates instead of the address dialled.")
    _add_token_arguments(g)


def router_tls_from_args(args: argparse.Namespace) -> TlsFiles | None:
    if not (args.tls_cert_file or args.tls_key_file or args.tls_ca_file):
        return None
    return TlsFiles(cert_file=args.tls_cert_file, key_file=args.tls_key_file,
                    ca_file=args.tls_ca_file)


def router_pod_security_from_args(args: argparse.Namespace) -> PodSecurity:
    tls = None
    if args.pod_tls_ca_file or args.pod_tls_cert_file or args.pod_tls_key_file:
        tls = TlsFiles(cert_file=args.pod_tls_cert_file, key_file=args.pod_tls_key_file,
                       ca_file=args.pod_tls_ca_file, server_name=args.pod_tls_server_name)
    elif args.pod_tls_server_name:
        raise ValueError("--pod-tls-server-name needs --pod-tls-ca-file")
    return PodSecurity(tls=tls, token=_token(args))
