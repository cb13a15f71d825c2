"""An OpenAI-compatible HTTP server on the online engine (``python -m cbgen serve``).

``create_app(engine, tokenizer, model_name, api_key=None, ...)`` builds the FastAPI
app; the names load lazily so that ``cbgen``'s command line does not import FastAPI
unless it serves.
"""

from __future__ import annotations

from typing import Any

__all__ = ["create_app", "serve"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from .app import create_app

        return create_app
    if name == "serve":
        from .cli import serve

        return serve
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
