"""Serve's ``/metrics``: the Prometheus text format, under vLLM's metric names where vLLM has one, so dashboards and
alerts written for vLLM read eagle-ray unchanged; eagle-ray's own names (``eagle_ray:``) for what vLLM lacks.

Each finished request adds its own statistics (the same numbers its response carries in ``usage`` and ``eagle``):

| metric | what |
| --- | --- |
| ``vllm:num_requests_running`` / ``vllm:num_requests_waiting`` | sequences in a KV slot / queued, at scrape time |
| ``vllm:prompt_tokens_total`` / ``vllm:generation_tokens_total`` | tokens in and out |
| ``vllm:request_success_total{finished_reason}`` | finished requests, by ``stop`` / ``length`` / ``abort`` |
| ``vllm:time_to_first_token_seconds`` | histogram |
| ``vllm:inter_token_latency_seconds`` | histogram; a request adds its mean gap once per gap |
| ``vllm:e2e_request_latency_seconds`` | histogram |
| ``vllm:spec_decode_num_drafts_total`` | verify steps that checked a draft tree |
| ``vllm:spec_decode_num_draft_tokens_total`` | draft tokens verified (tree nodes, roots not counted) |
| ``vllm:spec_decode_num_accepted_tokens_total`` | draft tokens accepted |
| ``vllm:spec_decode_num_accepted_tokens_per_pos_total{position}`` | accepted drafts at tree depth ``position + 1`` |
| ``eagle_ray:tau`` | histogram of each request's tokens per verify step (bonus token counted) |
| ``eagle_ray:speculating{batch_size}`` | 1 where steps of that batch size draft trees now, 0 where they run plain |
"""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 1.0, 2.5)
TAU_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServeMetrics:
    """One replica's metrics, in a registry of its own (a process may hold several replicas in tests)."""

    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        self.model = model_name
        m = ["model_name"]
        self.running = Gauge("vllm:num_requests_running", "Requests in a KV slot", m, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting for a slot", m, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens", m, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens", m, registry=r)
        self.success = Counter("vllm:request_success", "Finished requests", m + ["finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", m, registry=r,
                              buckets=LATENCY_BUCKETS)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between output tokens", m, registry=r,
                             buckets=GAP_BUCKETS)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency", m, registry=r,
                             buckets=LATENCY_BUCKETS)
        self.drafts = Counter("vllm:spec_decode_num_drafts", "Verify steps with a draft tree", m, registry=r)
        self.draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified", m, registry=r)
        self.accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted", m, registry=r)
        self.accepted_at = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                   "Draft tokens accepted at each tree depth", m + ["position"], registry=r)
        self.tau = Histogram("eagle_ray:tau", "Tokens per verify step of each request", m, registry=r,
                             buckets=TAU_BUCKETS)
        self.speculating = Gauge("eagle_ray:speculating", "1 where steps of this batch size draft trees, 0 plain",
                                 m + ["batch_size"], registry=r)

    def record(self, out) -> None:
        """A finished request (``engine.RequestOutput``)."""
        s, m = out.stats, self.model
        self.prompt_tokens.labels(m).inc(len(out.prompt_token_ids))
        self.generation_tokens.labels(m).inc(len(out.token_ids))
        self.success.labels(m, out.finish_reason).inc()
        self.e2e.labels(m).observe(s.total_s)
        if s.ttft_s:
            self.ttft.labels(m).observe(s.ttft_s)
        gaps = len(out.token_ids) - 1
        if gaps > 0 and s.total_s > s.ttft_s:
            mean_gap = (s.total_s - s.ttft_s) / gaps
            for _ in range(gaps):
                self.itl.labels(m).observe(mean_gap)
        if s.verify_steps and s.tree_tokens > s.verify_steps:   # it speculated
            self.drafts.labels(m).inc(s.verify_steps)
            self.draft_tokens.labels(m).inc(s.tree_tokens - s.verify_steps)
            self.accepted.labels(m).inc(sum(k * n for k, n in enumerate(s.accept_hist)))
            for pos, n in enumerate(s.accepted_per_depth):
                self.accepted_at.labels(m, str(pos)).inc(n)
            self.tau.labels(m).observe(s.tau)

    def render(self, engine) -> bytes:
        """The text exposition, with the gauges read from ``engine`` now."""
        m = self.model
        self.running.labels(m).set(len(engine.scheduler.running))
        self.waiting.labels(m).set(len(engine.scheduler.waiting))
        trees = engine.policy.summary().get("trees_by_batch")
        if trees:
            for batch, tree in trees.items():
                self.speculating.labels(m, batch).set(0 if tree == "plain" else 1)
        return generate_latest(self.registry)
