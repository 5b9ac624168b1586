"""`specdec serve`: the OpenAI-compatible server's process. uvicorn runs the routes
(routes.py) over the service (service.py) on a socket bound before the models load;
SIGINT and SIGTERM end it gracefully; a lost RPC worker starts it over (restart.py)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from specdec_cli import interrupt
from specdec_cli.decoding.settings import EngineOptions
from specdec_cli.llamacpp import rpc
from specdec_cli.messages import note
from specdec_cli.serve.api import ServeOptions
from specdec_cli.serve.restart import listening_socket
from specdec_cli.serve.routes import Api
from specdec_cli.serve.service import Service

GRACEFUL_SHUTDOWN_SECONDS = 10  # in-flight streams stop within a round; this is a backstop


class _Server(uvicorn.Server):
    """uvicorn, with specdec's signal handling: SIGINT/SIGTERM end every generation with
    its last chunk and the process with code 0 (uvicorn would raise the signal again once
    done, which kills the process with SIGTERM's default action); while the models load,
    Ctrl-C ends the process at once, as `specdec run` does."""

    def __init__(self, config: uvicorn.Config, service: Service) -> None:
        super().__init__(config)
        self.service = service

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        signals = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in signals}
        try:
            with interrupt.handled_by_server():
                yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.service.engine is None and not self.should_exit:
            interrupt.exit_now()
        self.service.stop()
        super().handle_exit(sig, frame)


def serve(engine_options: EngineOptions, options: ServeOptions) -> None:
    """Serve until SIGINT or SIGTERM."""
    sock = listening_socket(options)
    host, port = sock.getsockname()[:2]
    url = f"http://{host}:{port}" if ":" not in host else f"http://[{host}]:{port}"
    service = Service(engine_options, options)
    service.listening = sock
    failure: list[BaseException] = []

    def on_loaded(error: BaseException | None) -> None:
        if error is not None:
            failure.append(error)
            server.should_exit = True
        else:
            note(f"ready: {url} (model {service.model_name}); Ctrl-C stops")

    config = uvicorn.Config(
        Api(service).app(on_loaded),
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
    )
    server = _Server(config, service)
    note(f"loading the models; {url}/health answers 503 until they are ready")
    try:
        with rpc.guard(engine_options.rpc, service.worker_lost):
            server.run(sockets=[sock])
    finally:
        service.stop()
        service.worker.shutdown(wait=True)
        if service.engine is not None:
            service.engine.close()
        sock.close()
    if failure:
        raise failure[0]
