"""The Ray Data stage: an actor that holds one engine and turns batches of input rows into output rows.

``__call__`` is async and Ray Data runs several batches per actor at once (``max_concurrent_batches``); each
batch submits its rows to the actor's one :class:`RequestQueue`, so the engine stays full across batch
boundaries instead of draining at every batch's tail. A bad row becomes an output row with ``error`` and
``error_kind`` set.

If the engine itself fails under a batch, the rows it left unfinished run again one at a time on the restarted
engine (``actors.row_retries`` times): a row that breaks the engine alone becomes an ``engine_failed`` row naming
that, and the others get their answers; one poison row never takes its batch, or the job, with it. A stalled step,
or an engine that cannot restart, ends the actor's process instead: Ray restarts it (as long as the job runs, unless
``actors.max_restarts`` bounds it) and retries its batches (the driver keeps each id once), as it does when a node
is lost. Retries are unbounded, so a batch that kills every actor it runs on would loop: the job's
:class:`BatchLedger` counts the actors that died under each batch, and a batch that has cost
``DEATHS_PER_BATCH`` of them comes back as ``engine_failed`` rows (run again on resume) instead of running again.
"""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import socket
import uuid
from datetime import datetime, timezone

import pyarrow as pa

from eagle_ray.batch.config import ProcessorConfig
from eagle_ray.batch.openai_batch import answer_columns, batch_response, parse_line, refusal
from eagle_ray.batch.rows import (ENGINE_FAILED, INTERNAL_ERROR, empty_row, error_kind, is_batch_line,
                                  logprob_columns, stop_text, to_table)
from eagle_ray.engine.reasoning import markers_of, mode_for, split_reasoning
from eagle_ray.engine.request import Prompt, RowRequest, parse_row
from eagle_ray.errors import EagleError, EngineStalledError
from eagle_ray.serve.answer import final_body, prepare_request, run_all, run_whole, token_counter
from eagle_ray.serve.choices import merged_stats
from eagle_ray.serve.logprobs import TokenText
from eagle_ray.serve.openai_api import ApiError
from eagle_ray.stats import RequestStats

log = logging.getLogger(__name__)


def now() -> datetime:
    return datetime.now(timezone.utc)


DEATHS_PER_BATCH = 3   # actors that may die under one batch before its rows fail instead of running again


class BatchLedger:
    """The batches started and not yet finished, over the whole pool (a Ray actor on the driver's node): a batch
    begun again while still open was running when its actor died (its node lost, the process crashed or was
    ended), and ``begin`` says how many times that has happened."""

    def __init__(self):
        self.open: dict[str, int] = {}

    def begin(self, key: str) -> int:
        """Record a start of batch ``key``; returns how many earlier starts of it never finished."""
        n = self.open.get(key, 0)
        self.open[key] = n + 1
        return n

    def end(self, key: str) -> None:
        self.open.pop(key, None)


def batch_ledger():
    """A :class:`BatchLedger` actor for one run of the pool, pinned to this (the driver's) node, whose loss ends
    the job anyway; None outside Ray."""
    import ray
    if not ray.is_initialized():
        return None
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
    return ray.remote(BatchLedger).options(num_cpus=0, scheduling_strategy=here).remote()


def batch_key(items: list[dict]) -> str:
    """A batch's name across retries: Ray Data retries a block whole, cut into the same batches."""
    import hashlib
    return hashlib.sha1("\n".join(str(i["id"]) for i in items).encode("utf-8", "surrogatepass")).hexdigest()


class JobMetrics:
    """The job's counters through Ray's metrics API (the Ray dashboard, and Prometheus on a cluster), named like
    Serve's /metrics (``serve/metrics.py``) with ``eagle_ray_`` for ``vllm:``; nothing outside a Ray worker."""

    def __init__(self, model_name: str):
        from ray.util import metrics
        tags = {"model_name": model_name}
        self.rows = metrics.Counter("eagle_ray_job_rows", "rows finished (error rows included)", ("error_kind",))
        self.counters = {name: metrics.Counter(f"eagle_ray_{name}", what, ("model_name",)) for name, what in (
            ("prompt_tokens", "prompt tokens"), ("generation_tokens", "generated tokens"),
            ("spec_decode_num_drafts", "verify steps with a draft tree"),
            ("spec_decode_num_accepted_tokens", "draft tokens accepted"))}
        self.tau = metrics.Histogram("eagle_ray_tau", "tokens per verify step of each row",
                                     boundaries=[1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0],
                                     tag_keys=("model_name",))
        for m in (*self.counters.values(), self.tau):
            m.set_default_tags(tags)

    def record(self, row: dict) -> None:
        self.rows.inc(tags={"error_kind": row["error_kind"] or "none"})
        if row["error"]:
            return
        counts = {"prompt_tokens": row["prompt_tokens"], "generation_tokens": row["output_tokens"]}
        if row.get("verify_steps") and (row.get("mean_tree_size") or 0) > 1:
            counts |= {"spec_decode_num_drafts": row["verify_steps"],
                       "spec_decode_num_accepted_tokens": sum(row.get("accepted_per_depth") or [])}
            self.tau.observe(row["tau"])
        for name, n in counts.items():
            if n:   # Ray's counters take positive increments only
                self.counters[name].inc(n)


