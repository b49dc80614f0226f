"""The Ray Data stage: an actor that holds one engine and turns batches of input rows into output rows.

``__call__`` is async and Ray Data runs several batches per actor at once (``max_concurrent_batches``); each
batch submits its rows to the actor's one :class:`RequestQueue`, so the engine stays full across batch
boundaries instead of draining at every batch's tail. A bad row becomes an output row with ``error`` and
``error_kind`` set. If the engine itself fails, the actor exits once its in-flight batches have their rows: Ray
restarts it and retries those batches on a fresh engine (the driver keeps each id once).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
from datetime import datetime, timezone

import pyarrow as pa

from eagle_ray.batch.config import JobConfig
from eagle_ray.batch.rows import INTERNAL_ERROR, empty_row, error_kind, to_table
from eagle_ray.engine.request import RowRequest, parse_row
from eagle_ray.errors import EagleError
from eagle_ray.stats import RequestStats

log = logging.getLogger(__name__)


def now() -> datetime:
    return datetime.now(timezone.utc)


class GenerateStage:
    def __init__(self, config_json: str):
        from eagle_ray.engine.engine import EagleEngine
        from eagle_ray.engine.queue import RequestQueue

        self.cfg = JobConfig(**json.loads(config_json))
        engine_cfg = self.cfg.engine.for_ray_worker(self.cfg.actors.num_cpus, self.cfg.actors.num_gpus)
        self.engine = EagleEngine.from_config(engine_cfg, self.cfg.s3.storage_options())
        self.queue = RequestQueue(self.engine)
        self.target_name = engine_cfg.model.target or "embedded:SmolLM2-135M-Instruct"
        self.draft_name = engine_cfg.model.draft or ("embedded:smollm2-135m-instruct-eagle" if engine_cfg.model.target is None
                                               else "none")
        self.worker_id = f"{socket.gethostname()}:{os.getpid()}"
        try:
            import ray
            self.worker_id = f"{self.worker_id}:{ray.get_runtime_context().get_actor_id()[:8]}"
        except Exception:  # noqa: BLE001 - outside Ray (tests, direct use)
            pass

    async def __call__(self, batch: pa.Table) -> pa.Table:
        rows = await asyncio.gather(*(self.process(item) for item in batch.to_pylist()))
        if not self.queue.healthy:
            self.die()
        return to_table(list(rows))

    def die(self) -> None:
        """The engine failed: end this actor process the way a crash would, so Ray restarts it and retries its
        batches (``ray.actor.exit_actor`` would end it for good)."""
        log.error("engine failed (%r); exiting so that Ray retries this actor's batches", self.queue.dead)
        logging.shutdown()
        os._exit(1)

    async def process(self, item: dict) -> dict:
        row = empty_row(item)
        row.update(target_model=self.target_name, draft_model=self.draft_name, speculative=self.cfg.speculative,
                   worker_id=self.worker_id, started_at=now())
        if item.get("error"):
            row.update(error=item["error"], tree=json.dumps(self.engine.policy.summary()), finished_at=now())
            return row
        try:
            req = parse_row(json.loads(item["payload"]), self.cfg.sampling)
            p = req.params
            row.update(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, max_new_tokens=p.max_new_tokens,
                       seed=p.seed, sampling_params=p.model_dump_json())
            await self.run(req, row, item["id"])
        except EagleError as e:
            row.update(error=str(e), error_kind=error_kind(e))
        except Exception as e:  # noqa: BLE001 - an unexpected failure still loses only this row
            log.exception("row %s failed", item["id"])
            row.update(error=f"{type(e).__name__}: {e}", error_kind=INTERNAL_ERROR)
        if row["error"]:
            for key in ("output", "turn_outputs", "output_token_ids", "prompt_tokens", "output_tokens",
                        "finish_reason"):
                row[key] = None
        row["tree"] = json.dumps(self.engine.policy.summary())   # what each batch size runs as this row ends
        row["finished_at"] = now()
        return row

    async def run(self, req: RowRequest, row: dict, rid: str) -> None:
        turns = req.turns or [None]
        messages: list[dict] = []
        stats, outputs, prompt_tokens, output_tokens, finish = RequestStats(), [], 0, 0, None
        for i, turn in enumerate(turns):
            if req.kind == "turns":
                messages.append({"role": "user", "content": turn})
                prompt = list(messages)
            else:
                prompt = req.prompt
            out = await self.queue.agenerate(prompt, req.params, request_id=f"{rid}/{i}",
                                             speculative=self.cfg.speculative)
            if req.kind == "turns":
                messages.append({"role": "assistant", "content": out.text})
            outputs.append(out.text)
            prompt_tokens += len(out.prompt_token_ids)
            output_tokens += len(out.token_ids)
            stats.merge(out.stats)
            finish = out.finish_reason
        row.update(output=outputs[-1], turn_outputs=outputs, output_token_ids=out.token_ids,
                   prompt_tokens=prompt_tokens,
                   output_tokens=output_tokens, finish_reason=finish, **stats.to_dict())
        row.pop("step_tokens", None)
        row.pop("tree_tokens", None)
