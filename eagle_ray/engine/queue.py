"""RequestQueue: one engine, many callers (the Ray Data stage's in-flight batches, Serve's HTTP requests).

A background thread owns the engine and steps it while any request is pending, so requests submitted at
different times share verify passes (continuous batching). Callers get a future of the final output, or a
stream of text deltas, from plain threads or from asyncio; cancelling frees the request's slot before the next
step. Requests are validated and tokenised on the caller's side (asyncio callers in a worker thread), so a huge
prompt never stalls the engine thread or an event loop.

An exception from the engine's step is not a bad request: the device or the engine's state is broken. The queue
then fails every request in flight with :class:`EngineDeadError`, refuses new ones, and reports itself unhealthy
(``healthy``), so that Serve restarts the replica and a job actor reruns its batch's rows one at a time on a
restarted engine (``batch/stage.py``). A step that never returns (a hung kernel, a deadlock) is failed the same way
once it has run past its bound (:class:`StallBound`), with :class:`EngineStalledError`: a caller is never left
waiting on a dead engine.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Iterator

from eagle_ray.config import SamplingParams
from eagle_ray.engine.engine import EagleEngine, RequestOutput
from eagle_ray.engine.sequence import Sequence
from eagle_ray.errors import EagleError, EngineDeadError, EngineStalledError, InvalidRequestError


@dataclass(frozen=True)
class StallBound:
    """How long a step may run before the engine is failed: ``factor`` x the slowest step seen so far, never less
    than ``floor_s`` (the first steps of a fresh engine, prompt chunks and a GPU's warm-up can be slow)."""
    floor_s: float = 120.0
    factor: float = 10.0

    def seconds(self, slowest: float) -> float:
        return max(self.floor_s, self.factor * slowest)


@dataclass
class StreamDelta:
    request_id: str
    text: str                       # new output text since the last delta
    num_tokens: int                 # output tokens so far
    finished: bool = False
    output: RequestOutput | None = None  # set on the last delta
    error: BaseException | None = None


class _Listener:
    """Turns a sequence's progress into deltas: holds back text that may still become a stop string or that
    ends in half a UTF-8 character."""

    def __init__(self, request_id: str, on_delta: Callable[[StreamDelta], None] | None,
                 future: concurrent.futures.Future):
        self.request_id, self.on_delta, self.future = request_id, on_delta, future
        self.sent = 0
        self.seq: Sequence | None = None

    def update(self, engine: EagleEngine, seq: Sequence) -> None:
        final = seq.finished
        text = seq.text
        end = len(text)
        if not final and seq.stops is not None:
            end = max(self.sent, end - seq.stops.hold)
        if self.on_delta and (end > self.sent or final):
            self._call(StreamDelta(self.request_id, text[self.sent:end], len(seq.output_ids), final,
                                   engine.output(seq) if final else None))
        self.sent = end
        if final:
            self._resolve(engine.output(seq), None)

    def fail(self, err: BaseException) -> None:
        if self.on_delta:
            self._call(StreamDelta(self.request_id, "", 0, True, None, err))
        self._resolve(None, err)

    def _call(self, delta: StreamDelta) -> None:
        try:
            self.on_delta(delta)
        except Exception:  # noqa: BLE001 - a consumer that went away (closed event loop) must not stop the engine
            pass

    def _resolve(self, result, err) -> None:
        try:  # the future is RUNNING (see submit), so a caller's cancel() cannot race with this
            if err is None:
                self.future.set_result(result)
            else:
                self.future.set_exception(err)
        except concurrent.futures.InvalidStateError:
            pass


class RequestQueue:
    """``on_finish(output)`` (Serve's metrics) is called on the engine thread for every request that ends with an
    output: finished, or cancelled (``finish_reason`` ``abort``, the client gone)."""

    def __init__(self, engine: EagleEngine, stall: StallBound | None = None,
                 on_finish: Callable[[RequestOutput], None] | None = None):
        if not engine.driving.acquire(blocking=False):
            raise InvalidRequestError("this engine is already stepped by another RequestQueue or a generate() call: "
                                      "one queue per engine")
        self.engine = engine
        self.on_finish = on_finish
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._listeners: dict[str, _Listener] = {}
        self._stopping = False
        self._drain = True
        self._lock = threading.Lock()
        self.dead: BaseException | None = None  # the engine's failure, once it has failed
        self.stall = stall or StallBound()
        self._step_started: float | None = None   # monotonic time the running step began (None: no step running)
        self._steps, self.slowest_step_s = 0, 0.0
        self._thread = threading.Thread(target=self._loop, name="eagle-ray-engine", daemon=True)
        self._thread.start()
        self._watch = threading.Thread(target=self._watch_steps, name="eagle-ray-stall-watch", daemon=True)
        self._watch.start()

    # ---- callers ------------------------------------------------------------------------------------------------
    def prepare(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                speculative: bool = True) -> Sequence:
        """Validate and tokenise a request on this thread; raises its typed error if it is bad."""
        self._check_open()
        return self.engine.make_sequence(prompt, params, request_id or uuid.uuid4().hex, speculative)

    async def aprepare(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                       speculative: bool = True) -> Sequence:
        """``prepare`` in a worker thread: tokenising a long prompt must not block the event loop."""
        return await asyncio.to_thread(self.prepare, prompt, params, request_id, speculative)

    def submit(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
               speculative: bool = True, on_delta: Callable[[StreamDelta], None] | None = None
               ) -> concurrent.futures.Future:
        """Queue a request (a prompt, or a Sequence from ``prepare``); the future resolves to its RequestOutput, or
        raises the request's typed error. A queue that is shutting down or dead raises here."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_running_or_notify_cancel()  # not cancellable: callers cancel the request with cancel(id)
        self._check_open()
        if isinstance(prompt, Sequence):
            seq = prompt
        else:
            try:
                seq = self.prepare(prompt, params, request_id, speculative)
            except EagleError as e:
                _Listener(request_id or "", on_delta, future).fail(e)
                return future
        with self._lock:
            self._check_open()
            self._inbox.put(("add", seq, _Listener(seq.request_id, on_delta, future)))
        return future

    def _check_open(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(f"the engine failed and takes no more requests: {self.dead!r}")
        if self._stopping:
            raise InvalidRequestError("the engine is shutting down")

    @property
    def healthy(self) -> bool:
        return self.dead is None and self._thread.is_alive()

    def generate(self, prompt, params: SamplingParams | None = None, **kw) -> RequestOutput:
        return self.submit(prompt, params, **kw).result()

    def stream(self, prompt, params: SamplingParams | None = None, **kw) -> Iterator[StreamDelta]:
        deltas: queue.SimpleQueue = queue.SimpleQueue()
        rid = kw.pop("request_id", None) or uuid.uuid4().hex
        if isinstance(prompt, Sequence):
            rid = prompt.request_id
        self.submit(prompt, params, request_id=rid, on_delta=deltas.put, **kw)
        finished = False
        try:
            while True:
                d = deltas.get()
                finished = d.finished
                if d.error is not None:
                    raise d.error
                yield d
                if finished:
                    return
        finally:
            if not finished:
                self.cancel(rid)

    async def agenerate(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                        **kw) -> RequestOutput:
        """Await the output; if the awaiting task is cancelled (client gone), the request is cancelled too."""
        if not isinstance(prompt, Sequence):
            prompt = await self.aprepare(prompt, params, request_id, kw.pop("speculative", True))
        rid = prompt.request_id
        future = self.submit(prompt, **kw)
        try:
            return await asyncio.shield(asyncio.wrap_future(future))
        except asyncio.CancelledError:
            self.cancel(rid)
            raise

    async def astream(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                      **kw) -> AsyncIterator[StreamDelta]:
        """Async deltas; if the consumer stops early (client gone), the request is cancelled."""
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue = asyncio.Queue()
        if not isinstance(prompt, Sequence):
            prompt = await self.aprepare(prompt, params, request_id, kw.pop("speculative", True))
        rid = prompt.request_id
        self.submit(prompt, on_delta=lambda d: loop.call_soon_threadsafe(deltas.put_nowait, d), **kw)
        finished = False
        try:
            while True:
                d = await deltas.get()
                if d.error is not None:
                    finished = True
                    raise d.error
                finished = d.finished
                yield d
                if finished:
                    return
        finally:
            if not finished:
                self.cancel(rid)

    def cancel(self, request_id: str) -> None:
        self._inbox.put(("cancel", request_id))

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop accepting requests; with ``drain`` finish the ones in flight, else cancel them."""
        with self._lock:
            self._stopping = True
            self._inbox.put(("stop", drain))
        self._thread.join(timeout)

    @property
    def num_pending(self) -> int:
        return len(self._listeners)

    # ---- the engine thread ----------------------------------------------------------------------------------------
    def _loop(self) -> None:
        self.engine.driven_by = threading.get_ident()   # add_request/step/abort from other threads are refused
        try:
            self._serve()
        finally:
            self.engine.driven_by = None
            self.engine.driving.release()   # the engine can be stepped by another queue now

    def _serve(self) -> None:
        while True:
            idle = self.dead is not None or not self.engine.has_unfinished()
            try:
                cmd = self._inbox.get(timeout=0.5) if idle else self._inbox.get_nowait()
            except queue.Empty:
                cmd = None
            while cmd is not None:
                self._handle_safely(cmd)
                try:
                    cmd = self._inbox.get_nowait()
                except queue.Empty:
                    cmd = None
            if self.dead is None and self.engine.has_unfinished():
                self._step()
            elif self._stopping and self._inbox.empty():
                return  # submit() refuses new work once _stopping is set, so nothing can arrive after this

    def _handle_safely(self, cmd) -> None:
        try:
            self._handle(cmd)
        except Exception as e:  # noqa: BLE001 - a bad request fails alone; the engine thread must survive
            if cmd[0] == "add":
                cmd[-1].fail(InvalidRequestError(f"request rejected: {type(e).__name__}: {e}"))

    def _handle(self, cmd) -> None:
        kind = cmd[0]
        if kind == "add":
            _, seq, listener = cmd
            rid = seq.request_id
            if self._stopping and not self._drain:
                listener.fail(InvalidRequestError("the engine is shutting down"))
                return
            if rid in self._listeners:
                listener.fail(InvalidRequestError(f"request id {rid!r} is already running"))
                return
            listener.seq = self.engine.add_request(seq)
            self._listeners[rid] = listener
        elif kind == "cancel":
            listener = self._listeners.pop(cmd[1], None)
            if listener is not None:
                seq = self.engine.abort(cmd[1])
                if seq is not None:
                    self._finished(seq)
                    listener.update(self.engine, seq)
        elif kind == "stop":
            self._drain = cmd[1]
            if not self._drain:
                for rid in list(self._listeners):
                    self._handle(("cancel", rid))

    def _step(self) -> None:
        self._step_started = time.monotonic()
        try:
            touched = self.engine.step()
        except Exception as e:  # noqa: BLE001 - the engine is broken: fail everything, take nothing more
            self._step_started = None
            self._die(e)
            return
        took, self._step_started = time.monotonic() - self._step_started, None
        self._steps += 1
        self.slowest_step_s = max(self.slowest_step_s, took)
        if self.dead is not None:   # failed as stalled while this step ran: its results go to no one
            return
        for seq in touched:
            listener = self._listeners.get(seq.request_id)
            if listener is None:
                continue
            try:
                if seq.finished:   # counted before its caller hears of it: a scrape after the answer sees it
                    self._finished(seq)
                listener.update(self.engine, seq)
            except Exception as e:  # noqa: BLE001 - e.g. a detokenizer error: fail this request, keep the rest
                self.engine.abort(seq.request_id)
                listener.fail(e)
                self._listeners.pop(seq.request_id, None)
                continue
            if seq.finished:
                del self._listeners[seq.request_id]

    def _finished(self, seq: Sequence) -> None:
        if self.on_finish is not None:
            try:
                self.on_finish(self.engine.output(seq))
            except Exception:  # noqa: BLE001 - a metrics hook never stops the engine
                import logging
                logging.getLogger(__name__).exception("on_finish failed for request %s", seq.request_id)

    def _watch_steps(self) -> None:
        """Fail the engine when a step runs past ``stall.seconds(slowest step so far)``."""
        while self.dead is None and not (self._stopping and not self._thread.is_alive()):
            started = self._step_started
            if started is not None:
                waited, bound = time.monotonic() - started, self.stall.seconds(self.slowest_step_s)
                if waited > bound:
                    self._die(EngineStalledError(
                        f"engine step {self._steps + 1} has run for {waited:.1f} s, past its bound of {bound:.1f} s "
                        f"({self.stall.factor:g} x the slowest of {self._steps} steps so far, "
                        f"{self.slowest_step_s:.2f} s, and at least {self.stall.floor_s:g} s)"))
                    return
            time.sleep(min(1.0, self.stall.floor_s / 8))

    def _die(self, err: BaseException) -> None:
        import logging
        logging.getLogger(__name__).error("engine step failed; failing %d requests", len(self._listeners),
                                          exc_info=err)
        with self._lock:
            if self.dead is not None:
                return
            self.dead = err
        dead = EngineDeadError(f"the engine failed: {type(err).__name__}: {err}")
        dead.__cause__ = err
        for rid, listener in list(self._listeners.items()):
            listener.fail(dead)
        self._listeners.clear()
        self._stopping = True
        while True:  # requests that were already in the inbox
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
            if cmd[0] == "add":
                cmd[-1].fail(dead)
