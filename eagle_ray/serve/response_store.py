"""Responses the server keeps, for OpenAI's ``previous_response_id``, ``GET`` / ``DELETE /v1/responses/{id}`` and its
``input_items``.

One named Ray actor per app holds them (``eagle-ray-responses-v2:<app>``, namespace ``eagle_ray``), so that any replica
answers a follow-up to a response another one made; the newest ``ServeConfig.responses_kept`` are kept (the oldest
dropped first), in memory. Each is kept with its own items (its input, then its output) and the id of the response
it continued: a follow-up's conversation is read back along that chain, and ends at a 404 where an earlier link was
dropped, as OpenAI's. The actor is detached: it outlives a replica's restart and ``serve delete``, and takes the
bound of the newest deployment (0 drops all). Outside Ray (a replica's class used on its own) the store is in the
process. A replica awaits the actor on its event loop, never in a worker thread.

A ``background`` response is kept ``in_progress`` at once; its replica beats every ``BEAT_S`` while it makes it
(reading a cancel there), and its end replaces it only where it is still in progress. One whose replica went
silent for ``LOST_S`` has failed; a replica that shuts down fails its own at once.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict

from eagle_ray.serve.openai_api import ApiError
from eagle_ray.serve.responses import _item_id, failure

log = logging.getLogger(__name__)
WAIT_S = 10.0   # for the store's answer; past it a follow-up is a 503, a response goes unkept (said in the log)
BEAT_S = 1.0    # a background response's replica says it is still making it (and reads a cancel) this often
LOST_S = 30.0   # a background response whose replica has not said so for this long failed with its replica
STORE_VERSION = 2   # in the actor's name: a detached store of code with other methods is never called by this one


class ResponseStore:
    """The newest ``limit`` responses by id: each its response object, its own items and the id it continued."""

    def __init__(self, limit: int, lost_s: float = LOST_S):
        self.limit, self.lost_s = limit, lost_s
        self.kept: OrderedDict[str, tuple[dict, list, str | None]] = OrderedDict()
        self.beats: dict[str, float] = {}   # a background response in progress: when its replica last said so

    def put(self, rid: str, response: dict, items: list, parent: str | None) -> None:
        self.kept[rid] = (response, items, parent)
        self.kept.move_to_end(rid)
        self.beats.pop(rid, None)
        if response.get("status") == "in_progress":   # a background response, started
            self.beats[rid] = time.monotonic()
        self.resize(self.limit)

    def finish(self, rid: str, response: dict, items: list) -> bool:
        """A background response's end, kept where it is still in progress (not cancelled, failed with a silent
        replica, deleted or dropped for newer ones)."""
        if self.status(rid) != "in_progress":
            return False
        self.kept[rid] = (response, items, self.kept[rid][2])
        self.beats.pop(rid, None)
        return True

    def status(self, rid: str) -> str | None:
        """A kept response's status (None: not kept); a background one whose replica went silent has failed."""
        if rid in self.beats and time.monotonic() - self.beats[rid] > self.lost_s:
            self.fail(rid, f"the replica making it was lost (silent for {self.lost_s:.0f} s)")
        found = self.kept.get(rid)
        return found[0].get("status") if found else None

    def beat(self, rid: str) -> str | None:
        """A background response's replica is still making it: its status (anything but ``in_progress``: stop)."""
        if rid in self.beats:
            self.beats[rid] = time.monotonic()
        return self.status(rid)

    def cancel(self, rid: str) -> dict | None:
        """OpenAI's cancel: a background response in progress is ``cancelled`` (its replica stops at its next
        beat); any other is answered as it is."""
        if self.status(rid) == "in_progress":
            self._end(rid, {"status": "cancelled"})
        return self.response(rid)

    def fail(self, rid: str, message: str) -> None:
        """A background response in progress that will not end (its replica lost or shut down)."""
        if rid in self.beats:
            self._end(rid, failure(message))

    def _end(self, rid: str, fields: dict) -> None:
        response, items, parent = self.kept[rid]
        self.kept[rid] = (response | fields, items, parent)
        self.beats.pop(rid, None)

    def resize(self, limit: int) -> None:
        """The app's ``responses_kept`` as its newest replica has it."""
        self.limit = limit
        while len(self.kept) > limit:
            self.beats.pop(self.kept.popitem(last=False)[0], None)

    def response(self, rid: str) -> dict | None:
        self.status(rid)
        found = self.kept.get(rid)
        return found[0] if found else None

    def conversation(self, rid: str) -> list | dict | None:
        """The items of the conversation up to and with response ``rid`` (None: it, or an earlier link, is gone;
        ``{"in_progress": id}``: a link is a background response not made yet, whose items are not all known)."""
        chain, at = [], rid
        while at is not None:
            if at not in self.kept:
                return None
            if self.status(at) == "in_progress":
                return {"in_progress": at}
            _, items, at = self.kept[at]
            chain.append(items)
        return [item for items in reversed(chain) for item in items]

    def input_items(self, rid: str) -> list | None:
        """The items response ``rid`` was made from: its conversation's earlier items, then its own input (None:
        it, or an earlier link, is gone)."""
        found = self.kept.get(rid)
        earlier = [] if found is None or found[2] is None else self.conversation(found[2])
        if found is None or not isinstance(earlier, list):
            return None
        response, items, _ = found
        return earlier + items[:len(items) - len(response["output"])]

    def delete(self, rid: str) -> bool:
        self.beats.pop(rid, None)
        return self.kept.pop(rid, None) is not None


