"""Serve's /metrics (serve/metrics.py): Prometheus text that ``prometheus_client``'s own parser reads, whose counters
are the sums of what the responses themselves report (``usage`` and the ``eagle`` stats)."""
from prometheus_client.parser import text_string_to_metric_families
from test_engine import mixed_prompts
from tiny import tiny_engine

from eagle_ray.config import SamplingParams, TreeConfig
from eagle_ray.serve.metrics import ServeMetrics


def samples(text: bytes) -> dict:
    """{(sample name, sorted labels without model_name): value}."""
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def test_counters_are_the_sums_of_the_requests_own_stats(tiny_dir, tiny_head):
    engine = tiny_engine(tiny_dir, tiny_head, TreeConfig(total_tokens=8, depth=3, top_k=3), max_batch_size=3)
    metrics = ServeMetrics("tiny")
    outs = engine.generate(mixed_prompts(5, seed=4), SamplingParams(max_new_tokens=20, ignore_eos=True))
    outs += engine.generate(mixed_prompts(2, seed=5), SamplingParams(max_new_tokens=6), speculative=False)
    for out in outs:
        metrics.record(out)
    got = samples(metrics.render(engine))
    spec = [o for o in outs if o.stats.tree_tokens > o.stats.verify_steps]
    assert got[("vllm:prompt_tokens_total", ())] == sum(len(o.prompt_token_ids) for o in outs)
    assert got[("vllm:generation_tokens_total", ())] == sum(len(o.token_ids) for o in outs)
    assert got[("vllm:spec_decode_num_drafts_total", ())] == sum(o.stats.verify_steps for o in spec)
    assert got[("vllm:spec_decode_num_accepted_tokens_total", ())] == \
        sum(sum(o.stats.accepted_per_depth) for o in spec) > 0
    assert got[("vllm:spec_decode_num_draft_tokens_total", ())] == \
        sum(o.stats.tree_tokens - o.stats.verify_steps for o in spec)
    per_pos = {dict(k[1])["position"]: v for k, v in got.items()
               if k[0] == "vllm:spec_decode_num_accepted_tokens_per_pos_total"}
    assert sum(per_pos.values()) == got[("vllm:spec_decode_num_accepted_tokens_total", ())]
    assert got[("vllm:request_success_total", (("finished_reason", "length"),))] == len(outs)
    assert got[("vllm:e2e_request_latency_seconds_count", ())] == len(outs)
    assert got[("eagle_ray:tau_count", ())] == len(spec) == 5
    assert got[("vllm:num_requests_running", ())] == 0 and got[("vllm:num_requests_waiting", ())] == 0


def test_a_cancelled_request_counts_as_abort_with_the_tokens_it_made(tiny_dir, tiny_head):
    """A client that goes away mid-stream: its request ends with ``finished_reason="abort"`` in the counters, and
    the tokens it had made count (they used to be missing: nothing moved)."""
    from eagle_ray.engine.queue import RequestQueue
    engine = tiny_engine(tiny_dir, tiny_head, TreeConfig(total_tokens=8, depth=3, top_k=3), max_batch_size=3)
    import threading
    metrics = ServeMetrics("tiny")
    queue = RequestQueue(engine, on_finish=metrics.record)
    cancel, step, cancelled = queue.cancel, engine.step, threading.Event()

    def cancel_seen(rid):
        cancelled.set()
        return cancel(rid)

    def held_step():   # past 5 tokens, the engine waits for the consumer's cancel, however slow that thread is
        if any(len(s.output_ids) >= 5 for s in engine.scheduler.running):
            cancelled.wait(30)
        return step()
    queue.cancel, engine.step = cancel_seen, held_step
    try:
        made = 0
        for delta in queue.stream([5, 6, 7], SamplingParams(max_new_tokens=100, ignore_eos=True)):
            made = delta.num_tokens
            if made >= 5:
                break   # the stream's consumer leaves: the request is cancelled
        done = queue.generate([5, 6, 8], SamplingParams(max_new_tokens=4, ignore_eos=True))
    finally:
        queue.shutdown()
    got = samples(metrics.render(engine))
    assert got[("vllm:request_success_total", (("finished_reason", "abort"),))] == 1
    assert got[("vllm:request_success_total", (("finished_reason", "length"),))] == 1
    assert made <= got[("vllm:generation_tokens_total", ())] - len(done.token_ids) < 100
    assert got[("vllm:e2e_request_latency_seconds_count", ())] == 2


def test_a_scrape_of_any_replica_reads_the_apps_totals_and_counters_never_go_down():
    """Two replicas behind one route: each scrape reached one of them and read its own counts, so counters went
    up and down. The hub sums every replica's latest snapshot; an older snapshot arriving late is ignored; a
    replica that went quiet keeps its counts but leaves the gauges."""
    import time

    from eagle_ray.engine.engine import RequestOutput
    from eagle_ray.serve.metrics import GAUGE_FRESH_S, MetricsHub, merge, render_families
    from eagle_ray.stats import RequestStats

    def out(n):
        return RequestOutput("r", [1, 2, 3], list(range(n)), "", "stop", RequestStats(total_s=0.1))

    a, b = ServeMetrics("tiny"), ServeMetrics("tiny")
    hub = MetricsHub()
    a.record(out(4))
    old_a = a.snapshot()
    a.record(out(6))
    a.running.labels("tiny").set(2)
    b.record(out(10))
    b.running.labels("tiny").set(1)
    hub.push("b", b.snapshot())
    first = samples(render_families(hub.total("a", a.snapshot())))
    assert first[("vllm:generation_tokens_total", ())] == 20
    assert first[("vllm:request_success_total", (("finished_reason", "stop"),))] == 3
    assert first[("vllm:e2e_request_latency_seconds_count", ())] == 3
    assert first[("vllm:num_requests_running", ())] == 3
    hub.push("a", old_a)   # late: ignored
    assert samples(render_families(hub.total("b", b.snapshot())))[("vllm:generation_tokens_total", ())] == 20
    quiet = merge([(time.time() - GAUGE_FRESH_S - 1, a.snapshot()[1]), (time.time(), b.snapshot()[1])])
    got = samples(render_families(quiet))
    assert got[("vllm:generation_tokens_total", ())] == 20 and got[("vllm:num_requests_running", ())] == 1
