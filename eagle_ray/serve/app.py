"""Ray Serve app: an OpenAI-compatible HTTP API over one continuously batched EAGLE engine per replica.

Every request goes into the replica's :class:`RequestQueue`, so concurrent requests share verify passes. A client
that disconnects mid-stream has its request cancelled (its slot is free before the next step); shutdown drains
what is in flight.
"""

import asyncio
import functools
import json
import os
import time
from pathlib import Path

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from eagle_ray.engine.tools import CallReader
from eagle_ray.errors import EagleError
from eagle_ray.serve import responses
from eagle_ray.serve.answer import api_error, final_body, prepare_request, run_whole, token_counter
from eagle_ray.serve.choices import ChoiceShape, Chunks, Interleaved, StreamState, usage
from eagle_ray.serve.config import ServeConfig
from eagle_ray.serve.logprobs import TokenText
from eagle_ray.serve.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from eagle_ray.serve.metrics import ReplicaMetrics, ServeMetrics
from eagle_ray.serve.openai_api import (ApiError, ParsedRequest, authorized, eagle_stats, error_body, finish_reason,
                                        load_object, now, parse_body)
from eagle_ray.serve.response_store import BEAT_S, KeptResponses, identified, item_page
from eagle_ray.serve.tokens import DetokenizeRequest, TokenizeRequest, parse_tokens_body
from eagle_ray.serve.tokens import answer as token_answer
from eagle_ray.train.online import adapt

api = FastAPI(title="eagle-ray", docs_url=None, redoc_url=None)


@api.exception_handler(HTTPException)
async def _http_error(request: Request, e: HTTPException) -> JSONResponse:
    """Unknown routes and methods answer in OpenAI's error shape too, which clients parse."""
    return JSONResponse(error_body(str(e.detail), "invalid_request_error" if e.status_code < 500 else "server_error",
                                   code="not_found" if e.status_code == 404 else None),
                        status_code=e.status_code, headers=getattr(e, "headers", None))


def _err(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
         code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status)


def _unauthorized() -> JSONResponse:
    return _err(401, "missing or wrong API key (Authorization: Bearer <key>)", "authentication_error",
                code="invalid_api_key")


def _engine_error(e: EagleError) -> JSONResponse:
    err = api_error(e)
    return JSONResponse(err.body(), status_code=err.status)


def api_key_from_env(cfg: ServeConfig) -> str | None:
    """The bearer key, when the config asks for one; fails closed (a missing secret must not turn auth off)."""
    if not cfg.api_key_env:
        return None
    key = (os.environ.get(cfg.api_key_env) or "").strip()   # a mounted secret often ends in a newline
    if not key:
        raise RuntimeError(f"api_key_env={cfg.api_key_env!r} is set but that environment variable is empty or "
                           "missing on this replica")
    return key