def saved_heads(cfg: ProcessorConfig) -> str | None:
    """Where the actors write their adapted heads (``engine.adaptation.save``), or None."""
    a = cfg.engine.adaptation
    return a.save_dir if a.enabled and a.save and a.save_dir else None


def job_metrics(model_name: str) -> JobMetrics | None:
    try:
        import ray
        return JobMetrics(model_name) if ray.is_initialized() else None
    except Exception:  # noqa: BLE001 - metrics never stop a job
        log.warning("Ray metrics are not available; the job goes on without them")
        return None


def failed(rows: list[dict]) -> bool:
    """An item's rows failed with the engine (they run again, alone)."""
    return any(r["error_kind"] == ENGINE_FAILED for r in rows)


def sampling_columns(p, choices_in_one_row: bool = False) -> dict:
    """The sampling a row ran with, as its columns. A resume reads ``n`` from ``sampling_params`` to count a row's
    sample rows, so it comes first (a schema's own ``"n": 5`` comes later) and is 1 where the row holds its ``n``
    choices itself (a batch line's)."""
    fields = p.model_dump(mode="json")
    n = fields.pop("n")
    fields = {"n": 1 if choices_in_one_row else n} | fields
    dumped = json.dumps(fields, ensure_ascii=False, separators=(",", ":"))
    return {"temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k, "max_new_tokens": p.max_new_tokens,
            "seed": p.seed, "sampling_params": dumped}


def stat_columns(stats: RequestStats) -> dict:
    """A row's acceptance and time columns (the per-step lists stay out of the output)."""
    return {k: v for k, v in stats.to_dict().items() if k not in ("step_tokens", "tree_tokens")}


