"""The bridge between the asyncio server and the engine's step loop.

The engine is stepped by one worker thread (``Engine.step`` is not meant for two threads at
once), the runner's own or one an ``executor`` gives it; the event loop submits and aborts
requests (which the engine allows from another thread) and receives each :class:`TokenEvent`
on an ``asyncio.Queue`` of its request, handed over with
``loop.call_soon_threadsafe`` (https://docs.python.org/3/library/asyncio-dev.html#concurrency-and-multithreading).
Because an event is delivered by a callback on the loop, and a request's queue is registered
on the loop right after ``submit`` returns, no event can arrive before its queue exists.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger("dikkat.serving")


class EngineLike(Protocol):
    """What the runner needs of :class:`dikkat.serving.Engine`."""

    max_len: int

    def submit(self, prompt: list[int], params: Any) -> int: ...

    def step(self) -> list[Any]: ...

    def abort(self, request_id: int) -> None: ...

    def finish(self, request_id: int) -> None: ...

    def has_work(self) -> bool: ...

    def stats(self) -> Any: ...


@dataclass(frozen=True)
class Failure:
    """Put on a request's queue instead of a token when the request failed: alone (the engine's
    error event for it) or with every other (the engine's step raised)."""

    message: str


class EngineRunner:
    """Owns the worker loop; :meth:`start` and :meth:`stop` run on the event loop.

    ``executor``: the loop runs as a task of it (a ``ThreadPoolExecutor(1)`` whose thread has
    done the model's other work: ``dikkat serve`` loads and warms the engine there), else in a
    thread of its own.
    """

    def __init__(
        self, engine: EngineLike, *, idle_wait: float = 0.05, executor: Executor | None = None
    ) -> None:
        self.engine = engine
        self.idle_wait = idle_wait  # seconds the idle worker sleeps between looks at the engine
        self.executor = executor
        self._queues: dict[int, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._task: Future | None = None
        self.error: str | None = None  # the last step failure, for /health

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self.executor is not None:
            self._task = self.executor.submit(self._work)
            return
        self._thread = threading.Thread(target=self._work, name="dikkat-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort what is still running, then end the worker loop (waiting at most ``timeout``)."""
        for request_id in list(self._queues):
            self.abort(request_id)
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._task is not None:
            try:
                self._task.result(timeout)
            except TimeoutError:
                log.warning("the engine's loop did not end within %s s", timeout)

    @property
    def alive(self) -> bool:
        if self._task is not None:
            return not self._task.done()
        return self._thread is not None and self._thread.is_alive()

    def submit(self, prompt: list[int], params: Any) -> tuple[int, asyncio.Queue]:
        """Queue a request; its events (and a :class:`Failure`, if any) arrive on the queue.
        Raises what ``engine.submit`` raises (``ValueError``, ``EngineFull``)."""
        request_id = self.engine.submit(prompt, params)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self._wake.set()
        return request_id, queue

    def done(self, request_id: int) -> None:
        """The request's last event was read: forget its queue."""
        self._queues.pop(request_id, None)

    def abort(self, request_id: int) -> None:
        """Stop a request (the client left): its blocks are freed."""
        self._queues.pop(request_id, None)
        self.engine.abort(request_id)

    def finish(self, request_id: int) -> None:
        """End a request whose text reached a stop string: its blocks are freed, and it counts
        as finished."""
        self._queues.pop(request_id, None)
        self.engine.finish(request_id)

    def _work(self) -> None:
        while not self._stopping.is_set():
            if not self.engine.has_work():
                self._wake.wait(self.idle_wait)
                self._wake.clear()
                continue
            try:
                events = self.engine.step()
            except Exception as e:  # the whole step failed: tell every request, keep serving
                log.exception("the engine's step failed")
                self.error = f"{type(e).__name__}: {e}"
                self._call(self._fail_all, self.error)
                continue
            if events:
                self._call(self._deliver, events)

    def _call(self, fn: Any, arg: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, arg)
        except RuntimeError:  # the loop is closed: the server is gone
            self._stopping.set()

    def _deliver(self, events: list[Any]) -> None:
        for event in events:
            if event.finish_reason == "error":  # it failed alone: the engine has ended it
                log.warning("request %d failed: %s", event.request_id, event.error)
                queue = self._queues.pop(event.request_id, None)
                if queue is not None:
                    queue.put_nowait(Failure(event.error))
                continue
            queue = self._queues.get(event.request_id)
            if queue is not None:  # None: aborted after this step began
                queue.put_nowait(event)

    def _fail_all(self, message: str) -> None:
        """The engine's step raised, and the engine dropped every request: all are told."""
        for request_id, queue in list(self._queues.items()):
            queue.put_nowait(Failure(message))
            self.engine.abort(request_id)
        self._queues.clear()