@serve.deployment(max_ongoing_requests=256, graceful_shutdown_timeout_s=60)
@serve.ingress(api)
class EagleServer:
    def __init__(self, config_json: str):
        from eagle_ray.engine.engine import EagleEngine
        from eagle_ray.engine.queue import RequestQueue, StallBound

        self.cfg = ServeConfig(**json.loads(config_json))
        self.api_key = api_key_from_env(self.cfg)  # before the model loads: a missing secret fails in seconds
        engine_cfg = self.cfg.engine.for_ray_worker(self.cfg.num_cpus, self.cfg.num_gpus)
        self.engine = EagleEngine.from_config(engine_cfg, self.cfg.s3.storage_options())
        adapt(self.engine)   # online adaptation, where the config turns it on
        self.engine.codec.split_special_tokens = self.cfg.split_special_tokens
        self.engine.reasoning_parser = self.cfg.reasoning_parser   # structured output waits for the answer
        self.metrics = ServeMetrics(self.cfg.model_name)   # every request that ends counts, cancelled ones too
        self.queue = RequestQueue(self.engine, StallBound(self.cfg.stall_floor_s, self.cfg.stall_factor),
                                  on_finish=self.metrics.record)
        context = serve.get_replica_context()   # /metrics answers the app's totals over its replicas
        self.totals = ReplicaMetrics(self.metrics, self.engine, context.app_name, context.replica_tag)
        self.kept = KeptResponses(self.cfg.responses_kept, context.app_name)   # for previous_response_id
        self._background: dict[str, asyncio.Task] = {}   # the background responses this replica is making
        self.token_text = TokenText(self.engine.tokenizer)   # token texts and bytes of logprobs, decoded once
        self.count_tokens = token_counter(self.engine.tokenizer)   # a Responses answer's thinking tokens

    def check_health(self):
        """Serve's replica health check: a replica whose engine failed is replaced."""
        if not self.queue.healthy:
            raise RuntimeError(f"the engine failed: {self.queue.dead!r}")

    # ---- plumbing ---------------------------------------------------------------------------------------------
    def _authorized(self, request: Request) -> bool:
        return authorized(request.headers.get("authorization"), self.api_key)

    async def _read(self, request: Request, kind: str) -> ParsedRequest | TokenizeRequest | DetokenizeRequest:
        """Auth, size, JSON, schema, model name and limits (cheap: no tokenisation); raises ApiError."""
        if not self._authorized(request):
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer <key>)", "authentication_error",
                           code="invalid_api_key")
        limit = self.cfg.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"request body is {declared} bytes, over this server's limit of {limit}")
        raw = bytearray()
        try:
            async for chunk in request.stream():
                raw += chunk
                if len(raw) > limit:
                    raise ApiError(413, f"request body is over this server's limit of {limit} bytes")
        except ClientDisconnect:   # gone mid-body: nobody to answer
            raise ApiError(400, "the client disconnected before the request body ended") from None
        # parsed in a worker thread: a body of megabytes takes a second, which must not stall running streams
        if kind in ("tokenize", "detokenize"):
            return await asyncio.to_thread(parse_tokens_body, bytes(raw), kind, self.cfg.model_name,
                                           self.cfg.trust_request_chat_template)
        parse = functools.partial(parse_body, model_name=self.cfg.model_name, max_tokens_cap=self.cfg.max_tokens_cap,
                                  default_max_tokens=self.cfg.default_max_tokens, max_n=self.cfg.max_n,
                                  tool_parser=self.cfg.tool_call_parser, reasoning_parser=self.cfg.reasoning_parser,
                                  trust_template=self.cfg.trust_request_chat_template)
        if kind == "responses":   # read as the chat it amounts to, after the conversation it continues
            data = await asyncio.to_thread(load_object, bytes(raw))
            rid = responses.checked(data, self.kept.limit)
            earlier = await self.kept.conversation(rid) if rid else []
            return await asyncio.to_thread(responses.parse_data, data, functools.partial(parse, kind="chat"), earlier)
        return await asyncio.to_thread(parse, bytes(raw), kind)

    async def _handle(self, request: Request, kind: str):
        try:
            req = await self._read(request, kind)
            # tokenised in a worker thread; a too-long prompt is a 400 before any 200 goes out
            p = await asyncio.to_thread(prepare_request, self.engine, req, kind, self.cfg.model_name,
                                        self.cfg.speculative, self.token_text)
        except ApiError as e:
            return JSONResponse(e.body(), status_code=e.status)
        keep = p.base is not None and self.kept.limit and req.responses.get("store") is not False
        if keep:
            p.base["store"] = True
            if p.base["background"]:
                return await self._start_background(p, identified(req.conversation),
                                                    req.responses.get("previous_response_id"))

        async def kept(response: dict) -> None:   # before the answer goes out: a follow-up may come at once
            await self.kept.put(response, identified(req.conversation) + response["output"],
                                req.responses.get("previous_response_id"))
        if req.stream:
            sse = self._sse(req.body, p.prompts, p.shape, p.rid)
            if p.base is not None:   # a Responses request's events
                sse = responses.ResponseEvents(p.base, self.count_tokens, p.close, p.shown,
                                               kept if keep else None).translate(sse)
            return StreamingResponse(sse, media_type="text/event-stream")
        try:
            body, _ = await run_whole(self.queue, p, self.cfg.model_name)
        except EagleError as e:
            return _engine_error(e)
        except Exception as e:  # noqa: BLE001 - a bug answers 500, with the reason
            return _err(500, f"{type(e).__name__}: {e}", "server_error")
        out = final_body(p, body, self.count_tokens)
        if keep:
            await kept(out)
        return JSONResponse(out)

    async def _start_background(self, p, items: list, parent: str | None):
        """``background: true``: kept ``in_progress`` and answered at once; made on in a task of this replica,
        which says so to the store every ``BEAT_S`` and stops where the response was cancelled or is gone."""
        try:
            await self.kept.start(p.base, items, parent)
        except ApiError as e:
            return JSONResponse(e.body(), status_code=e.status)
        rid = p.base["id"]   # held until it ends (the loop keeps only weak references), failed if this replica stops
        self._background[rid] = asyncio.create_task(self._make_in_background(p, items))
        self._background[rid].add_done_callback(lambda _: self._background.pop(rid, None))
        return JSONResponse(p.base)

    async def _make_in_background(self, p, items: list) -> None:
        rid, stopped = p.base["id"], False
        run = asyncio.create_task(run_whole(self.queue, p, self.cfg.model_name))
        while not run.done():
            await asyncio.wait({run}, timeout=BEAT_S)
            if not run.done() and await self.kept.beat(rid) != "in_progress":
                stopped = run.cancel()   # its sequences are cancelled with it (answer.run_all)
        try:
            out = final_body(p, (await run)[0], self.count_tokens)
        except asyncio.CancelledError:
            if stopped:
                return   # cancelled, deleted or dropped: nothing to keep
            out = p.base | responses.failure("cancelled by its replica")
        except Exception as e:  # noqa: BLE001 - the response fails with the reason, as a whole request's would
            out = p.base | responses.failure(f"{type(e).__name__}: {e}")
        await self.kept.finish(out, items + out["output"])

    async def _sse(self, req, prompts, shape: ChoiceShape, rid: str):
        kind = shape.kind
        options = req.stream_options
        continuous = options is not None and bool(options.continuous_usage_stats)
        include_usage = options is not None and bool(options.include_usage) or continuous
        n = len(prompts[0].seqs)
        items = [(i, s) for i, s in enumerate(s for p in prompts for s in p.seqs)]
        states = [StreamState(split=shape.stream_split(prompts[i // n]),
                              reader=CallReader(shape.tools) if shape.reads_calls else None) for i, _ in items]
        outs: list = [None] * len(items)
        chunk = Chunks(rid, shape, self.cfg.model_name, prompts, include_usage, continuous, [0] * len(items))

        def new_logprobs(index: int, seq, d):
            """The logprobs of the output tokens not yet sent; with stop strings, all on the last chunk (a stop
            string found later cuts tokens whose values would already be out)."""
            st = states[index]
            if shape.k is None:
                return None
            lp, ids = (d.output.logprobs, d.output.token_ids) if d.finished and d.output else (seq.logprobs,
                                                                                              seq.output_ids)
            upto = len(ids) if d.finished else (d.num_tokens if seq.stops is None else st.tokens)
            if upto <= st.tokens or lp is None:
                return None
            part = lp.slice(st.tokens, upto)
            out = shape.output_logprobs(part, ids[st.tokens:upto], st.offset, prompts[index // n].prompt_ids,
                                        ids[:st.tokens])
            if kind != "chat":
                st.offset = out["text_offset"][-1] + len(out["tokens"][-1]) if out["tokens"] else st.offset
            st.tokens = upto
            return out

        try:
            async for index, d in Interleaved(self.queue, items):
                if d is None:
                    continue
                st, seq = states[index], items[index][1]
                chunk.made[index] = len(d.output.token_ids) if d.finished else d.num_tokens
                if shape.echo and not st.echoed:   # a chat's last message, or a completion's prompt, first
                    st.echoed, st.first = True, False
                    if kind == "chat":
                        yield f"data: {json.dumps(chunk(index, shape.prefix, None, True))}\n\n"
                    else:
                        text, lp = shape.echo_part(prompts[index // n])
                        st.offset = len(text)
                        yield f"data: {json.dumps(chunk(index, text, None, logprobs=lp))}\n\n"
                text, calls, thought = d.text, None, None
                reason = finish_reason(d.output.finish_reason) if d.finished else None
                if st.split is not None:   # thinking and answer apart
                    thought, text = st.split.feed(text, final=d.finished)
                if st.reader is not None:   # the answer read for tool calls (engine/tools.py)
                    whole = shape.answer(d.output.text, prompts[index // n])[1] if d.finished else None
                    answering = st.split is None or not st.split.thinking
                    text, calls, reason = st.reader.part(text or "", whole, answering, reason, d.finished)
                thought = thought if shape.include_reasoning else None
                lp = new_logprobs(index, seq, d)
                if text or calls or thought or st.first or lp is not None:
                    yield f"data: {json.dumps(chunk(index, text, None, st.first, lp, calls, thought))}\n\n"
                    st.first = False
                if d.finished:
                    out = outs[index] = d.output
                    last = chunk(index, None if kind == "chat" else "", reason, out=out)
                    last["eagle"] = eagle_stats(out.stats)
                    yield f"data: {json.dumps(last)}\n\n"
            if include_usage:   # OpenAI's shape: a last chunk of its own, no choices, the usage
                used = await asyncio.to_thread(usage, prompts, outs)   # a prediction's count may take a while
                yield f"data: {json.dumps(chunk(0, None, None) | {'choices': [], 'usage': used})}\n\n"
        except EagleError as e:
            yield f"data: {json.dumps(error_body(str(e)))}\n\n"
        except Exception as e:  # noqa: BLE001 - the stream still ends well-formed, with the reason
            yield f"data: {json.dumps(error_body(f'{type(e).__name__}: {e}', 'server_error'))}\n\n"
        yield "data: [DONE]\n\n"

    # ---- routes ------------------------------------------------------------------------------------------------
    @api.get("/health")
    async def health(self):
        """For load balancers: 503 once the engine has failed (Serve then replaces the replica)."""
        if not self.queue.healthy:
            return _err(503, f"the engine failed: {self.queue.dead!r}", "server_error", code="engine_failed")
        return {"status": "ok", "running": len(self.engine.scheduler.running),
                "waiting": len(self.engine.scheduler.waiting), "free_slots": len(self.engine.scheduler.free)}

    @api.get("/ping")
    @api.post("/ping")
    async def ping(self):
        """SageMaker's health route, as vLLM answers it: /health's answer."""
        return await self.health()

    @api.get("/version")
    async def version(self):
        from eagle_ray import __version__
        return {"version": __version__}

    @api.get("/metrics")
    async def prometheus(self):
        """Prometheus text, vLLM's metric names (serve/metrics.py), the app's totals over its replicas; like
        /health, no API key: counts only."""
        return Response(await self.totals.render(), media_type=METRICS_CONTENT_TYPE)

    @api.get("/stats")
    async def stats(self):
        """Engine counters: mean verify batch = decode_sequences / decode_passes."""
        c = dict(self.engine.counters)
        c["mean_verify_batch"] = c["decode_sequences"] / c["decode_passes"] if c["decode_passes"] else 0.0
        c["free_slots"] = len(self.engine.scheduler.free)
        c["pending"] = self.queue.num_pending
        c["tree"] = self.engine.policy.summary()
        c["adaptation"] = self.engine.adapter.summary() if self.engine.adapter is not None else None
        return c

    @api.get("/v1/models")
    async def models(self, request: Request):
        if not self._authorized(request):
            return _unauthorized()
        return {"object": "list", "data": [self._model_card()]}

    @api.get("/v1/models/{model:path}")
    async def model(self, model: str, request: Request):
        if not self._authorized(request):
            return _unauthorized()
        if model != self.cfg.model_name:
            return _err(404, f"model {model!r} does not exist; this server serves {self.cfg.model_name!r}",
                        param="model", code="model_not_found")
        return self._model_card()

    def _model_card(self) -> dict:
        return {"id": self.cfg.model_name, "object": "model", "created": now(), "owned_by": "eagle-ray",
                "max_model_len": self.engine.target.max_len}

    @api.post("/tokenize")
    async def tokenize(self, request: Request):
        """vLLM's: a prompt's token ids as a completion or chat request would run them (serve/tokens.py)."""
        return await self._tokens(request, "tokenize")

    @api.post("/detokenize")
    async def detokenize(self, request: Request):
        return await self._tokens(request, "detokenize")

    async def _tokens(self, request: Request, kind: str):
        try:
            req = await self._read(request, kind)
            return await asyncio.to_thread(token_answer, self.engine, req)
        except ApiError as e:
            return JSONResponse(e.body(), status_code=e.status)
        except EagleError as e:
            return _engine_error(e)

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._handle(request, "completion")

    @api.post("/v1/chat/completions")
    async def chat(self, request: Request):
        return await self._handle(request, "chat")

    @api.post("/v1/responses")
    async def create_response(self, request: Request):
        """OpenAI's Responses API, answered by the chat path (serve/responses.py)."""
        return await self._handle(request, "responses")

    @api.get("/v1/responses/{response_id}")
    async def retrieve_response(self, response_id: str, request: Request):
        """A kept response (``responses_kept``), as it was answered."""
        return await self._kept_response(request, response_id, "response")

    @api.delete("/v1/responses/{response_id}")
    async def delete_response(self, response_id: str, request: Request):
        return await self._kept_response(request, response_id, "delete")

    @api.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(self, response_id: str, request: Request):
        """A background response in progress stops (its replica reads it within ``BEAT_S``); OpenAI's answer."""
        return await self._kept_response(request, response_id, "cancel")

    @api.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(self, response_id: str, request: Request):
        """The items a kept response was made from (its conversation's, then its own input), a page at a time."""
        return await self._kept_response(request, response_id, "input_items")

    async def _kept_response(self, request: Request, rid: str, action: str):
        if not self._authorized(request):
            return _unauthorized()
        try:
            found = await getattr(self.kept, action)(rid)   # response, input_items, cancel or delete
            if found is None or found is False:
                why = "" if self.kept.limit else " (this server keeps no responses: responses_kept is 0)"
                if self.kept.limit and action == "input_items":
                    why = " (it, or an earlier response of its conversation, is no longer kept)"
                return _err(404, f"Response with id {rid!r} not found{why}")
            if action == "input_items":
                return item_page(found, request.query_params)
            if action == "cancel" and not found.get("background"):
                return _err(400, f"Response {rid!r} was not made with background: true; only those can be cancelled")
        except ApiError as e:   # the store did not answer, or a bad page
            return JSONResponse(e.body(), status_code=e.status)
        return {"id": rid, "object": "response", "deleted": True} if action == "delete" else found

    def __del__(self):
        if getattr(self, "_background", None):
            self.kept.abandon(list(self._background), "its replica shut down before it ended")
        totals = getattr(self, "totals", None)
        if totals is not None:
            totals.close()
        queue = getattr(self, "queue", None)
        if queue is not None:
            queue.shutdown(drain=True, timeout=30)


def build_app(args: dict):
    """``serve run eagle_ray.serve.app:build_app config=configs/serve.yaml`` (or ``args`` in a Serve config)."""
    if "config" in args:
        path = Path(args["config"])
        if not path.is_absolute() and not path.exists():  # Serve may build the app outside the repository root
            path = Path(__file__).resolve().parents[2] / path
        cfg = ServeConfig.from_yaml(path)
    else:
        cfg = ServeConfig(**args)
    return EagleServer.options(
        num_replicas=cfg.num_replicas,
        ray_actor_options={"num_cpus": cfg.num_cpus, "num_gpus": cfg.num_gpus},
    ).bind(cfg.model_dump_json())


def run(cfg: ServeConfig, blocking: bool = True):
    """Start Serve on ``cfg.host:cfg.port`` (a local Ray on 127.0.0.1 unless RAY_ADDRESS is set). Blocking, Ctrl-C
    stops it at any point, while the model loads too, and shuts Serve down (the replica drains what is in flight)."""
    from eagle_ray.cluster import ensure_ray
    api_key_from_env(cfg)  # a local replica inherits this environment: fail now, not after the model loads
    try:
        ensure_ray()
        serve.start(http_options={"host": cfg.host, "port": cfg.port})
        serve.run(build_app(json.loads(cfg.model_dump_json())), name="eagle-ray", route_prefix=cfg.route_prefix,
                  blocking=False)
        if not blocking:
            return
        print(f"eagle-ray serving {cfg.model_name} at http://{cfg.host}:{cfg.port}{cfg.route_prefix.rstrip('/')}/v1",
              flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("eagle-ray: interrupted, shutting Serve down", flush=True)
        if ray.is_initialized():
            serve.shutdown()
