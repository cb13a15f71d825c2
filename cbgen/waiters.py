"""Moved to ``cbgen.online.waiters``; this import path stays for one release."""

from .online.waiters import AsyncWaiter, ThreadWaiter, Waiter, resolve, wait

__all__ = ["AsyncWaiter", "ThreadWaiter", "Waiter", "resolve", "wait"]
