"""Ctrl-C ends specdec within about a second, at any moment: exit code 130, no traceback.

Python runs a signal handler only between bytecodes of the main thread. While llama.cpp
loads a model (or a big import runs) the main thread sits in C for seconds, and comes
back to Python only in llama.cpp's log callback, where an exception cannot propagate:
ctypes prints "Exception ignored on calling ctypes callback function" and carries on.
So, except while text is being generated, Ctrl-C ends the process at once, from the
handler or, while the main thread is in C, from a watcher thread woken by the signal
itself (signal.set_wakeup_fd). While generating, Ctrl-C raises KeyboardInterrupt so
that the stats so far are printed; if the main thread does not take it within
GRACE_SECONDS (a long call into llama.cpp), the watcher ends the process.

Only the standard library here: it is installed before anything heavy is imported.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

EXIT_CODE = 130  # 128 + SIGINT, what shells report for Ctrl-C
GRACE_SECONDS = 1.0
SHOW_CURSOR = b"\x1b[?25h"  # rich hides the cursor while a live line or progress bar is up


class _State:
    installed = False
    generating = False  # Ctrl-C raises KeyboardInterrupt (see `generating` below)
    serving = False  # a server's own handler takes Ctrl-C (see `handled_by_server` below)
    taken = threading.Event()  # the main thread raised KeyboardInterrupt for a Ctrl-C
    done = threading.Event()  # generation ended (normally, or by that KeyboardInterrupt)
    sockets: tuple[socket.socket, socket.socket] | None = None  # kept open for the process


def install() -> None:
    """Take over Ctrl-C for the rest of the process (from the main thread, once)."""
    if _State.installed or threading.current_thread() is not threading.main_thread():
        return
    receiver, sender = socket.socketpair()
    sender.setblocking(False)
    _State.sockets = (receiver, sender)
    signal.signal(signal.SIGINT, _on_sigint)
    signal.set_wakeup_fd(sender.fileno(), warn_on_full_buffer=False)
    threading.Thread(target=_watch, args=(receiver,), name="ctrl-c", daemon=True).start()
    _State.installed = True


@contextmanager
def generating() -> Iterator[None]:
    """While generating, Ctrl-C raises KeyboardInterrupt: the caller prints what it has."""
    _State.done.clear()
    _State.generating = True
    try:
        yield
    finally:
        _State.generating = False
        _State.done.set()


@contextmanager
def handled_by_server() -> Iterator[None]:
    """While a server has its own SIGINT handler (a graceful shutdown: streams get their
    last chunk, exit code 0), the watcher leaves Ctrl-C to it. The server's event loop
    runs on the main thread and decodes elsewhere, so its handler is never held up."""
    _State.serving = True
    try:
        yield
    finally:
        _State.serving = False


def _on_sigint(signum: int, frame: object) -> None:
    if not _State.generating:
        exit_now()
    _State.taken.set()
    raise KeyboardInterrupt


def _watch(receiver: socket.socket) -> None:
    """Woken by every signal that has a Python handler, whatever the main thread does."""
    while True:
        data = receiver.recv(64)
        if not data:
            return
        if signal.SIGINT not in data or _State.serving:
            continue
        # The main thread may have taken it already, and even left generation since.
        generating = _State.generating
        if not (_State.taken.wait(GRACE_SECONDS) if generating else _State.taken.is_set()):
            exit_now()
        _State.taken.clear()
        # Raised inside a callback from C, the KeyboardInterrupt is lost: then generation
        # goes on, and this ends it.
        if not _State.done.wait(2 * GRACE_SECONDS):
            exit_now()


def exit_now() -> NoReturn:
    """End the process now: no traceback, no cleanup (llama.cpp may be mid-call)."""
    if sys.stderr is not None and sys.stderr.isatty():
        os.write(sys.stderr.fileno(), SHOW_CURSOR + b"\n")
    os._exit(EXIT_CODE)
