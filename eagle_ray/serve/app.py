"""Ray Serve app: an OpenAI-compatible HTTP API over one continuously batched EAGLE-2 engine per replica.

Every request goes into the replica's :class:`RequestQueue`, so concurrent requests share verify passes. A client
that disconnects mid-stream has its request cancelled (its slot is free before the next step); shutdown drains
what is in flight.
"""

import hmac
import json
import os
import time
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from ray import serve

from eagle_ray.config import SamplingParams, ServeConfig
from eagle_ray.errors import EagleError, PromptTooLongError
from eagle_ray.serve.openai_api import (ChatRequest, CompletionRequest, eagle_stats, error_body, finish_reason,
                                        new_id, now)

api = FastAPI(title="eagle-ray", docs_url=None, redoc_url=None)


def _err(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
         code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status)


def _unauthorized() -> JSONResponse:
    return _err(401, "missing or wrong API key (Authorization: Bearer <key>)", "authentication_error",
                code="invalid_api_key")


def _usage(out) -> dict:
    return {"prompt_tokens": len(out.prompt_token_ids), "completion_tokens": len(out.token_ids),
            "total_tokens": len(out.prompt_token_ids) + len(out.token_ids)}


def _validation_message(e: ValidationError) -> tuple[str, str | None]:
    first = e.errors()[0]
    param = ".".join(str(p) for p in first["loc"]) or None
    msgs = "; ".join(f"{'.'.join(str(p) for p in x['loc'])}: {x['msg']}" for x in e.errors())
    return msgs, param


class _Metrics:
    """Ray metrics (exported by Ray's metrics agent; Prometheus on a cluster)."""

    def __init__(self):
        from ray.util import metrics
        self.requests = metrics.Counter("eagle_ray_requests", description="requests received")
        self.tokens = metrics.Counter("eagle_ray_generated_tokens", description="tokens generated")
        self.tau = metrics.Histogram("eagle_ray_tau", description="mean accepted length per request",
                                     boundaries=[1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0])

    def record(self, out) -> None:
        self.tokens.inc(len(out.token_ids))
        if out.stats.verify_steps:
            self.tau.observe(out.stats.tau)


