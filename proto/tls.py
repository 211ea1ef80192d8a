"""Transport security every gRPC party shares: TLS from PEM files, the pod
token, and the one place channels to pods and pod servers' ports are made.

Certificates come as files, the way a Kubernetes Secret mounts them
(`tls.crt`, `tls.key`, `ca.crt`); they are read when a server binds or a
channel is opened, never reloaded (rotate them with a rolling restart,
docs/deploy.md, Security). Plain grpc and ssl, no project imports: the
router, the pods and kv_transfer all use it.

Who uses what:

- `TlsFiles.server_credentials()` / `.ssl_context()`: a server's certificate;
  with `ca_file` and `require_client_cert` callers must present a certificate
  signed by that CA (mutual TLS). `.ssl_context()` also serves a decode pod's
  TCP KV port (kv_transfer/tcp/tls.py).
- `TlsFiles.client_ssl_context()`: the `ssl` twin of `channel_credentials`,
  for a prefill pod's TCP KV streams.
- `TlsFiles.channel_credentials()`: a client verifies servers against
  `ca_file` (the system roots without it) and presents `cert_file` when set.
- `PodSecurity`: how pod gRPC is secured, for both ends: the pod servers
  (`add_port`, `server_interceptors`) and whoever dials a pod (`pod_channel`:
  the router, a prefill pod dialling a decode pod's gRPC KV port).
- The token: callers send `authorization: Bearer <token>` (gRPC's own access
  token credentials, which gRPC only sends over TLS; so a token needs TLS) and
  the pods compare it in constant time (`TokenCheck`), answering
  UNAUTHENTICATED. The standard health service stays open (kubelet probes
  cannot send metadata); it reveals SERVING or NOT_SERVING only.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

HEALTH_PREFIX = "/grpc.health.v1.Health/"
_BEARER = "bearer "


def read_pem(path: str, what: str) -> bytes:
    """The file's bytes; ValueError naming `what` and the path when unreadable or not PEM."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{what} {path!r} cannot be read: {exc.strerror or exc}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{what} {path!r} is not a PEM file (no '-----BEGIN' line)")
    return data


def read_token(path: str) -> str:
    """A token file (e.g. a mounted Secret key), surrounding whitespace stripped."""
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"pod token file {path!r} cannot be read: {exc}") from None
    if not token:
        raise ValueError(f"pod token file {path!r} is empty")
    return token


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM file paths. On a server `cert_file` + `key_file` are required and
    `ca_file` (with `require_client_cert`) turns on mutual TLS. On a client
    `ca_file` verifies the server, `cert_file` + `key_file` (optional) are its
    client certificate, and `server_name` is the name checked in the server's
    certificate instead of the host dialled (pods are dialled by IP).
    `kv_streams`: a pod's files also secure its TCP KV streams (KV TLS, on
    whenever pod TLS is; False: `--no-kv-tls`, docs/kv_transfer.md); the
    router's files ignore it."""

    cert_file: str | None = None
    key_file: str | None = None
    ca_file: str | None = None
    require_client_cert: bool = True
    server_name: str | None = None
    kv_streams: bool = True

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("a TLS certificate file and its key file go together: "
                             f"got cert {self.cert_file!r}, key {self.key_file!r}")
        if self.server_name is not None and not self.server_name.strip():
            raise ValueError("TLS server name must not be empty (leave it unset to check "
                             "the host dialled)")

    @property
    def mutual(self) -> bool:
        """A server with these files requires client certificates."""
        return self.ca_file is not None and self.require_client_cert

    def _key_pair(self, role: str) -> tuple[bytes, bytes]:
        if self.cert_file is None or self.key_file is None:
            raise ValueError(f"a TLS {role} needs a certificate and key file")
        return (read_pem(self.key_file, "TLS key file"),
                read_pem(self.cert_file, "TLS certificate file"))

    def server_credentials(self) -> grpc.ServerCredentials:
        key, cert = self._key_pair("server")
        ca = read_pem(self.ca_file, "TLS CA file") if self.mutual else None
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                           require_client_auth=ca is not None)

    def ssl_context(self):
        """A server-side `ssl.SSLContext` (the router's HTTPS listener); file
        errors surface here as ValueError, as with the gRPC credentials."""
        import ssl

        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        self._key_pair("server")  # readable and PEM, with a clear error otherwise
        try:
            context.load_cert_chain(self.cert_file, self.key_file)
            if self.mutual:
                context.load_verify_locations(cafile=self.ca_file)
                context.verify_mode = ssl.CERT_REQUIRED
        except ssl.SSLError as exc:
            raise ValueError(f"TLS files {self.cert_file!r} / {self.key_file!r}: {exc}") from None
        return context

    def client_ssl_context(self):
        """A client-side `ssl.SSLContext` (a prefill pod's TCP KV streams): the
        server verified against `ca_file` (the system roots without it), by
        `server_name` when set, and `cert_file` presented when set, as
        `channel_credentials` does for gRPC."""
        import ssl

        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            if self.ca_file is not None:
                read_pem(self.ca_file, "TLS CA file")
                context.load_verify_locations(cafile=self.ca_file)
            if self.cert_file is not None:
                self._key_pair("client")
                context.load_cert_chain(self.cert_file, self.key_file)
        except ssl.SSLError as exc:
            raise ValueError(f"TLS files {self.cert_file!r} / {self.key_file!r} / "
                             f"{self.ca_file!r}: {exc}") from None
        return context

    def channel_credentials(self) -> grpc.ChannelCredentials:
        ca = read_pem(self.ca_file, "TLS CA file") if self.ca_file else None
        key = cert = None
        if self.cert_file is not None:
            key, cert = self._key_pair("client")
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                            certificate_chain=cert)

    def channel_options(self) -> tuple[tuple[str, Any], ...]:
        if self.server_name is None:
            return ()
        return (("grpc.ssl_target_name_override", self.server_name),)


