"""What a ``/v1/`` handler does before it reads a call: the API key check, and the JSON body
read under a size limit (413) and a time limit (408)."""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Sequence
from typing import Any

from fastapi import Request

from .protocol import APIError

DEFAULT_MAX_BODY_BYTES = 1 << 20
DRAIN_LIMIT = 64 << 20  # read (and drop) at most this much of an oversized body


def api_keys(api_key: str | Sequence[str] | None) -> tuple[str, ...]:
    """The keys a server accepts: one, several, or none (an open server)."""
    keys = (api_key,) if isinstance(api_key, str) else tuple(api_key or ())
    if any(not isinstance(key, str) or not key for key in keys):
        raise ValueError("API keys must be non-empty strings")
    return keys


def check_api_key(request: Request, keys: Sequence[str]) -> int | None:
    """401 unless the request carries ``Authorization: Bearer <key>`` for one of ``keys``
    (or none is set); returns that key's index (``None``: an open server)."""
    if not keys:
        return None
    header = request.headers.get("authorization")
    if not header:
        raise APIError(
            401,
            "Missing API key: send it as 'Authorization: Bearer <key>'.",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
    scheme, _, token = header.partition(" ")
    given = token.strip().encode()
    # every key compared, in constant time each: the answer's timing names none of them
    matches = [hmac.compare_digest(given, key.encode()) for key in keys]
    if scheme.lower() != "bearer" or not any(matches):
        raise APIError(
            401,
            "Incorrect API key provided.",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return matches.index(True)


async def read_json(request: Request, limit: int, timeout: float) -> Any:
    """The body as a JSON object: at most ``limit`` bytes, all in within ``timeout`` s."""
    too_big = APIError(
        413,
        f"Request body too large: the limit is {limit} bytes.",
        code="request_too_large",
    )
    declared = request.headers.get("content-length")
    oversized = declared is not None and declared.isdigit() and int(declared) > limit
    try:
        body, oversized = await asyncio.wait_for(read_body(request, limit, oversized), timeout)
    except asyncio.TimeoutError:
        raise APIError(
            408,
            f"The request body did not arrive within {timeout:g} s.",
            code="request_timeout",
            headers={"Connection": "close"},
        ) from None
    if oversized:
        raise too_big
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise APIError(400, f"The body is not valid JSON: {exc}") from None
    except RecursionError:
        raise APIError(400, "The body is not valid JSON: it is nested too deeply.") from None
    except ValueError as exc:  # e.g. an integer past Python's 4,300-digit conversion limit
        raise APIError(400, f"The body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise APIError(400, "The body must be a JSON object.")
    return data


async def read_body(request: Request, limit: int, oversized: bool) -> tuple[bytearray, bool]:
    """The body, or nothing and ``True`` past ``limit`` bytes (the rest is read and dropped,
    up to ``DRAIN_LIMIT``, so the client gets its 413 cleanly)."""
    body = bytearray()
    drained = 0
    async for chunk in request.stream():
        if oversized:  # read the rest and drop it, so the client gets the 413 cleanly
            drained += len(chunk)
            if drained > DRAIN_LIMIT:
                break
            continue
        body += chunk
        if len(body) > limit:
            oversized = True
            drained = len(body)
            body = bytearray()
    return body, oversized