class GenerateStage:
    ledger = None   # the pool's BatchLedger (outside Ray: none)

    def __init__(self, config_json: str, ledger=None):
        from eagle_ray.engine.engine import EagleEngine
        from eagle_ray.engine.queue import RequestQueue, StallBound

        self.cfg = ProcessorConfig.of(json.loads(config_json))
        self.ledger = ledger
        engine_cfg = self.cfg.engine.for_ray_worker(self.cfg.actors.num_cpus, self.cfg.actors.num_gpus)
        heads = saved_heads(self.cfg)
        if heads:   # where this actor writes its adapted heads, checked before the model loads
            from eagle_ray.train.online import check_save_dir
            check_save_dir(heads, self.cfg.s3.storage_options())
        self.engine = EagleEngine.from_config(engine_cfg, self.cfg.s3.storage_options())
        self.engine.codec.split_special_tokens = self.cfg.split_special_tokens
        self.engine.reasoning_parser = self.cfg.reasoning_parser   # structured output waits for the answer
        self.stall = StallBound(self.cfg.actors.stall_floor_s, self.cfg.actors.stall_factor)
        self.queue = RequestQueue(self.engine, self.stall)
        self.isolating = asyncio.Lock()
        self.metrics = job_metrics(self.cfg.engine.model.target or "embedded")
        self.target_name = engine_cfg.model.target or "embedded:SmolLM2-135M-Instruct"
        self.draft_name = engine_cfg.model.draft or ("embedded:smollm2-135m-instruct-eagle" if engine_cfg.model.target is None
                                               else "none")
        self.worker_id = f"{socket.gethostname()}:{os.getpid()}"
        try:
            import ray
            if ray.is_initialized():   # asking for the runtime context would start a Ray of its own
                self.worker_id = f"{self.worker_id}:{ray.get_runtime_context().get_actor_id()[:8]}"
        except Exception:  # noqa: BLE001 - outside an actor (tests, direct use)
            pass
        from eagle_ray.train.online import adapt
        adapter = adapt(self.engine)
        if adapter is not None and heads:
            folder = "".join(c if c.isalnum() or c in "-_." else "-" for c in self.worker_id)
            adapter.on_swap = lambda a: a.save(f"{heads.rstrip('/')}/{folder}", self.cfg.s3.storage_options(),
                                               self.draft_name)

    async def __call__(self, batch: pa.Table) -> pa.Table:
        items = batch.to_pylist()
        key = batch_key(items)
        deaths = await self.deaths_under(key)
        if deaths >= DEATHS_PER_BATCH:   # it killed every actor it ran on: its rows fail, the job goes on
            why = (f"{deaths} actors died while this row's batch ran on them (a lost node, a crash, an out-of-memory "
                   "kill, or rows that break the engine); the batch is not run again in this job")
            log.error("batch of %d rows (first id %s): %s", len(items), items[0]["id"] if items else "-", why)
            rows = [await self.rows_for(item | {"error": why, "error_kind": ENGINE_FAILED}) for item in items]
        else:
            rows = list(await asyncio.gather(*(self.rows_for(item) for item in items)))   # per item: its rows
            if any(failed(r) for r in rows) or not self.queue.healthy:
                rows = await self.isolate(items, rows)
        rows = [r for item_rows in rows for r in item_rows]
        if self.metrics is not None:
            for row in rows:
                self.metrics.record(row)
        if self.ledger is not None:
            self.ledger.end.remote(key)
        return to_table(rows)

    async def deaths_under(self, key: str) -> int:
        """Record this start of batch ``key`` in the ledger; how many actors died under it before (0 without a
        ledger, or when it cannot answer: the batch runs, as it would have without one)."""
        if self.ledger is None:
            return 0
        try:
            return await self.ledger.begin.remote(key)
        except Exception:  # noqa: BLE001 - the ledger's node is gone (the driver's, as a rule): run the batch
            log.warning("the batch ledger did not answer; running the batch", exc_info=True)
            return 0

    def restart_engine(self) -> None:
        """A fresh queue over the restarted engine; where that cannot be (the step stalled and still holds the
        engine, or restarting fails), the actor process ends for Ray to restart it."""
        if isinstance(self.queue.dead, EngineStalledError):
            self.die()
        from eagle_ray.engine.queue import RequestQueue
        try:
            self.queue.shutdown(drain=False, timeout=5)
            self.engine.restart()
            self.queue = RequestQueue(self.engine, self.stall)
        except Exception:  # noqa: BLE001 - a device that faulted cannot restart in this process
            log.exception("the engine could not restart in this process")
            self.die()

    async def isolate(self, items: list[dict], rows: list[list[dict]]) -> list[list[dict]]:
        """Rerun, one at a time on a restarted engine, the rows the engine's failure left without an answer."""
        async with self.isolating:   # one batch isolates at a time; the others wait for the restarted engine
            alone = [i for i, r in enumerate(rows) if failed(r)]
            for i in alone:
                for attempt in range(self.cfg.actors.row_retries):
                    if not failed(rows[i]):
                        break
                    if not self.queue.healthy:
                        self.restart_engine()
                    rows[i] = await self.rows_for(items[i])
                    if failed(rows[i]) and not self.queue.healthy:
                        for r in rows[i]:
                            r["error"] = (f"the engine failed on this row run alone ({attempt + 1} of "
                                          f"{self.cfg.actors.row_retries} tries): {r['error']}")
            if len(alone) > 1 and all(failed(rows[i]) for i in alone):
                self.die()   # every row breaks it: the engine, not the rows, is broken; Ray restarts the actor
            if not self.queue.healthy:
                self.restart_engine()
        return rows

    def die(self) -> None:
        """The engine failed: end this actor process the way a crash would, so Ray restarts it and retries its
        batches (``ray.actor.exit_actor`` would end it for good)."""
        log.error("engine failed (%r); exiting so that Ray retries this actor's batches", self.queue.dead)
        logging.shutdown()
        os._exit(1)

    async def process(self, item: dict) -> dict:
        """The item's (first) output row."""
        return (await self.rows_for(item))[0]

    async def rows_for(self, item: dict) -> list[dict]:
        """The item's output rows: one, or one per sample (``sampling_params.n``), or one error row."""
        row = empty_row(item)
        row.update(target_model=self.target_name, draft_model=self.draft_name, speculative=self.cfg.speculative,
                   worker_id=self.worker_id, started_at=now())
        if item.get("error"):
            row.update(error=item["error"], tree=json.dumps(self.engine.policy.summary()), finished_at=now())
            return [row]
        samples = None
        try:
            rec = json.loads(item["payload"])
            if is_batch_line(rec):
                await self.answer_line(rec, row)
            else:
                samples = await self.run_row(parse_row(rec, self.cfg.sampling, self.cfg.tool_call_parser,
                                                       self.cfg.reasoning_parser), row, item["id"])
        except EagleError as e:
            row.update(error=str(e), error_kind=error_kind(e))
        except Exception as e:  # noqa: BLE001 - an unexpected failure still loses only this row
            log.exception("row %s failed", item["id"])
            row.update(error=f"{type(e).__name__}: {e}", error_kind=INTERNAL_ERROR)
        if row["error"]:   # a multi-turn row keeps the turns answered before the one that failed
            for key in ("output", "reasoning", "tool_calls", "output_token_ids", "prompt_tokens", "output_tokens",
                        "finish_reason", "stop_reason"):
                row[key] = None
            row["turn_outputs"] = row["turn_outputs"] or None
        row["tree"] = json.dumps(self.engine.policy.summary())   # what each batch size runs as this row ends
        row["finished_at"] = now()
        if row["error"] or samples is None:
            return [row]
        return [row | sample | {"tree": row["tree"], "finished_at": row["finished_at"]} for sample in samples]

    async def run_row(self, req: RowRequest, row: dict, rid: str) -> list[dict] | None:
        """A prompt, chat or turns row into ``row``; the columns of each of its samples (None: one answer)."""
        p = req.params
        row.update(sampling_columns(p))
        if req.continuations is not None:
            await self.score(req, row, rid)
        elif p.n > 1:
            return await self.run_samples(req, row, rid)
        else:
            await self.run(req, row, rid)
        return None

    @functools.cached_property
    def token_text(self) -> TokenText:
        return TokenText(self.engine.tokenizer)   # token texts and bytes of logprobs, decoded once

    @functools.cached_property
    def count_tokens(self):
        return token_counter(self.engine.tokenizer)   # a Responses answer's thinking tokens

    async def answer_line(self, rec: dict, row: dict) -> None:
        """A line of an OpenAI batch file, answered as Serve answers its body (``batch/openai_batch.py``): the
        whole answer (or the HTTP error) in ``response``, its first choice in the usual columns. A refused line is
        an error row whose ``error_kind`` says what any row's would."""
        try:
            kind, req = parse_line(rec, self.cfg.sampling.max_new_tokens, self.cfg.tool_call_parser,
                                   self.cfg.reasoning_parser)
            row.update(sampling_columns(req.params, choices_in_one_row=True))
            ready = await asyncio.to_thread(prepare_request, self.engine, req, kind, req.body.model,
                                            self.cfg.speculative, self.token_text)
            body, outs = await run_whole(self.queue, ready, req.body.model)
        except (ApiError, EagleError) as e:
            kind, err = refusal(e)
            row.update(error=err.message, error_kind=kind, response=batch_response(err.status, err.body()))
            return
        row.update(**answer_columns(ready.kind, body, outs), **stat_columns(merged_stats(outs)),
                   response=batch_response(200, final_body(ready, body, self.count_tokens)))
        if not ready.shown:   # a Responses line's include_reasoning false: its chat kept the thinking, the row not
            row["reasoning"] = None

    def answer(self, out, req: RowRequest) -> dict:
        """An output's ``output`` (and ``turn_outputs``), ``reasoning``, ``tool_calls``, ``finish_reason`` and
        ``stop_reason`` columns: with a reasoning parser, its thinking apart (``engine/reasoning.py``: its mode read
        from the end of the prompt; no answer is ""); with tools, its calls read as Serve reads them
        (``engine/tools.py``), as OpenAI's JSON list."""
        thought, text = None, out.text
        if self.cfg.reasoning_parser is not None:
            mode = mode_for(self.cfg.reasoning_parser, self.engine.tokenizer, out.prompt_token_ids,
                            req.params.guided is not None)
            thought, text = split_reasoning(out.text, mode, markers_of(self.cfg.reasoning_parser))
        calls, reason = None, out.finish_reason
        if req.tools is not None and req.tools.calls and text is not None:
            message, reason = req.tools.message(text, reason)
            text, calls = message["content"], message.get("tool_calls")
        return {"output": text or "", "reasoning": thought, "turn_outputs": [text or ""], "finish_reason": reason,
                "stop_reason": stop_text(out.stop_reason),
                "tool_calls": json.dumps(calls, ensure_ascii=False) if calls else None}

    async def run_samples(self, req: RowRequest, row: dict, rid: str) -> list[dict]:
        """``n`` samples of the row's prompt (its prefill shared: ``engine/samples.py``): per sample, what its
        output row holds besides the row's own columns."""
        seqs = await asyncio.to_thread(self.engine.make_samples, req.prompt, req.params,
                                       f"{rid}/{uuid.uuid4().hex[:8]}", self.cfg.speculative)
        self.engine.check_room(len(seqs[0].prompt_ids), req.asked_tokens)
        outs = await run_all(self.queue, seqs)
        # the prompt's values, from the sample that ran all of it (the others copied its first tokens' K/V)
        prompt = max((o.prompt_logprobs for o in outs if o.prompt_logprobs is not None), key=len, default=None)
        return [{"output_token_ids": o.token_ids, **self.answer(o, req),
                 "prompt_tokens": len(o.prompt_token_ids), "output_tokens": len(o.token_ids),
                 "sample_index": o.sample_index,
                 **logprob_columns(o.logprobs, prompt),
                 **stat_columns(o.stats)}
                for o in outs]

    async def score(self, req: RowRequest, row: dict, rid: str) -> None:
        """A scoring row: each continuation's log-likelihood after the prompt, nothing generated
        (``engine/scoring.py``)."""
        from eagle_ray.engine.scoring import score_of, scoring_sequences
        seqs = await asyncio.to_thread(scoring_sequences, self.engine, req.prompt.value, req.continuations,
                                       f"{rid}/{uuid.uuid4().hex[:8]}", req.params.priority)
        outs = await run_all(self.queue, seqs)
        scores = [score_of(o.prompt_logprobs, o.prompt_token_ids) for o in outs]
        stats = RequestStats()
        for o in outs:
            stats.merge(o.stats)
        row.update(continuation_logprobs=[s.logprob for s in scores], continuation_tokens=[s.tokens for s in scores],
                   continuation_greedy=[s.greedy for s in scores], sample_index=0,
                   prompt_tokens=len(outs[0].prompt_token_ids) - scores[0].tokens, output_tokens=0,
                   **stat_columns(stats))

    async def run(self, req: RowRequest, row: dict, rid: str) -> None:
        turns = req.turns or [None]
        messages: list[dict] = []
        stats, outputs, prompt_tokens, output_tokens, finish = RequestStats(), [], 0, 0, None
        for i, turn in enumerate(turns):
            if req.kind == "turns":
                messages.append({"role": "user", "content": turn})
                prompt = Prompt("messages", list(messages), req.variables)
            else:
                prompt = req.prompt
            try:
                # the row's id, and a suffix of its own: two rows may share an id in a processor's dataset
                seq = await self.queue.aprepare(prompt, req.params, f"{rid}/{i}/{uuid.uuid4().hex[:8]}",
                                                self.cfg.speculative)
                self.engine.check_room(len(seq.prompt_ids), req.asked_tokens)   # a row's max_tokens
                out = await self.queue.agenerate(seq)
            except EagleError as e:
                if req.kind != "turns":
                    raise
                row["turn_outputs"] = outputs   # what was answered stays
                raise type(e)(f"turn {i + 1} of {len(turns)}: {e}" + (f" (turns 1-{i} were answered: turn_outputs)"
                                                                      if i else "")) from None
            answer = self.answer(out, req)
            if req.kind == "turns":   # the next turn sees the answer, not the thinking
                messages.append({"role": "assistant", "content": answer["output"]})
            outputs.append(answer["output"])
            prompt_tokens += len(out.prompt_token_ids)
            output_tokens += len(out.token_ids)
            stats.merge(out.stats)
            finish = answer["finish_reason"]
        row.update(output=outputs[-1], reasoning=answer["reasoning"], tool_calls=answer["tool_calls"],
                   stop_reason=answer["stop_reason"],
                   turn_outputs=outputs, output_token_ids=out.token_ids,
                   prompt_tokens=prompt_tokens, sample_index=0, **logprob_columns(out.logprobs, out.prompt_logprobs),
                   output_tokens=output_tokens, finish_reason=finish, **stat_columns(stats))
