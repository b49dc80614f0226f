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

A request the client cancelled (a dropped stream, a closed connection) counts as it ends, with
``finished_reason="abort"`` and the tokens it had made.

With several replicas a scrape reaches one of them, but reads the app's totals: each replica sends its samples to
the app's :class:`MetricsHub` (a small Ray actor) every ``PUSH_EVERY_S`` seconds and when scraped, and answers with
the sum over every replica the app has had (a replica that ended keeps its last counts, so a counter never goes
down). Gauges sum the replicas heard from within ``GAUGE_FRESH_S`` (``speculating`` is their mean: the share of
replicas drafting at that batch size).
"""
from __future__ import annotations

import itertools
import logging
import threading
import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import Metric

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 1.0, 2.5)
TAU_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST
PUSH_EVERY_S = 5.0
HUB_WAIT_S = 10.0   # a scrape waits this long for the hub's totals, then answers with this replica's counts
GAUGE_FRESH_S = 30.0
MEAN_GAUGES = ("eagle_ray:speculating",)
log = logging.getLogger(__name__)


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

    def read_gauges(self, engine) -> None:
        m = self.model
        self.running.labels(m).set(len(engine.scheduler.running))
        self.waiting.labels(m).set(len(engine.scheduler.waiting))
        trees = engine.policy.summary().get("trees_by_batch")
        if trees:
            for batch, tree in trees.items():
                self.speculating.labels(m, batch).set(0 if tree == "plain" else 1)

    def render(self, engine) -> bytes:
        """This replica's text exposition, with the gauges read from ``engine`` now."""
        self.read_gauges(engine)
        return generate_latest(self.registry)

    def snapshot(self, engine=None) -> tuple[int, list]:
        """(sequence number, families): this replica's samples as plain values a hub can sum, numbered so that a
        late-arriving older snapshot never replaces a newer one."""
        if engine is not None:
            self.read_gauges(engine)
        with _SEQ_LOCK:
            seq = next(_SEQ)
            families = [(f.name, f.type, f.documentation,
                         [(x.name, tuple(sorted(x.labels.items())), x.value) for x in f.samples
                          if not x.name.endswith("_created")])   # creation times do not add up
                        for f in self.registry.collect()]
        return seq, families


_SEQ, _SEQ_LOCK = itertools.count(1), threading.Lock()


class MetricsHub:
    """The app's metrics over all its replicas (a Ray actor, one per Serve app): each replica's latest snapshot,
    summed when any replica is scraped."""

    def __init__(self):
        self.replicas: dict[str, tuple[int, float, list]] = {}   # replica -> (sequence, when, families)

    def push(self, replica: str, snapshot: tuple[int, list]) -> None:
        seq, families = snapshot
        if replica not in self.replicas or self.replicas[replica][0] < seq:
            self.replicas[replica] = (seq, time.time(), families)

    def total(self, replica: str, snapshot: tuple[int, list]) -> list:
        self.push(replica, snapshot)
        return merge([(when, families) for _, when, families in self.replicas.values()])


def merge(snapshots: list[tuple[float, list]], now: float | None = None) -> list:
    """Families summed over replicas' snapshots: counters and histograms over all of them, gauges over those newer
    than ``GAUGE_FRESH_S`` (averaged for :data:`MEAN_GAUGES`)."""
    now = time.time() if now is None else now
    out: dict[str, list] = {}   # name -> [type, doc, {(sample, labels): [sum, n]}]
    for when, families in snapshots:
        for name, typ, doc, samples in families:
            if typ == "gauge" and now - when > GAUGE_FRESH_S:
                continue
            fam = out.setdefault(name, [typ, doc, {}])
            for sample, labels, value in samples:
                acc = fam[2].setdefault((sample, labels), [0.0, 0])
                acc[0] += value
                acc[1] += 1
    return [(name, typ, doc, [(sample, labels, total / n if name in MEAN_GAUGES else total)
                              for (sample, labels), (total, n) in values.items()])
            for name, (typ, doc, values) in out.items()]


def render_families(families: list) -> bytes:
    """Families (as :meth:`ServeMetrics.snapshot` and :func:`merge` give them) in the text exposition format."""
    class Families:
        def collect(self):
            for name, typ, doc, samples in families:
                metric = Metric(name, doc, typ)
                for sample, labels, value in samples:
                    metric.add_sample(sample, dict(labels), value)
                yield metric
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Families())
    return generate_latest(registry)


class ReplicaMetrics:
    """A Serve replica's side of the app's totals: pushes its snapshot to the hub every ``PUSH_EVERY_S`` (a
    thread), and renders the hub's totals when scraped; outside Ray, or while the hub cannot be reached, it renders
    its own counts."""

    def __init__(self, metrics: ServeMetrics, engine, app: str, replica: str):
        self.metrics, self.engine, self.replica = metrics, engine, replica
        self.name = f"eagle-ray-metrics:{app}"
        self._hub = None
        self._stop = threading.Event()
        try:
            self.hub()   # made (or found) now: a first scrape should not wait for a new actor's process
        except Exception:  # noqa: BLE001 - outside Ray: this replica's counts only
            log.warning("no metrics hub; /metrics shows this replica's counts only", exc_info=True)
        threading.Thread(target=self._push_loop, name="eagle-ray-metrics-push", daemon=True).start()

    def hub(self):
        if self._hub is None:
            import ray
            self._hub = ray.remote(MetricsHub).options(name=self.name, namespace="eagle_ray", get_if_exists=True,
                                                       lifetime="detached", num_cpus=0).remote()
        return self._hub

    def _push_loop(self) -> None:
        import ray
        while not self._stop.wait(PUSH_EVERY_S):
            try:
                ray.get(self.hub().push.remote(self.replica, self.metrics.snapshot(self.engine)), timeout=30)
            except Exception:  # noqa: BLE001 - the hub went away: made again on the next push
                self._hub = None

    async def render(self) -> bytes:
        """The app's totals (this replica's counts where the hub cannot answer)."""
        import asyncio
        snapshot = self.metrics.snapshot(self.engine)
        try:
            families = await asyncio.wait_for(asyncio.wrap_future(self.hub().total.remote(self.replica, snapshot)
                                                                  .future()), HUB_WAIT_S)
        except Exception:  # noqa: BLE001 - scraping must answer: this replica's own counts, said in the log
            log.warning("the metrics hub %s did not answer; /metrics shows this replica's counts only", self.name,
                        exc_info=True)
            self._hub = None
            families = snapshot[1]
        return render_families(families)

    def close(self) -> None:
        self._stop.set()
