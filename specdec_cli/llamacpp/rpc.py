"""llama.cpp's RPC backend: a target's layers on other machines (`--rpc`), and the server
each of those machines runs (`specdec worker`).

ggml-rpc aborts the process on every fault: a worker that is not there, one that speaks
another protocol, one that dies mid-generation. So each worker is checked here, in
Python, before ggml connects to it (`check_worker`, one line naming it), and a fault
ggml meets later reaches `on_worker_lost` through ggml's abort callback, which names
the worker that went away before the process ends (see `guard`).
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import socket
import struct
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path

from specdec_cli.errors import UserError
from specdec_cli.listening import listen
from specdec_cli.llamacpp import backend

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 50052  # rpc-server's
# The protocol of the ggml-rpc that llama-cpp-python 0.3.36 vendors (ggml-rpc.h); a
# worker must speak this major version and no newer minor one (ggml's own rule).
PROTOCOL = (7, 0)
REBUILD = (
    'CMAKE_ARGS="-DGGML_RPC=on" pip install --force-reinstall --no-cache-dir '
    "llama-cpp-python==0.3.36"
)
_HELLO = 14  # RPC_CMD_HELLO, fixed across protocol versions
_CAPS_SIZE = 24  # RPC_CONN_CAPS_SIZE: all zero asks for no transport upgrade
_CHECK_TIMEOUT_S = 5.0
_LOST_TIMEOUT_S = 1.0
_LOST_TRIES = 5

_add_server = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)
_start_server = ctypes.CFUNCTYPE(
    None, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_void_p
)
_registered: dict[str, list[backend.Device]] = {}


def built_in() -> bool:
    """Whether this llama.cpp was built with the RPC backend (-DGGML_RPC=on)."""
    return "RPC" in backend.backend_names()


def _rpc_function(name: str, prototype: type) -> Callable[..., object]:
    """A function of the RPC backend, found as llama.cpp's own tools find it."""
    if not built_in():
        raise UserError(
            f"this llama.cpp was built without RPC ({', '.join(backend.backend_names())}); "
            f"rebuild it with: {REBUILD}"
        )
    address = backend.reg_proc_address("RPC", name)
    if not address:
        raise UserError(f"this llama.cpp's RPC backend has no {name}; rebuild it with: {REBUILD}")
    return prototype(address)


def parse_endpoints(value: str, flag: str = "--rpc") -> tuple[str, ...]:
    """HOST:PORT[,HOST:PORT...], each checked for form (not yet for an answer)."""
    endpoints = tuple(part.strip() for part in value.split(",") if part.strip())
    if not endpoints:
        raise UserError(f"{flag} needs HOST:PORT[,HOST:PORT...], e.g. 192.168.1.2:50052")
    for endpoint in endpoints:
        host, _, port = endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise UserError(f"{flag}: {endpoint!r} is not HOST:PORT (e.g. 192.168.1.2:50052)")
    if len(set(endpoints)) < len(endpoints):
        raise UserError(f"{flag} names a worker twice; name each once")
    return endpoints


