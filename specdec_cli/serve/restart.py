"""A server process started over after it lost an RPC worker: the same program, the same
listening socket (so that clients get 503, not a refused connection, while it waits for
its workers), told in its environment that it restarted."""

from __future__ import annotations

import os
import socket
import sys

from specdec_cli.listening import listen
from specdec_cli.serve.api import ServeOptions

LISTEN_FD_ENV = "SPECDEC_LISTEN_FD"
RESTARTED_ENV = "SPECDEC_RESTARTED"


def restart_on(sock: socket.socket) -> None:
    """Start this server process over, keeping its listening socket (so that clients
    get 503, not a refused connection, while it waits for its workers)."""
    os.set_inheritable(sock.fileno(), True)
    os.environ[LISTEN_FD_ENV] = str(sock.fileno())
    os.environ[RESTARTED_ENV] = "1"
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


def listening_socket(options: ServeOptions) -> socket.socket:
    """The socket a restart handed over, else a new one."""
    fd = os.environ.pop(LISTEN_FD_ENV, None)
    if fd is not None:
        return socket.socket(fileno=int(fd))
    return listen(options.host, options.port, "--port or --host")


def restarted() -> bool:
    """Whether this process is a restart (asked once: the mark is taken away)."""
    return os.environ.pop(RESTARTED_ENV, None) is not None