class KeptResponses:
    """A replica's side of the app's store (``limit`` 0: nothing kept; an existing store of the app is emptied)."""

    def __init__(self, limit: int, app: str):
        self.limit, self.name = limit, f"eagle-ray-responses-v{STORE_VERSION}:{app}"
        self._store: ResponseStore | object | None = None   # the actor's handle, or this process's store
        import ray
        if not ray.is_initialized():
            self._store = ResponseStore(limit) if limit else None
        elif limit:
            try:
                self._store = self._actor()
                self._store.resize.remote(limit)   # found, not made: it may hold an earlier deployment's bound
            except Exception:  # noqa: BLE001 - made again on the first call
                log.warning("no response store yet", exc_info=True)
        else:
            try:   # an earlier deployment's, if any: emptied
                ray.get_actor(self.name, namespace="eagle_ray").resize.remote(0)
            except ValueError:
                pass

    def _actor(self):
        import ray
        return ray.remote(ResponseStore).options(name=self.name, namespace="eagle_ray", get_if_exists=True,
                                                 lifetime="detached", num_cpus=0, max_restarts=-1).remote(self.limit)

    async def _call(self, method: str, *args):
        """The store's answer, awaited on the event loop (the actor looked up again where it went away)."""
        if isinstance(self._store, ResponseStore):
            return getattr(self._store, method)(*args)
        try:
            if self._store is None:
                self._store = self._actor()
            ref = getattr(self._store, method).remote(*args)
            return await asyncio.wait_for(asyncio.wrap_future(ref.future()), WAIT_S)
        except Exception as e:  # noqa: BLE001 - the actor's node lost, or it is restarting: found again next time
            self._store = None
            raise ApiError(503, f"the response store did not answer ({type(e).__name__}); try again",
                           "server_error") from None

    async def conversation(self, rid: str) -> list:
        """The items a follow-up of ``rid`` continues; raises :class:`ApiError` (404 where they are gone)."""
        found = await self._call("conversation", rid)
        if found is None:
            raise ApiError(404, f"Previous response with id {rid!r} not found (kept: the newest {self.limit} not "
                           "sent with store false, with every earlier response of their conversation)",
                           param="previous_response_id", code="previous_response_not_found")
        if isinstance(found, dict):
            raise ApiError(400, f"Previous response {found['in_progress']!r} is still in progress (background): "
                           "continue it once it has ended", param="previous_response_id")
        return found

    async def response(self, rid: str) -> dict | None:
        return await self._call("response", rid) if self.limit else None

    async def input_items(self, rid: str) -> list | None:
        return await self._call("input_items", rid) if self.limit else None

    async def cancel(self, rid: str) -> dict | None:
        return await self._call("cancel", rid) if self.limit else None

    async def start(self, response: dict, items: list, parent: str | None) -> None:
        """A background response kept ``in_progress``; raises :class:`ApiError` (503) where the store is away."""
        await self._call("put", response["id"], response, items, parent)

    async def finish(self, response: dict, items: list) -> None:
        """A background response's end (kept only where it is still in progress)."""
        try:
            await self._call("finish", response["id"], response, items)
        except ApiError:   # nobody is waiting on this replica: said in the log, failed at LOST_S
            log.warning("background response %s was not kept", response.get("id"), exc_info=True)

    def abandon(self, rids, why: str) -> None:
        """Background responses that will not end (their replica shuts down), failed at once: nothing awaited."""
        try:
            for rid in rids:
                if isinstance(self._store, ResponseStore):
                    self._store.fail(rid, why)
                elif self._store is not None:
                    self._store.fail.remote(rid, why)
        except Exception:  # noqa: BLE001 - shutting down: LOST_S fails them all the same
            log.warning("background responses %s not failed", list(rids), exc_info=True)

    async def beat(self, rid: str) -> str | None:
        """A background response's status as its replica makes it (None: deleted, or dropped for newer ones); a
        store that does not answer is taken as ``in_progress``: it may be back at the next beat."""
        try:
            return await self._call("beat", rid)
        except ApiError:
            return "in_progress"

    async def delete(self, rid: str) -> bool:
        return bool(self.limit) and await self._call("delete", rid)

    async def put(self, response: dict, items: list, parent: str | None) -> None:
        try:
            await self._call("put", response["id"], response, items, parent)
        except ApiError:   # the answer goes out all the same: its follow-ups will not find it
            log.warning("response %s was not kept", response.get("id"), exc_info=True)


