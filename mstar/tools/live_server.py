"""An app served by uvicorn on 127.0.0.1 (a free port) in a daemon thread: the soak drives the real server
through it, and the live HTTP tests do too."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn


class LiveServer:
    """uvicorn serving `app` on a free loopback port (`url`) in a daemon thread: `start` returns once it
    accepts connections, `stop` shuts it down (open connections get `graceful_shutdown_s`); or use `with`."""

    def __init__(self, app, graceful_shutdown_s: float = 2.0, startup_timeout_s: float = 30.0, **uvicorn_config):
        """`uvicorn_config`: more `uvicorn.Config` arguments (mstar-serve's `serve.connection_settings`)."""
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._socket.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=graceful_shutdown_s,
                                **uvicorn_config)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True)
        self._startup_timeout_s = startup_timeout_s
        self._join_timeout_s = graceful_shutdown_s + 10

    def start(self) -> None:
        self._thread.start()
        deadline = time.monotonic() + self._startup_timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not start on {self.url} within {self._startup_timeout_s} s "
                                   "(its log above says why)")
            time.sleep(0.01)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=self._join_timeout_s)
        self._socket.close()
        if self._thread.is_alive():
            raise RuntimeError(f"uvicorn on {self.url} did not stop within {self._join_timeout_s} s")

    def __enter__(self) -> LiveServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
