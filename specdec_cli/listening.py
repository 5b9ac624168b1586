"""A listening TCP socket, bound before anything slow happens, so that a taken port or an
unknown address is said in one line at once: `specdec serve`'s HTTP port, and the port
`specdec worker` checks before ggml's RPC server (which would only print "Failed to
create server socket") takes it."""

from __future__ import annotations

import socket

from specdec_cli.errors import UserError


def listen(host: str, port: int, flags: str) -> socket.socket:
    """A socket bound to host:port; `flags` name what to change ("--port or --host")."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as err:
        raise UserError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as err:
        sock.close()
        raise UserError(
            f"cannot listen on {host}:{port}: {err.strerror or err}; choose another {flags}"
        ) from None
    return sock
