"""The next global batch built while the current step runs (``data.prefetch``; trainer/loop.py).

:class:`Prefetcher` takes global batches by position from a ``build(pos)`` function (:class:`.datasets.Batches`'
``global_batch``) and builds the next one ahead on one background thread. Batches are a pure function of the
sample position (data/datasets.py's module doc), so prefetched or not they are the same batches.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch


class _Build:
    """One requested global batch: its position and, once built, its value or the exception building it raised."""

    __slots__ = ("pos", "done", "value", "error")

    def __init__(self, pos: int):
        self.pos, self.done, self.value, self.error = pos, threading.Event(), None, None

    def result(self) -> Any:
        self.done.wait()
        if self.error is None:
            return self.value
        try:
            raise self.error  # the original exception, its worker-side traceback included
        finally:
            self.error = None  # no reference cycle through the traceback


class Prefetcher:
    """Global batches taken by position, the next one built ahead on one background thread (``data.prefetch``).

    ``take(pos)`` returns ``build(pos)``, exactly: the batch prefetched for ``pos`` when there is one (waiting
    for it if still being built), else one built here and now (the first step, a resume, any position other than
    the one prefetched: what was prefetched is discarded, never handed over for another position). Then it asks
    the worker for ``build(pos + stride)`` (not at or past ``end``, the run's last sample). An exception raised
    while building a batch is kept with it and raised by the ``take`` of that position (the same exception, its
    type and message; the worker's frames in its traceback); one of a discarded batch is dropped with it.

    The worker does what the caller would have done (``build`` only, no copy of its result). Batches are a pure
    function of the position (module doc), so prefetched or not they are the same. On a GPU run it can build
    freely while the main thread waits in the step's synchronising calls (the loss, DeepSpeed's overflow check and
    gradient norm), which release the GIL; while the main thread launches kernels the two share the GIL, the
    worker's reads, stacks and copies running in C without it. It draws no random numbers. ``device`` (CUDA) is
    made the worker's current device, so that nothing it does touches another GPU. :meth:`close` ends the worker
    (a daemon thread): it waits at most ``timeout`` seconds for a batch being built (normally milliseconds), and
    forgets the rest.
    """

    def __init__(
        self,
        build: Callable[[int], Any],
        stride: int,
        end: int | None = None,
        device: torch.device | None = None,
        name: str = "batch-prefetch",
    ):
        self.build, self.stride, self.end, self.device, self.name = build, stride, end, device, name
        self._cond = threading.Condition()
        self._queued: _Build | None = None  # asked for, not yet started
        self._pending: _Build | None = None  # the last one asked for (queued, being built or built)
        self._thread: threading.Thread | None = None
        self._closed = False

    def take(self, pos: int) -> Any:
        """``build(pos)``, then the next position asked for ahead (see the class doc)."""
        job, self._pending = self._pending, None
        if job is not None and job.pos == pos:
            batch = job.result()
        else:
            if job is not None:
                self._discard(job)
            batch = self.build(pos)
        self._ask(pos + self.stride)
        return batch

    def _discard(self, job: _Build) -> None:
        with self._cond:
            if self._queued is job:  # not started: never built; being built: built, then dropped
                self._queued = None

    def _ask(self, pos: int) -> None:
        if self.end is not None and pos >= self.end:
            return
        job = _Build(pos)
        with self._cond:
            if self._closed:
                return
            self._queued = job
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name=self.name, daemon=True)
                self._thread.start()
            self._cond.notify()
        self._pending = job

    def _work(self) -> None:
        ready = False
        while True:
            with self._cond:
                while self._queued is None and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                job, self._queued = self._queued, None
            try:
                if not ready and self.device is not None and torch.device(self.device).type == "cuda":
                    torch.cuda.set_device(self.device)
                ready = True
                job.value = self.build(job.pos)
            except BaseException as e:  # noqa: BLE001 -- kept for the take() of this position, raised there
                job.error = e
            finally:
                job.done.set()
            job = None  # a discarded batch is not kept alive while the worker waits

    def close(self, timeout: float = 5.0) -> None:
        """Stop the worker: nothing more is built; a batch being built is waited for up to ``timeout`` s."""
        with self._cond:
            self._closed, self._queued = True, None
            self._cond.notify_all()
        self._pending = None
        if self._thread is not None:
            self._thread.join(timeout)
