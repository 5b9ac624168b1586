"""`specdec worker`: this machine's devices served to a target elsewhere, over RPC."""

from __future__ import annotations

import signal
from typing import Annotated

import typer

from specdec_cli.commands.flags import described
from specdec_cli.llamacpp import rpc
from specdec_cli.messages import warn


def worker(
    host: Annotated[
        str,
        typer.Option(
            "-H", "--host", metavar="HOST", help="Address to listen on (beyond loopback: --expose)."
        ),
    ] = rpc.DEFAULT_HOST,
    port: Annotated[
        int, typer.Option("-p", "--port", min=1, max=65535, metavar="PORT", help="Port.")
    ] = rpc.DEFAULT_PORT,
    cache: Annotated[
        bool,
        typer.Option(
            "-c",
            "--cache",
            help="Keep the tensors clients send on disk, so that a reload sends only their "
            "hashes ($LLAMA_CACHE/rpc, else ~/.cache/llama.cpp/rpc).",
        ),
    ] = False,
    threads: Annotated[
        int | None,
        typer.Option(
            "-t", "--threads", min=1, metavar="N", help=described("CPU threads.", "physical cores")
        ),
    ] = None,
    device: Annotated[
        str | None,
        typer.Option(
            "-d",
            "--device",
            metavar="DEVICES",
            help=described("Devices to serve, comma-separated.", "the GPUs, else the CPU"),
        ),
    ] = None,
    expose: Annotated[
        bool,
        typer.Option(
            "--expose",
            help="Allow -H beyond loopback. ggml-rpc has no authentication: anyone who "
            "reaches the port can run code on this machine's devices. Use a private network "
            "or an SSH tunnel (see the README).",
        ),
    ] = False,
) -> None:
    """Serve this machine's devices to a target elsewhere: llama.cpp's RPC server
    (rpc-server), started from this install. Point `specdec run/bench/serve --rpc
    HOST:PORT` at it. Runs until stopped (Ctrl-C).

    \b
    Example (on each worker, over an SSH tunnel or a private network):
      specdec worker -p 50052
    """
    from specdec_cli.llamacpp.machine import check_threads, physical_cores

    check_threads(threads, "-t")
    exposed = rpc.check_host(host, expose)
    if exposed:
        warn(exposed)
    devices = rpc.worker_devices(device)
    # ggml's server loop never returns to Python: Ctrl-C and SIGTERM end it at once.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    rpc.serve_worker(host, port, devices, threads or physical_cores(), cache)
