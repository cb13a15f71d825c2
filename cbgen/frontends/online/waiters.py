"""The threads and coroutines waiting for a request's result, and how each is woken.

A thread waits on an event; a coroutine on a future of its own event loop, resolved
with ``call_soon_threadsafe`` (a loop that is gone reports that nobody listens).
"""

from __future__ import annotations

import asyncio
import threading


class Waiter:
    """One caller waiting for a result; ``wake`` returns False when nobody listens any more
    (so the result goes to the next waiter instead of being lost)."""

    __slots__ = ("woken",)

    def __init__(self) -> None:
        self.woken = False

    def wake(self) -> bool:
        raise NotImplementedError


class ThreadWaiter(Waiter):
    __slots__ = ("event",)

    def __init__(self) -> None:
        super().__init__()
        self.event = threading.Event()

    def wake(self) -> bool:
        self.woken = True
        self.event.set()
        return True


def resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


class AsyncWaiter(Waiter):
    __slots__ = ("loop", "future")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self.loop = loop
        self.future: asyncio.Future = loop.create_future()

    def wake(self) -> bool:
        self.woken = True
        try:
            self.loop.call_soon_threadsafe(resolve, self.future)
        except RuntimeError:  # its event loop is closed: nobody is listening
            return False
        return True


async def wait(
    future: asyncio.Future, deadline: float | None, loop: asyncio.AbstractEventLoop
) -> None:
    """Await ``future`` until the loop time ``deadline``; the builtin ``TimeoutError``
    past it, whatever the Python version's ``asyncio.TimeoutError`` is."""
    if deadline is None:
        await future
        return
    try:
        await asyncio.wait_for(future, max(0.0, deadline - loop.time()))
    except asyncio.TimeoutError:
        raise TimeoutError("timed out") from None
