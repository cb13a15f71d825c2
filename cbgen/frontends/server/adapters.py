"""The LoRA adapters a server serves by name, beside its base model.

They are loaded when the app is built (``--lora-modules``) and, when run-time updates are
on, by ``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` (vLLM's routes and
bodies). The server keeps its own name -> folder map: it is what ``/v1/models`` lists and
what a call's ``model`` is checked against. The map is replaced, never changed in place,
and only once the engine holds (or has dropped) the adapter, so readers on the event loop
never see it half-updated and a call never picks a name the engine has not taken.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Collection, Mapping
from typing import Any

from ..online import Engine, EngineClosedError
from .protocol import APIError

logger = logging.getLogger(__name__)


class ServedAdapters:
    """The adapters served under their names, and the loads and unloads that change them."""

    def __init__(self, engine: Engine, base_name: str) -> None:
        self.engine = engine
        self.base_name = base_name
        self.paths: dict[str, str] = {}  # by name: the folder it was read from
        # One load or unload at a time, held in the worker thread: a call cancelled while
        # the engine reads an adapter still records what the engine did.
        self._lock = threading.Lock()

    def names(self) -> Collection[str]:
        """The adapters' names as of now (a call's ``model`` may be one of them)."""
        return self.paths.keys()

    # -- at start ---------------------------------------------------------------------------

    def load_at_start(self, modules: Mapping[str, str]) -> None:
        """Load ``modules`` (name -> PEFT adapter folder); ``ValueError`` naming the first that
        cannot be loaded and why, so a server never starts without an adapter it was given."""
        for name, path in modules.items():
            try:
                self._load_now(name, str(path))
            except (ValueError, APIError) as exc:  # the reason, named: the start fails cleanly
                raise ValueError(f"--lora-modules {name}={path}: {exc}") from None

    # -- at run time ------------------------------------------------------------------------

    async def load(self, body: Any) -> dict[str, Any]:
        """``{"lora_name", "lora_path"}``: serve another adapter. 400 with the reason when
        the folder cannot be read or does not fit the base model, the name is taken, or
        every slot is in use; 503 once the engine has stopped."""
        name, path = _field(body, "lora_name"), _field(body, "lora_path")
        try:
            await asyncio.to_thread(self._load_now, name, path)
        except APIError:
            raise
        except EngineClosedError as exc:
            raise APIError(503, f"The engine is not running: {exc}", type="server_error") from None
        except ValueError as exc:  # the reader refuses any bad folder with a ValueError
            message = f"Cannot load LoRA adapter {name!r} from {path!r}: {exc}"
            raise APIError(400, message, "lora_path") from None
        logger.info("cbgen server: loaded LoRA adapter %r from %s", name, path)
        return {"status": "ok", "lora_name": name}

    async def unload(self, body: Any) -> dict[str, Any]:
        """``{"lora_name"}``: stop serving an adapter. 404 for a name not served (as vLLM),
        400 while unfinished calls run under it (retry once they finish)."""
        name = _field(body, "lora_name")
        try:
            await asyncio.to_thread(self._unload_now, name)
        except APIError:
            raise
        except EngineClosedError as exc:
            raise APIError(503, f"The engine is not running: {exc}", type="server_error") from None
        except ValueError as exc:  # unfinished requests still run under it
            message = f"Cannot unload LoRA adapter {name!r}: {exc}"
            raise APIError(400, message, "lora_name") from None
        logger.info("cbgen server: unloaded LoRA adapter %r", name)
        return {"status": "ok", "lora_name": name}

    def _load_now(self, name: str, path: str) -> None:
        with self._lock:
            if name == self.base_name or name in self.paths:
                raise APIError(400, f"The model {name!r} is already served.", "lora_name")
            self.engine.add_lora(name, path)
            self.paths = {**self.paths, name: path}

    def _unload_now(self, name: str) -> None:
        with self._lock:
            if name not in self.paths:
                served = ", ".join(repr(n) for n in self.paths) or "none"
                message = f"The LoRA adapter {name!r} is not served (adapters: {served})."
                raise APIError(404, message, "lora_name", type="not_found_error")
            self.engine.remove_lora(name)  # ValueError while requests run under it
            self.paths = {n: p for n, p in self.paths.items() if n != name}

    # -- /v1/models -------------------------------------------------------------------------

    def model_cards(self, max_model_len: int) -> list[dict[str, Any]]:
        """``/v1/models``' entries for the adapters, as vLLM lists them: ``parent`` is the
        base model's name and ``root`` the adapter's folder."""
        return [
            {
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "cbgen",
                "root": path,
                "parent": self.base_name,
                "max_model_len": max_model_len,
            }
            for name, path in self.paths.items()
        ]


def _field(body: Any, name: str) -> str:
    value = body.get(name) if isinstance(body, dict) else None
    if not isinstance(value, str) or not value:
        raise APIError(400, f"{name} must be a non-empty string.", name)
    return value
