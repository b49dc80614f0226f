"""RequestQueue: one engine, many callers (the Ray Data stage's in-flight batches, Serve's HTTP requests).

A background thread owns the engine and steps it while any request is pending, so requests submitted at
different times share verify passes (continuous batching). Callers get a future of the final output, or a
stream of text deltas, from plain threads or from asyncio; cancelling frees the request's slot before the next
step.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Iterator

from eagle_ray.config import SamplingParams
from eagle_ray.engine.engine import EagleEngine, RequestOutput
from eagle_ray.engine.sequence import Sequence
from eagle_ray.errors import EagleError, InvalidRequestError


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
        text = engine.output_text(seq)
        end = len(text)
        if not final:
            hold = max((len(s) for s in seq.params.stop), default=1) - 1
            end = max(self.sent, end - hold)
            while end > self.sent and text[end - 1] == "\ufffd":
                end -= 1
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
    def __init__(self, engine: EagleEngine):
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._listeners: dict[str, _Listener] = {}
        self._stopping = False
        self._drain = True
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="eagle-ray-engine", daemon=True)
        self._thread.start()

    # ---- callers ------------------------------------------------------------------------------------------------
    def submit(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
               speculative: bool = True, on_delta: Callable[[StreamDelta], None] | None = None
               ) -> concurrent.futures.Future:
        """Queue a request; the future resolves to its RequestOutput (or raises its typed error)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_running_or_notify_cancel()  # not cancellable: callers cancel the request with cancel(id)
        rid = request_id or uuid.uuid4().hex
        with self._lock:
            if self._stopping:
                raise InvalidRequestError("the engine is shutting down")
            self._inbox.put(("add", rid, prompt, params or SamplingParams(), speculative,
                             _Listener(rid, on_delta, future)))
        return future

    def generate(self, prompt, params: SamplingParams | None = None, **kw) -> RequestOutput:
        return self.submit(prompt, params, **kw).result()

    def stream(self, prompt, params: SamplingParams | None = None, **kw) -> Iterator[StreamDelta]:
        deltas: queue.SimpleQueue = queue.SimpleQueue()
        rid = kw.pop("request_id", None) or uuid.uuid4().hex
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
        rid = request_id or uuid.uuid4().hex
        future = self.submit(prompt, params, request_id=rid, **kw)
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
        rid = request_id or uuid.uuid4().hex
        self.submit(prompt, params, request_id=rid, on_delta=lambda d: loop.call_soon_threadsafe(deltas.put_nowait, d),
                    **kw)
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
        while True:
            idle = not self.engine.has_unfinished()
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
            if self.engine.has_unfinished():
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
            _, rid, prompt, params, speculative, listener = cmd
            if self._stopping and not self._drain:
                listener.fail(InvalidRequestError("the engine is shutting down"))
                return
            if rid in self._listeners:
                listener.fail(InvalidRequestError(f"request id {rid!r} is already running"))
                return
            try:
                listener.seq = self.engine.add_request(prompt, params, rid, speculative)
            except EagleError as e:
                listener.fail(e)
                return
            except Exception as e:  # noqa: BLE001 - e.g. a tokenizer or chat template that raises on this input
                listener.fail(InvalidRequestError(f"request rejected: {type(e).__name__}: {e}"))
                return
            self._listeners[rid] = listener
        elif kind == "cancel":
            listener = self._listeners.pop(cmd[1], None)
            if listener is not None:
                seq = self.engine.abort(cmd[1])
                if seq is not None:
                    listener.update(self.engine, seq)
        elif kind == "stop":
            self._drain = cmd[1]
            if not self._drain:
                for rid in list(self._listeners):
                    self._handle(("cancel", rid))

    def _step(self) -> None:
        try:
            touched = self.engine.step()
        except Exception as e:  # noqa: BLE001 - an engine bug must fail its requests, not hang every caller
            for rid, listener in list(self._listeners.items()):
                self.engine.abort(rid)
                listener.fail(e)
            self._listeners.clear()
            return
        for seq in touched:
            listener = self._listeners.get(seq.request_id)
            if listener is None:
                continue
            try:
                listener.update(self.engine, seq)
            except Exception as e:  # noqa: BLE001 - e.g. a detokenizer error: fail this request, keep the rest
                self.engine.abort(seq.request_id)
                listener.fail(e)
                self._listeners.pop(seq.request_id, None)
                continue
            if seq.finished:
                del self._listeners[seq.request_id]