def _address(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


def _receive(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise EOFError("hung up")
        data += chunk
    return data


def worker_protocol(endpoint: str, timeout: float = _CHECK_TIMEOUT_S) -> tuple[int, int, int]:
    """The protocol version a worker answers ggml-rpc's handshake with. Raises OSError
    (not there, no answer) or EOFError (hung up, or an answer of another size: another
    protocol)."""
    with socket.create_connection(_address(endpoint), timeout=timeout) as sock:
        sock.sendall(struct.pack("<BQ", _HELLO, _CAPS_SIZE) + bytes(_CAPS_SIZE))
        (size,) = struct.unpack("<Q", _receive(sock, 8))
        if size < 3 or size > 1024:
            raise EOFError(f"answered with {size} bytes")
        return tuple(_receive(sock, size)[:3])  # type: ignore[return-value]


def check_worker(endpoint: str) -> None:
    """One line naming the worker and what to do, where ggml would abort on it."""
    try:
        version = worker_protocol(endpoint)
    except TimeoutError:
        raise UserError(
            f"RPC worker {endpoint} did not answer within {_CHECK_TIMEOUT_S:.0f} s (a worker "
            "serves one client at a time: is another using it?)"
        ) from None
    except EOFError as err:
        raise UserError(
            f"RPC worker {endpoint} {err} during the handshake: it runs another llama.cpp "
            "version; install the same specdec and llama-cpp-python on both machines"
        ) from None
    except OSError as err:
        raise UserError(
            f"RPC worker {endpoint} is not there ({err.strerror or err}); start it on that "
            "machine with `specdec worker`, or fix --rpc"
        ) from None
    if version[0] != PROTOCOL[0] or version[1] > PROTOCOL[1]:
        theirs, ours = ".".join(map(str, version)), ".".join(map(str, PROTOCOL))
        raise UserError(
            f"RPC worker {endpoint} speaks protocol {theirs}, this llama.cpp {ours}: install "
            "the same specdec and llama-cpp-python on both machines"
        )


def add_workers(endpoints: Sequence[str]) -> list[backend.Device]:
    """Check each worker, then register its devices with ggml (as llama.cpp's --rpc
    does): the target's layers then go to them like to any GPU's. Once per process."""
    add_server = _rpc_function("ggml_backend_rpc_add_server", _add_server)
    devices = []
    for endpoint in endpoints:
        if endpoint not in _registered:
            check_worker(endpoint)
            reg = add_server(endpoint.encode())
            if not reg:
                raise UserError(f"RPC worker {endpoint} offers no device; check its -d")
            _registered[endpoint] = backend.register(reg)
        devices += _registered[endpoint]
    return devices


def is_remote(device: backend.Device) -> bool:
    """A device on a worker: ggml names them RPC0, RPC1, ..., described by endpoint."""
    return device.description in _registered


# --- a worker lost mid-generation ------------------------------------------------------

# What to do when a worker goes away: the innermost handler of `guard`, given the line.
_handlers: list[Callable[[str], None]] = []
_endpoints: list[str] = []


def lost_worker(endpoints: Sequence[str]) -> str:
    """The worker that no longer takes a connection. A live worker that is busy with
    us still accepts one (into its backlog) and drops it later; a dying one may still
    listen for a moment after its connection to us closed, hence the few tries."""
    for _ in range(_LOST_TRIES):
        for endpoint in endpoints:
            try:
                socket.create_connection(_address(endpoint), timeout=_LOST_TIMEOUT_S).close()
            except OSError:
                return endpoint
        time.sleep(_LOST_TIMEOUT_S / _LOST_TRIES)
    return " or ".join(endpoints)  # all answer again: one of them restarted


def _on_abort(message: bytes | None) -> None:
    """ggml's abort callback: abort() follows when it returns. Only ggml-rpc's faults
    go to the handler; any other keeps ggml's own message."""
    text = (message or b"").decode(errors="replace").strip()
    if "RPC" not in text or not _handlers:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
        return
    endpoint = lost_worker(_endpoints)
    _handlers[-1](
        f"RPC worker {endpoint} went away mid-generation (restart it with `specdec worker`)"
    )


_abort_callback = ctypes.CFUNCTYPE(None, ctypes.c_char_p)(_on_abort)  # kept alive


@contextmanager
def guard(endpoints: Sequence[str], handler: Callable[[str], None]) -> Iterator[None]:
    """While inside, a worker lost mid-generation calls `handler` with one line naming
    it (on ggml's thread, while the decode waits). `handler` must end the process, or
    park that thread for good: ggml aborts once it returns."""
    if not endpoints:
        yield
        return
    _endpoints[:] = endpoints
    _handlers.append(handler)
    backend.set_abort_callback(_abort_callback)
    try:
        yield
    finally:
        _handlers.pop()


def exit_with(line: str, code: int = 1) -> None:
    """A handler for `guard` that ends the process with `line` (stdout flushed first:
    the text generated so far stays the user's)."""
    with suppress(OSError, ValueError):
        sys.stdout.flush()
    sys.stderr.write(f"specdec: error: {line}\n")
    sys.stderr.flush()
    os._exit(code)


# --- specdec worker --------------------------------------------------------------------


def check_host(host: str, expose: bool) -> str | None:
    """Refuse a worker address beyond loopback unless `expose`; else llama.cpp's warning
    for one (None for loopback)."""
    try:
        loopback = ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        raise UserError(f"-H {host}: not an address of this machine") from None
    if loopback:
        return None
    if not expose:
        raise UserError(
            f"-H {host} would open this machine's devices to the network, and ggml-rpc has "
            "no authentication; add --expose on a private network, or keep 127.0.0.1 and "
            "use an SSH tunnel"
        )
    return (
        f"host {host} is not 127.0.0.1: never expose the RPC server to an open network; it "
        "is experimental and not secure (llama.cpp's warning)"
    )


def tensor_cache_dir() -> Path:
    """Where a worker keeps tensors it was sent (-c), as llama.cpp's rpc-server does."""
    base = os.environ.get("LLAMA_CACHE")
    if base:
        return Path(base) / "rpc"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg or Path.home() / ".cache") / "llama.cpp" / "rpc"


def worker_devices(names: str | None) -> list[backend.Device]:
    """-d's devices, or as rpc-server picks them: the GPUs, else the CPU."""
    if names:
        everything = backend.all_devices()
        handles = backend.pick_devices(names, everything, "-d")
        return [d for d in everything if d.handle in handles]
    return [d for d in backend.gpu_devices() if not d.accelerator] or backend.cpu_devices()


def serve_worker(
    host: str, port: int, devices: Sequence[backend.Device], threads: int, cache: bool
) -> None:
    """Run ggml's RPC server until the process is stopped (it never returns otherwise)."""
    start = _rpc_function("ggml_backend_rpc_start_server", _start_server)
    listen(host, port, "-p or -H").close()  # in one line, before ggml would fail
    cache_dir = None
    if cache:
        tensor_cache_dir().mkdir(parents=True, exist_ok=True)
        cache_dir = str(tensor_cache_dir()).encode()
    handles = (ctypes.c_void_p * len(devices))(*(d.handle for d in devices))
    start(f"{host}:{port}".encode(), cache_dir, threads, len(devices), handles)
    raise UserError(f"the RPC server on {host}:{port} stopped; see the lines above")
