"""One thread that runs calls in the order they were submitted, each answered through a Future.

Not a ThreadPoolExecutor: its threads are joined when the interpreter exits, so a call stuck on
a network that swallows packets would keep a stopping daemon alive. This thread is a daemon
thread: at exit it is abandoned, with whatever it was waiting for.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class OrderedWorker:
    def __init__(self, name: str):
        self._calls: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        future: Future[T] = Future()
        self._calls.put((future, fn, args))
        return future

    def _run(self) -> None:
        while (call := self._calls.get()) is not None:
            future, fn, args = call
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # handed to whoever waits on the future
                future.set_exception(exc)

    def stop(self) -> None:
        """No more calls after those already submitted; does not wait for them."""
        self._calls.put(None)
