"""Responses the server keeps, for OpenAI's ``previous_response_id`` and ``GET`` / ``DELETE /v1/responses/{id}``.

One named Ray actor per app holds them, so that any replica answers a follow-up to a response another one made;
the newest ``ServeConfig.responses_kept`` are kept (the oldest dropped first), in memory: an app started again
keeps none. Each is kept with its whole conversation as Responses items (its chain's inputs and outputs, then its
own), so that a follow-up needs that one response alone, whichever earlier ones were dropped. Outside Ray (a
replica's class used on its own) the store is in the process.
"""
from __future__ import annotations

import logging
from collections import OrderedDict

log = logging.getLogger(__name__)
WAIT_S = 30.0   # for the store's answer; past it a follow-up is a 503, a response goes unkept (said in the log)


class ResponseStore:
    """The newest ``limit`` responses by id: each its response object and its conversation's items."""

    def __init__(self, limit: int):
        self.limit = limit
        self.kept: OrderedDict[str, tuple[dict, list]] = OrderedDict()

    def put(self, rid: str, response: dict, items: list) -> None:
        self.kept[rid] = (response, items)
        self.kept.move_to_end(rid)
        self.resize(self.limit)

    def resize(self, limit: int) -> None:
        """The app's ``responses_kept`` as its newest replica has it (the actor outlives a redeployment)."""
        self.limit = limit
        while len(self.kept) > limit:
            self.kept.popitem(last=False)

    def get(self, rid: str) -> tuple[dict, list] | None:
        return self.kept.get(rid)

    def delete(self, rid: str) -> bool:
        return self.kept.pop(rid, None) is not None


class KeptResponses:
    """A replica's side of the app's store (``limit`` 0: nothing kept, and nothing asked of Ray)."""

    def __init__(self, limit: int, app: str):
        self.limit, self.name = limit, f"eagle-ray-responses:{app}"
        self._store = None
        if limit:
            import ray
            self._store = ray.remote(ResponseStore).options(
                name=self.name, namespace="eagle_ray", get_if_exists=True, lifetime="detached",
                num_cpus=0).remote(limit) if ray.is_initialized() else ResponseStore(limit)
            if not isinstance(self._store, ResponseStore):
                self._store.resize.remote(limit)   # found, not made: it may hold an earlier deployment's bound

    def _call(self, method: str, *args):
        """The store's answer (blocking: call it off the event loop)."""
        if isinstance(self._store, ResponseStore):
            return getattr(self._store, method)(*args)
        import ray
        return ray.get(getattr(self._store, method).remote(*args), timeout=WAIT_S)

    def get(self, rid: str) -> tuple[dict, list] | None:
        return self._call("get", rid) if self.limit else None

    def delete(self, rid: str) -> bool:
        return bool(self.limit) and self._call("delete", rid)

    def put(self, response: dict, items: list) -> None:
        try:
            self._call("put", response["id"], response, items)
        except Exception:  # noqa: BLE001 - the answer is out already: its follow-ups will not find it
            log.warning("response %s was not kept", response.get("id"), exc_info=True)