@serve.deployment(max_ongoing_requests=256, graceful_shutdown_timeout_s=60)
@serve.ingress(api)
class EagleServer:
    def __init__(self, config_json: str):
        from eagle_ray.engine.engine import EagleEngine
        from eagle_ray.engine.queue import RequestQueue

        self.cfg = ServeConfig(**json.loads(config_json))
        engine_cfg = self.cfg.engine.for_ray_worker(self.cfg.num_cpus, self.cfg.num_gpus)
        self.engine = EagleEngine.from_config(engine_cfg, self.cfg.s3.storage_options())
        self.queue = RequestQueue(self.engine)
        self.api_key = None
        if self.cfg.api_key_env:  # fail closed: a missing secret must not silently turn auth off
            self.api_key = os.environ.get(self.cfg.api_key_env)
            if not self.api_key:
                raise RuntimeError(f"api_key_env={self.cfg.api_key_env!r} is set but that environment variable is "
                                   "empty or missing on this replica")
        self.metrics = _Metrics()

    # ---- plumbing ---------------------------------------------------------------------------------------------
    def _authorized(self, request: Request) -> bool:
        if self.api_key is None:
            return True
        return hmac.compare_digest(request.headers.get("authorization", "").encode(),
                                   f"Bearer {self.api_key}".encode())

    def _check(self, request: Request, body_model, raw: bytes):
        """Auth, JSON, schema, model name and limits; returns (parsed request, None) or (None, error response)."""
        if not self._authorized(request):
            return None, _unauthorized()
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return None, _err(400, f"request body is not valid JSON: {e}")
        if not isinstance(data, dict):
            return None, _err(400, "request body must be a JSON object")
        try:
            req = body_model(**data)
        except ValidationError as e:
            msg, param = _validation_message(e)
            return None, _err(400, msg, param=param)
        if req.model != self.cfg.model_name:
            return None, _err(404, f"model {req.model!r} does not exist; this server serves {self.cfg.model_name!r}",
                              param="model", code="model_not_found")
        limit = req.max_tokens or getattr(req, "max_completion_tokens", None)
        if limit is not None and limit > self.cfg.max_tokens_cap:
            return None, _err(400, f"max_tokens={limit} is above this server's cap of {self.cfg.max_tokens_cap}",
                              param="max_tokens")
        return req, None

    async def _run(self, req, prompt, kind: str):
        params = req.sampling(self.cfg.default_max_tokens)
        rid = new_id("chatcmpl" if kind == "chat" else "cmpl")
        self.metrics.requests.inc()
        if req.stream:
            # validate before the 200 goes out: a too-long prompt must still be a 400
            try:
                self._precheck(prompt)
            except EagleError as e:
                return _err(400, str(e), code="context_length_exceeded" if isinstance(e, PromptTooLongError) else None)
            return StreamingResponse(self._sse(req, prompt, params, rid, kind), media_type="text/event-stream")
        try:
            out = await self.queue.agenerate(prompt, params, request_id=rid, speculative=self.cfg.speculative)
        except EagleError as e:
            return _err(400, str(e), code="context_length_exceeded" if isinstance(e, PromptTooLongError) else None)
        except Exception as e:  # noqa: BLE001 - an engine failure: OpenAI-shaped 500, the server stays up
            return _err(500, f"{type(e).__name__}: {e}", "server_error")
        self.metrics.record(out)
        if kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": out.text},
                      "finish_reason": finish_reason(out.finish_reason), "logprobs": None}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": out.text, "finish_reason": finish_reason(out.finish_reason),
                      "logprobs": None}
            obj = "text_completion"
        return JSONResponse({"id": rid, "object": obj, "created": now(), "model": self.cfg.model_name,
                             "choices": [choice], "usage": _usage(out), "eagle": eagle_stats(out.stats)})

    def _precheck(self, prompt) -> None:
        """Tokenize and size-check without queueing (the engine thread re-does it; cheap next to generation)."""
        self.engine.make_sequence(prompt, SamplingParams())  # raises typed errors (tokenizer failures included)

    async def _sse(self, req, prompt, params, rid: str, kind: str):
        created = now()
        include_usage = bool((req.stream_options or {}).get("include_usage"))
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

        def chunk(text: str | None, reason: str | None, first: bool = False) -> dict:
            if kind == "chat":
                delta = {} if text is None else {"content": text}
                if first:
                    delta["role"] = "assistant"
                c = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
            else:
                c = {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": None}
            return {"id": rid, "object": obj, "created": created, "model": self.cfg.model_name, "choices": [c]}

        first = True
        try:
            async for d in self.queue.astream(prompt, params, request_id=rid, speculative=self.cfg.speculative):
                if d.text or first:
                    yield f"data: {json.dumps(chunk(d.text, None, first))}\n\n"
                    first = False
                if d.finished:
                    out = d.output
                    self.metrics.record(out)
                    last = chunk(None if kind == "chat" else "", finish_reason(out.finish_reason))
                    last["eagle"] = eagle_stats(out.stats)
                    if include_usage:
                        last["usage"] = _usage(out)
                    yield f"data: {json.dumps(last)}\n\n"
        except EagleError as e:
            yield f"data: {json.dumps(error_body(str(e)))}\n\n"
        except Exception as e:  # noqa: BLE001 - the stream still ends well-formed, with the reason
            yield f"data: {json.dumps(error_body(f'{type(e).__name__}: {e}', 'server_error'))}\n\n"
        yield "data: [DONE]\n\n"

    # ---- routes ------------------------------------------------------------------------------------------------
    @api.get("/health")
    async def health(self):
        return {"status": "ok", "running": len(self.engine.scheduler.running),
                "waiting": len(self.engine.scheduler.waiting), "free_slots": len(self.engine.scheduler.free)}

    @api.get("/stats")
    async def stats(self):
        """Engine counters: mean verify batch = decode_sequences / decode_passes."""
        c = dict(self.engine.counters)
        c["mean_verify_batch"] = c["decode_sequences"] / c["decode_passes"] if c["decode_passes"] else 0.0
        c["free_slots"] = len(self.engine.scheduler.free)
        c["pending"] = self.queue.num_pending
        c["tree"] = self.engine.tree_summary()
        return c

    @api.get("/v1/models")
    async def models(self, request: Request):
        if not self._authorized(request):
            return _unauthorized()
        return {"object": "list", "data": [{"id": self.cfg.model_name, "object": "model", "created": now(),
                                            "owned_by": "eagle-ray"}]}

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        req, err = self._check(request, CompletionRequest, await request.body())
        return err or await self._run(req, req.prompt, "completion")

    @api.post("/v1/chat/completions")
    async def chat(self, request: Request):
        req, err = self._check(request, ChatRequest, await request.body())
        if err:
            return err
        try:
            messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        except ValueError as e:
            return _err(400, str(e), param="messages")
        return await self._run(req, messages, "chat")

    def __del__(self):
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
    """Start Serve on ``cfg.host:cfg.port`` (a local Ray on 127.0.0.1 unless RAY_ADDRESS is set)."""
    from eagle_ray.data.job import ensure_ray
    ensure_ray()
    serve.start(http_options={"host": cfg.host, "port": cfg.port})
    serve.run(build_app(json.loads(cfg.model_dump_json())), name="eagle-ray", route_prefix=cfg.route_prefix,
              blocking=False)
    if blocking:
        print(f"eagle-ray serving {cfg.model_name} at http://{cfg.host}:{cfg.port}{cfg.route_prefix.rstrip('/')}/v1",
              flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            serve.shutdown()