@dataclass(frozen=True, slots=True)
class PodSecurity:
    """How pod gRPC is secured; the same value configures the pods' servers
    and every channel to them. Default: plaintext, no authentication."""

    tls: TlsFiles | None = None
    token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.token is not None:
            if not self.token.strip() or any(c.isspace() for c in self.token):
                raise ValueError("pod token must be non-empty and free of whitespace")
            if self.tls is None:
                raise ValueError("a pod token needs TLS on pod gRPC (a certificate, or a CA "
                                 "to verify the pods'): a bearer token sent in plaintext can "
                                 "be read and replayed by anyone on the network path")

    @property
    def enabled(self) -> bool:
        return self.tls is not None

    def describe(self) -> str:
        """For the start-up log line: never the token itself."""
        if self.tls is None:
            return "plaintext, no authentication"
        parts = ["mutual TLS" if self.tls.mutual else "TLS"]
        if self.token is not None:
            parts.append("token")
        return " + ".join(parts)


# ------------------------------------------------------------------ clients


def pod_channel(address: str, security: PodSecurity, options: Sequence[tuple[str, Any]] = (),
                *, aio: bool = True) -> grpc.Channel | grpc.aio.Channel:
    """A channel to a pod's gRPC port (or a decode pod's gRPC KV port): secure
    when `security.tls` is set, carrying the token on every call when set.
    `aio` False: a synchronous channel (the KV sender's threads)."""
    module = grpc.aio if aio else grpc
    if security.tls is None:
        return module.insecure_channel(address, options=list(options))
    credentials = security.tls.channel_credentials()
    if security.token is not None:
        credentials = grpc.composite_channel_credentials(
            credentials, grpc.access_token_call_credentials(security.token))
    return module.secure_channel(address, credentials,
                                 options=[*options, *security.tls.channel_options()])


# ------------------------------------------------------------------ servers


def add_port(server: grpc.Server | grpc.aio.Server, address: str, tls: TlsFiles | None) -> int:
    """Bind `address` on `server`, with TLS when `tls` is set (pods pass
    `PodSecurity.tls`); returns the port. ValueError when it cannot be bound."""
    if tls is None:
        port = server.add_insecure_port(address)
    else:
        port = server.add_secure_port(address, tls.server_credentials())
    if port == 0:
        raise ValueError(f"cannot bind gRPC port {address}")
    return port


def _token_ok(expected: bytes, metadata: Sequence[tuple[str, Any]] | None) -> bool:
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str):
            if value[: len(_BEARER)].lower() == _BEARER:
                return hmac.compare_digest(value[len(_BEARER):].strip().encode(), expected)
    return False


_REFUSAL = "missing or wrong pod token (send 'authorization: Bearer <token>')"


def _refusal_handler(handler: grpc.RpcMethodHandler | None, aio: bool) -> grpc.RpcMethodHandler:
    """A handler of the same streaming shape as `handler` that refuses the call."""
    if aio:
        async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSAL)
    else:
        def refuse(request: Any, context: grpc.ServicerContext) -> None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSAL)
    request_streaming = handler is not None and handler.request_streaming
    response_streaming = handler is not None and handler.response_streaming
    if request_streaming and response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)


class TokenCheck(grpc.aio.ServerInterceptor):
    """Refuses every call except health checks unless it carries the pod token
    (constant-time compare), with UNAUTHENTICATED. Runs on the server's loop."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    async def intercept_service(self, continuation, handler_call_details):
        details = handler_call_details
        if details.method.startswith(HEALTH_PREFIX) or _token_ok(
                self._token, details.invocation_metadata):
            return await continuation(details)
        return _refusal_handler(await continuation(details), aio=True)


class SyncTokenCheck(grpc.ServerInterceptor):
    """`TokenCheck` for synchronous servers (the gRPC KV receiver's own port)."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    def intercept_service(self, continuation, handler_call_details):
        details = handler_call_details
        if details.method.startswith(HEALTH_PREFIX) or _token_ok(
                self._token, details.invocation_metadata):
            return continuation(details)
        return _refusal_handler(continuation(details), aio=False)


def server_interceptors(security: PodSecurity, *, aio: bool = True) -> list[Any]:
    """The interceptors a pod server is built with (`grpc.aio.server(interceptors=...)`)."""
    if security.token is None:
        return []
    return [TokenCheck(security.token) if aio else SyncTokenCheck(security.token)]
