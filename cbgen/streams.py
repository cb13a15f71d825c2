"""Moved to ``cbgen.online.streams``; this import path stays for one release."""

from .online.streams import (
    AsyncRequestStream,
    AsyncStreamGroup,
    RequestStream,
    Sink,
    SinkGroup,
    resolve_all,
)

__all__ = [
    "AsyncRequestStream",
    "AsyncStreamGroup",
    "RequestStream",
    "Sink",
    "SinkGroup",
    "resolve_all",
]
