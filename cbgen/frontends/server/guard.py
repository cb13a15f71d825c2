"""The checks every API call passes before a handler runs, as pure ASGI middleware.

* Draining (after SIGTERM): ``/v1/`` calls get 503 with ``Retry-After``.
* ``POST`` bodies must be ``application/json`` (415 otherwise): a web page can send
  ``text/plain`` cross-origin without a preflight, JSON it cannot.
* Browsers: a request with an ``Origin`` header that is not in ``allowed_origins`` is
  refused (403). Without an API key a ``Host`` that is not the server's own name is
  refused too, so a page that rebinds its DNS name to 127.0.0.1 cannot drive a
  key-less server on loopback.
* Every ``/v1/`` answer is counted by route (a fixed set) and status.

Streams pass through untouched: the middleware only looks at the first message.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from typing import Any

from .metrics import ServerMetrics, route_label
from .protocol import error_body

LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "[::1]", "::1"})


def _host_name(host: str) -> str:
    """``Host`` without its port (``[::1]:8000`` -> ``[::1]``)."""
    if host.startswith("["):
        return host.split("]", 1)[0] + "]"
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class APIGuard:
    def __init__(
        self,
        app: Any,
        metrics: ServerMetrics,
        *,
        allowed_origins: Collection[str] = (),
        allowed_hosts: Collection[str] | None = None,
        draining: Callable[[], bool] = lambda: False,
    ) -> None:
        """``allowed_hosts``: the ``Host`` names accepted (``None``: any)."""
        self.app = app
        self.metrics = metrics
        self.allowed_origins = frozenset(o.rstrip("/") for o in allowed_origins)
        self.allowed_hosts = None if allowed_hosts is None else frozenset(allowed_hosts)
        self.draining = draining

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope.get("path", "").startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        endpoint = route_label(scope["path"])
        http = self.metrics.http

        async def counting_send(message: Any) -> None:
            if message["type"] == "http.response.start":
                http.labels(endpoint, str(int(message["status"]))).inc()
            await send(message)

        refusal = self._refusal(scope)
        if refusal is not None:
            status, message, kind, headers = refusal
            await _answer(counting_send, status, error_body(message, kind), headers)
            return
        await self.app(scope, receive, counting_send)

    def _refusal(self, scope: Any) -> tuple[int, str, str, dict[str, str]] | None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.draining():
            return (
                503,
                "The server is shutting down.",
                "server_error",
                {"Retry-After": "5", "Connection": "close"},
            )
        origin = headers.get("origin")
        if origin is not None and origin.rstrip("/") not in self.allowed_origins:
            return (
                403,
                f"Cross-origin requests from {origin!r} are not allowed (see --allowed-origins).",
                "invalid_request_error",
                {},
            )
        if self.allowed_hosts is not None:
            host = _host_name(headers.get("host", ""))
            if host not in self.allowed_hosts:
                return (
                    403,
                    f"Host {host!r} is not served here (without an API key only the "
                    "server's own names are).",
                    "invalid_request_error",
                    {},
                )
        if scope["method"] == "POST":
            ctype = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if ctype != "application/json":
                return (
                    415,
                    "The body must be JSON sent as 'Content-Type: application/json'.",
                    "invalid_request_error",
                    {},
                )
        return None


async def _answer(send: Any, status: int, body: dict[str, Any], headers: dict[str, str]) -> None:
    payload = json.dumps(body).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": payload})