def identified(items: list) -> list:
    """A request's input items as kept: each with an id (OpenAI's input items have one; the client's own is kept),
    so that a listing's ``after`` / ``before`` name them. The conversation read back ignores it."""
    prefixes = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
    return [item if "id" in item else {"id": _item_id(prefixes.get(item.get("type", "message"), "item")), **item}
            for item in items]


def listed(item: dict) -> dict:
    """An input item as OpenAI lists it: a message typed, its text in parts (``input_text``; an assistant's
    ``output_text``)."""
    if item.get("type", "message") != "message":
        return item
    content = item.get("content")
    if isinstance(content, str):
        kind = "output_text" if item.get("role") == "assistant" else "input_text"
        content = [{"type": kind, "text": content}]
    return {"type": "message", **item, "content": content}


def item_page(items: list, query) -> dict:
    """OpenAI's list of a response's input items: ``order`` (``desc``, the default, newest first, or ``asc``),
    ``limit`` (1 to 100, default 20) and the ``after`` / ``before`` item ids of cursor paging."""
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ApiError(400, f"order must be 'asc' or 'desc', got {order!r}", param="order")
    try:
        limit = int(query.get("limit", 20))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise ApiError(400, f"limit must be an integer from 1 to 100, got {query.get('limit')!r}", param="limit")
    ordered = [listed(item) for item in (items if order == "asc" else reversed(items))]
    ids = [item.get("id") for item in ordered]
    start, end = 0, len(ordered)
    for key in ("after", "before"):
        if query.get(key) is not None:
            if query[key] not in ids:
                raise ApiError(400, f"{key}: no input item {query[key]!r} in this response", param=key)
            at = ids.index(query[key])
            start, end = (at + 1, end) if key == "after" else (start, at)
    page = ordered[start:end]
    data = page[:limit] if query.get("before") is None or query.get("after") is not None else page[-limit:]
    more = len(page) > len(data)
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": more}
