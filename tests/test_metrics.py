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
