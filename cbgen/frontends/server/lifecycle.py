"""Running the app under uvicorn with a graceful drain and bounded connections.

* ``DrainingServer``: the first SIGTERM (or Ctrl-C) stops accepting calls (new ones
  get 503 and ``/health`` answers ``draining``, for a load balancer to see), and lets
  the calls in flight
  finish for up to ``drain_timeout`` seconds; past it, every open stream ends with a
  final error event (a plain call gets a 503) before uvicorn shuts down. A second
  Ctrl-C exits at once.
* ``header_timeout_protocol``: uvicorn closes idle keep-alive connections, but not a
  connection that never completes its request headers; this protocol closes one
  that has not sent a whole request head within ``header_timeout`` seconds of opening
  (or of its previous response).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)


def header_timeout_protocol(header_timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing connections that are slow to send a request head."""

    class HeaderTimeoutProtocol(H11Protocol):
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_timer()

        def _arm_header_timer(self) -> None:
            cycle = self.cycle
            self.loop.call_later(header_timeout, self._header_deadline, cycle)

        def _header_deadline(self, cycle: Any) -> None:
            # Still the cycle it was armed with: no new request head came in time.
            if self.cycle is cycle and not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutProtocol


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a drain before its own shutdown (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, app_server: Any, drain_timeout: float) -> None:
        super().__init__(config)
        self.app_server = app_server  # cbgen.frontends.server.app._Server
        self.drain_timeout = drain_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task | None = None
        self._drain_cut = False  # end_drain(): the drain is over before drain_timeout

    async def startup(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Start the drain on the first signal; a later one is uvicorn's (force on Ctrl-C)."""
        loop = self._loop
        first = self._drain is None and not self.should_exit
        if first and loop is not None and sig in (signal.SIGTERM, signal.SIGINT):
            loop.call_soon_threadsafe(self._begin_drain)
            return
        super().handle_exit(sig, frame)

    def end_drain(self) -> None:
        """End the drain now, as if ``drain_timeout`` had passed: open streams end with
        their final error event and the server exits. Any thread may call it; a drain
        that has not begun yet ends as soon as it begins."""
        self._drain_cut = True

    def _begin_drain(self) -> None:
        if self._drain is not None:
            return
        logger.info("cbgen serve: draining (up to %.1f s)", self.drain_timeout)
        # Connections are still accepted (so /health can say "draining"); calls get 503.
        self.app_server.begin_drain()
        self._drain = asyncio.get_running_loop().create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        app_server = self.app_server
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.drain_timeout
        while app_server.jobs and loop.time() < deadline and not self._drain_cut:
            await asyncio.sleep(0.05)
        if app_server.jobs:
            logger.warning(
                "cbgen serve: %d call(s) still running after the drain; ending them",
                len(app_server.jobs),
            )
            app_server.end_streams()
            end = loop.time() + 2.0  # their final events go out, then uvicorn closes
            while app_server.jobs and loop.time() < end:
                await asyncio.sleep(0.05)
        self.should_exit = True


def make_server(
    app: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    drain_timeout: float = 30.0,
    header_timeout: float = 10.0,
    timeout_keep_alive: float = 5.0,
    limit_concurrency: int | None = 1024,
    **config: Any,
) -> DrainingServer:
    """A ``DrainingServer`` for ``app`` (made by ``create_app``) with cbgen's limits:
    ``limit_concurrency`` connections and tasks at once (503 past it), idle keep-alive
    connections closed after ``timeout_keep_alive`` s, request heads due within
    ``header_timeout`` s."""
    uv_config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        http=header_timeout_protocol(header_timeout),
        timeout_keep_alive=int(max(1, timeout_keep_alive)),
        limit_concurrency=limit_concurrency,
        timeout_graceful_shutdown=5,
        **config,
    )
    return DrainingServer(uv_config, app.state.cbgen, drain_timeout)
