"""Serve concurrent asyncio callers from one generator: a background thread steps it while requests are live.

An asyncio server (Triton's Python backend runs `async def execute` on an event loop) cannot step the
scheduler on its loop: a step is a blocking engine call, and the loop must go on taking and answering requests
meanwhile. So a thread does. Between steps it takes new requests and cancellations from a queue and asks each
live request's `is_cancelled` callback; it steps the generator (Generator.advance, under the generator's lock)
while any of its requests is live, so requests that arrive together share the same engine calls; and it reads
each request's new tokens from the request (Generator.progress), never from a step's result, and hands them to
its Stream on the caller's event loop. So the same generator may serve direct generate() and stream() calls
from other threads meanwhile: their steps move these requests too. Admission is bounded: while max_batch
requests run and max_queue_size more wait, a new request is refused at once (QueueFullError) instead of
waiting without end.

    serving = ServingLoop(Generator.from_engine_dir(path), max_queue_size=16)
    stream = serving.submit(prompt_ids, SamplingParams(max_new_tokens=32))      # inside a coroutine
    async for update in stream:
        print(update.tokens)                    # the last update has finished=True; stream.request has metrics
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .generator import Generator, Prompt
from .sampling import RequestError, SamplingParams
from .scheduler import Request


class QueueFullError(RequestError):
    """max_batch requests are running and max_queue_size more are waiting: the request is refused."""


@dataclass(frozen=True)
class Update:
    """Tokens a request gained since its last update (one step's, or several when direct callers of the generator
    stepped in between; empty on a last update that only ends it), and when."""

    tokens: list[int]
    finished: bool
    time: float                             # time.perf_counter() when the tokens were read


class Stream:
    """One request's updates, consumed with `async for` on the event loop that submitted it.

    Raises the engine's exception if a step failed. After the last update, `request.finish_reason` is "stop",
    "length" or "cancelled" and `request.metrics` holds its acceptance figures."""

    def __init__(self, loop: asyncio.AbstractEventLoop, is_cancelled: Callable[[], bool] | None):
        self.is_cancelled = is_cancelled
        self.request: Request | None = None           # set by the scheduler thread once queued there
        self.sent = 0                                 # tokens handed on in updates (the scheduler thread's)
        self._loop, self._updates = loop, asyncio.Queue()
        self._done = False

    def _put(self, item: Update | BaseException) -> None:
        """Called from the scheduler thread."""
        self._loop.call_soon_threadsafe(self._updates.put_nowait, item)

    def __aiter__(self) -> "Stream":
        return self

    async def __anext__(self) -> Update:
        if self._done:
            raise StopAsyncIteration
        item = await self._updates.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        self._done = item.finished
        return item


class ServingLoop:
    """Steps `generator` from a background thread for its streams; `submit` and `cancel` are safe from any thread.

    `on_update()`, if given, runs on the scheduler thread whenever requests joined, left or stepped (e.g. to
    export the engine-step counter and the queue size)."""

    def __init__(self, generator: Generator, max_queue_size: int, on_update: Callable[[], None] | None = None):
        self.generator, self.scheduler = generator, generator.scheduler
        self.max_queue_size, self.on_update = max_queue_size, on_update
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[int, Stream] = {}                 # request id -> stream; the scheduler thread's only
        self._lock = threading.Lock()
        self._in_flight = 0                                # submitted and not yet finished
        self._thread = threading.Thread(target=self._run, name="v4engine-scheduler", daemon=True)
        self._thread.start()

    @property
    def capacity(self) -> int:
        return self.scheduler.max_batch + self.max_queue_size

    @property
    def alive(self) -> bool:
        """The scheduler thread runs (it stops only on close)."""
        return self._thread.is_alive()

    @property
    def queue_size(self) -> int:
        """Requests accepted and not yet running."""
        return max(0, self._in_flight - len(self.scheduler.active))

    def gauges(self) -> dict[str, int]:
        """The engine-step count and the gauges of runtime/metrics.py SERIES, as of now (read them on the
        scheduler thread: from on_update)."""
        waiting, running = self.queue_size, len(self.scheduler.active)
        return {"engine_steps": self.scheduler.engine_steps, "waiting": waiting, "running": running,
                "pending": waiting + running, "cache_bytes": self.scheduler.used_bytes}

    def submit(self, prompt: Prompt | Sequence[int], params: SamplingParams,
               is_cancelled: Callable[[], bool] | None = None) -> Stream:
        """Check and queue a request; call from a coroutine. Raises RequestError (QueueFullError when full)."""
        ids = self.generator.encode(prompt)
        self.generator.check(ids, params)
        with self._lock:
            if self._in_flight >= self.capacity:
                raise QueueFullError(f"the server is full: {self.scheduler.max_batch} requests running and "
                                     f"{self.max_queue_size} waiting (max_queue_size); retry later")
            self._in_flight += 1
        stream = Stream(asyncio.get_running_loop(), is_cancelled)
        self._commands.put((stream, ids, params))
        return stream

    def cancel(self, stream: Stream) -> None:
        """Stop a request at the next step; its stream ends with finish_reason "cancelled"."""
        self._commands.put((stream, None, None))

    def close(self, timeout: float = 10.0) -> None:
        """Cancel every live request and stop the thread."""
        self._commands.put(None)
        self._thread.join(timeout)

    # ------------------------------------------------------------------ the scheduler thread
    def _run(self) -> None:
        while True:
            commands = [] if self._live else [self._commands.get()]   # sleep while there is nothing to do
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            for command in commands:
                if command is None:
                    for stream in list(self._live.values()):
                        self._deliver(stream, cancel=True)
                    return
                self._take(*command)
            for stream in list(self._live.values()):
                if stream.is_cancelled is not None and stream.is_cancelled():
                    self._deliver(stream, cancel=True)
            if self._live:
                self.generator.advance([stream.request for stream in self._live.values()])
                for stream in list(self._live.values()):
                    self._deliver(stream)
            if self.on_update is not None:
                self.on_update()

    def _take(self, stream: Stream, ids: list[int] | None, params: SamplingParams | None) -> None:
        if ids is None:                                    # a cancellation
            if stream.request is not None and stream.request.id in self._live:
                self._deliver(stream, cancel=True)
            return
        try:
            stream.request = self.generator.submit(ids, params)
        except Exception as e:                             # noqa: BLE001 - handed to the caller, who reports it
            self._release()
            stream._put(e)
            return
        self._live[stream.request.id] = stream

    def _deliver(self, stream: Stream, cancel: bool = False) -> None:
        """Hand the stream what its request gained since the last update, read from the request (a step of any
        caller may have moved it); its last update once the request has ended, or the error of the step that
        ended it. `cancel`: end the request now."""
        if cancel:
            self.generator.cancel(stream.request)
        tokens, ended = self.generator.progress(stream.request, stream.sent)
        stream.sent += len(tokens)
        if not ended:
            if tokens:
                stream._put(Update(tokens, False, time.perf_counter()))
            return
        del self._live[stream.request.id]
        self._release()
        error = stream.request.error
        stream._put(error if error is not None else Update(tokens, True, time.perf_counter()))

    def _release(self) -> None:
        with self._lock:
            self._in_flight -= 1
