"""TLS options of the client: channel credentials from PEM files or bytes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

Pem = str | Path | bytes
"""PEM data as bytes, or the path of a PEM file."""


def _pem(value: Pem | None) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    return Path(value).read_bytes()


@dataclass(frozen=True, slots=True)
class TLSOptions:
    """How the client authenticates the node (and itself, for mutual TLS)."""

    root_cert: Pem | None = None
    """CA bundle the node's certificate must chain to; None = the system roots."""
    client_cert: Pem | None = None
    """The client's certificate chain, for nodes that require mutual TLS."""
    client_key: Pem | None = None
    """The private key of ``client_cert``."""

    def credentials(self) -> grpc.ChannelCredentials:
        """gRPC channel credentials (files are read now)."""
        if (self.client_cert is None) != (self.client_key is None):
            raise ValueError("tls client_cert and client_key go together")
        return grpc.ssl_channel_credentials(
            root_certificates=_pem(self.root_cert),
            private_key=_pem(self.client_key),
            certificate_chain=_pem(self.client_cert),
        )
