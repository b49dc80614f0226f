"""The request queue: many callers, one continuously batched engine. Results equal ``generate()``'s, requests
submitted at different times share decode passes, cancelling frees the slot, bad requests fail alone, and
memory stays flat over 1,000 sequential requests."""
import asyncio
import gc
import threading

import pytest
from test_engine import mixed_prompts
from tiny import tiny_engine

from eagle_ray.config import SamplingParams
from eagle_ray.engine.queue import RequestQueue
from eagle_ray.errors import InvalidRequestError, PromptTooLongError

GREEDY = SamplingParams(max_new_tokens=30, ignore_eos=True)


@pytest.fixture()
def engine(tiny_dir, tiny_head):
    return tiny_engine(tiny_dir, tiny_head, max_batch_size=4)


def test_concurrent_submissions_equal_generate_and_share_passes(engine):
    prompts = mixed_prompts(10)
    expected = [o.token_ids for o in engine.generate(prompts, GREEDY)]
    engine.counters.update(decode_passes=0, decode_sequences=0)
    q = RequestQueue(engine)
    futures = [q.submit(p, GREEDY) for p in prompts]
    got = [f.result(timeout=60).token_ids for f in futures]
    q.shutdown()
    assert got == expected
    assert engine.counters["decode_sequences"] / engine.counters["decode_passes"] > 1.5


def test_stream_deltas_concatenate_to_the_final_text(engine):
    q = RequestQueue(engine)
    deltas = list(q.stream(mixed_prompts(1)[0], GREEDY))
    q.shutdown()
    assert deltas[-1].finished and deltas[-1].output is not None
    assert "".join(d.text for d in deltas) == deltas[-1].output.text
    assert len(deltas) > 2  # it streams, not one lump


def test_stop_strings_never_leak_into_a_stream(engine):
    prompt = mixed_prompts(1)[0]
    full = engine.generate([prompt], GREEDY)[0].text
    words = full.split()
    stop = " ".join(words[3:5])  # a stop string that spans tokens, in the middle of the output
    q = RequestQueue(engine)
    deltas = list(q.stream(prompt, SamplingParams(max_new_tokens=30, ignore_eos=True, stop=[stop])))
    q.shutdown()
    streamed = "".join(d.text for d in deltas)
    assert streamed == full[: full.index(stop)] and deltas[-1].output.finish_reason == "stop"


async def wait_until(condition, timeout: float = 30.0) -> None:
    """Wait for the engine thread to reach a state (polling a condition, not guessing a delay)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


def test_async_stream_and_cancel_frees_the_slot(engine):
    q = RequestQueue(engine)

    async def main():
        agen = q.astream(mixed_prompts(1)[0], SamplingParams(max_new_tokens=200, ignore_eos=True), request_id="x")
        async for d in agen:
            if d.num_tokens >= 5:
                break
        await agen.aclose()  # what Serve does when the client disconnects
        await wait_until(lambda: q.num_pending == 0)
        return await q.agenerate(mixed_prompts(2)[1], GREEDY)

    out = asyncio.run(main())
    q.shutdown()
    assert len(out.token_ids) == 30
    assert engine.scheduler.free == [0, 1, 2, 3] and not engine.scheduler.running and q.num_pending == 0


def test_bad_requests_fail_alone(engine):
    q = RequestQueue(engine)
    good = q.submit(mixed_prompts(1)[0], GREEDY)
    too_long = q.submit(list(range(3, 60)) * 10, GREEDY)
    empty = q.submit("", GREEDY)
    dup_a = q.submit(mixed_prompts(1)[0], SamplingParams(max_new_tokens=50, ignore_eos=True), request_id="same")
    dup_b = q.submit(mixed_prompts(1)[0], GREEDY, request_id="same")
    with pytest.raises(PromptTooLongError):
        too_long.result(timeout=60)
    with pytest.raises(InvalidRequestError, match="empty"):
        empty.result(timeout=60)
    with pytest.raises(InvalidRequestError, match="already running"):
        dup_b.result(timeout=60)
    assert len(good.result(timeout=60).token_ids) == 30 and len(dup_a.result(timeout=60).token_ids) == 50
    q.shutdown()


def test_shutdown_drains_in_flight_requests(engine):
    q = RequestQueue(engine)
    futures = [q.submit(p, GREEDY) for p in mixed_prompts(6)]
    q.shutdown(drain=True)
    assert all(len(f.result(timeout=1).token_ids) == 30 for f in futures)
    with pytest.raises(InvalidRequestError):
        q.submit("a b", GREEDY)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.slow
def test_memory_is_flat_over_1000_sequential_requests(engine):
    q = RequestQueue(engine)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    prompts = mixed_prompts(50)
    lock = threading.Lock()

    def run(n):
        for i in range(n):
            with lock:
                q.generate(prompts[i % len(prompts)], params)

    run(200)  # warm-up: allocator pools and caches reach their steady size
    gc.collect()
    before = rss_bytes()
    run(1000)
    gc.collect()
    growth = rss_bytes() - before
    q.shutdown()
    assert growth < 8 * 2**20, f"RSS grew {growth / 2**20:.1f} MiB over 1,000 requests"
    assert engine.scheduler.free == [0, 1, 2, 3]


def test_requests_that_break_the_tokenizer_or_sampling_limits_fail_alone(engine):
    """A lone surrogate, an absurd seed or top_k: typed errors for those requests; the engine thread survives."""
    from eagle_ray.errors import ConfigError
    q = RequestQueue(engine)
    bad = q.submit("w1 \ud800 w2", GREEDY)
    with pytest.raises(InvalidRequestError, match="surrogate"):
        bad.result(timeout=60)
    with pytest.raises(ConfigError, match="seed"):
        SamplingParams(temperature=1.0, seed=2**64)
    with pytest.raises(ConfigError, match="top_k"):
        SamplingParams(top_k=10**19)
    assert len(q.submit(mixed_prompts(1)[0], GREEDY).result(timeout=60).token_ids) == 30
    q.shutdown()


def test_abandoning_agenerate_cancels_the_request(engine):
    q = RequestQueue(engine)

    async def main():
        task = asyncio.ensure_future(q.agenerate(mixed_prompts(1)[0], SamplingParams(max_new_tokens=200,
                                                                                    ignore_eos=True)))
        await wait_until(lambda: q.num_pending == 1 and engine.scheduler.running)   # it is generating
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until(lambda: q.num_pending == 0 and not engine.scheduler.running)

    asyncio.run(main())
    q.shutdown()
    assert engine.scheduler.free == [0, 1, 2, 3] and q.num_pending == 0


def test_generate_from_two_threads_refuses_the_second_caller_and_answers_the_first_right(tiny_dir, tiny_head):
    """One engine is stepped by one caller: a second thread's generate() gets a clear error pointing to
    RequestQueue (it used to corrupt the first caller's output)."""
    from eagle_ray.errors import InvalidRequestError
    engine = tiny_engine(tiny_dir, tiny_head)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    expected = engine.generate([[5, 9, 12]], params)[0].token_ids
    results, errors = [], []
    inside, tried = threading.Event(), threading.Event()
    step = engine.step

    def paused_step():   # the first caller waits inside its first step while the second one tries
        if not inside.is_set():
            inside.set()
            tried.wait(60)
        return step()

    engine.step = paused_step

    def first():
        results.append(engine.generate([[5, 9, 12]], params)[0].token_ids)

    t = threading.Thread(target=first)
    t.start()
    assert inside.wait(60)
    try:
        engine.generate([[5, 9, 13]], params)
    except InvalidRequestError as e:
        errors.append(str(e))
    finally:
        tried.set()
    t.join(60)
    assert results == [expected] and len(errors) == 1 and "RequestQueue" in errors[0]
    queue = RequestQueue(engine)
    try:
        with pytest.raises(InvalidRequestError, match="RequestQueue"):
            engine.generate([[5, 9, 12]], params)
        assert queue.generate([5, 9, 12], params).token_ids == expected
    finally:
        queue.shutdown()
    assert engine.generate([[5, 9, 12]], params)[0].token_ids == expected   # the queue let go of it


def test_add_request_step_and_abort_from_another_thread_while_the_engine_is_driven_are_refused(tiny_dir,
                                                                                               tiny_head):
    """While generate() runs on one thread (or a RequestQueue steps the engine), add_request, step and abort from
    another thread get a clear error pointing to RequestQueue (they used to corrupt the running call's output or
    fail it with ``ValueError: list.remove``); the driven call's answers are right."""
    engine = tiny_engine(tiny_dir, tiny_head)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    expected = engine.generate([[5, 9, 12], [7, 3]], params)
    inside, tried = threading.Event(), threading.Event()
    step, results = engine.step, []

    def paused_step():   # the driving thread waits inside its first step while the other thread tries
        if not inside.is_set():
            inside.set()
            tried.wait(60)
        return step()

    engine.step = paused_step
    worker = threading.Thread(target=lambda: results.append(engine.generate([[5, 9, 12], [7, 3]], params)))
    worker.start()
    assert inside.wait(60)
    refused = []
    for call in (lambda: engine.add_request([5, 9, 13], params), step, lambda: engine.abort("0")):
        try:
            call()
        except InvalidRequestError as e:
            refused.append(str(e))
    tried.set()
    worker.join(120)
    assert len(refused) == 3 and all("another thread" in m and "RequestQueue" in m for m in refused), refused
    assert [o.token_ids for o in results[0]] == [o.token_ids for o in expected]
    engine.step = step
    queue = RequestQueue(engine)
    try:
        with pytest.raises(InvalidRequestError, match="another thread"):
            engine.add_request([5, 9, 13], params)
        assert queue.generate([5, 9, 12], params).token_ids == expected[0].token_ids
    finally:
        queue.shutdown()
    seq = engine.add_request([5, 9, 12], params)   # nobody drives it now: the step-by-step API is this thread's
    while engine.has_unfinished():
        engine.step()
    assert engine.output(seq).token_ids == expected[0].token_ids


def test_ctrl_c_during_generate_takes_its_requests_out_of_the_engine(tiny_dir, tiny_head):
    """KeyboardInterrupt in the middle of generate(): its requests are aborted on the way out, so the next call
    neither runs nor waits for them, and every slot is free again."""
    engine = tiny_engine(tiny_dir, tiny_head, max_batch_size=4)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    expected = engine.generate([[5, 9, 12]], params)[0].token_ids
    step, steps = engine.step, []

    def interrupted_step():
        steps.append(1)
        if len(steps) == 3:
            raise KeyboardInterrupt
        return step()

    engine.step = interrupted_step
    with pytest.raises(KeyboardInterrupt):
        engine.generate(mixed_prompts(6, seed=3), params)
    engine.step = step
    assert not engine.has_unfinished() and engine.scheduler.free == [0, 1, 2, 3]
    passes = engine.counters["decode_sequences"]
    assert engine.generate([[5, 9, 12]], params)[0].token_ids == expected
    assert engine.counters["decode_sequences"] - passes <= 40   # it ran alone: one sequence per decode pass


def test_a_waiting_request_of_lower_priority_takes_the_next_free_slot_and_answers_the_same(tiny_dir, tiny_head):
    """vLLM's ``priority``: lower is earlier, equal ones in arrival order (a request's samples stay together); the
    tokens are the same whatever the order."""
    from types import SimpleNamespace

    from eagle_ray.engine.request import sampling_params
    from eagle_ray.engine.scheduler import Scheduler
    from eagle_ray.errors import InvalidRequestError
    from eagle_ray.serve.openai_api import parse_body
    scheduler = Scheduler(num_slots=1, step_budget=64, policy=None)
    for name, priority in [("a", 0), ("b", 5), ("c", -1), ("d", 0), ("e", -1)]:
        scheduler.add(SimpleNamespace(name=name, params=SimpleNamespace(priority=priority)))
    assert [s.name for s in scheduler.waiting] == ["c", "e", "a", "d", "b"]
    engine = tiny_engine(tiny_dir, tiny_head, max_batch_size=1)
    prompts = mixed_prompts(3)
    plain = engine.generate(prompts, GREEDY)
    ranked = engine.generate(prompts, [GREEDY.model_copy(update={"priority": p}) for p in (3, -2, 0)])
    assert [o.token_ids for o in ranked] == [o.token_ids for o in plain]
    assert sampling_params({"priority": -4}).priority == -4
    with pytest.raises(InvalidRequestError, match="priority: an integer is required"):
        sampling_params({"priority": True})
    body = b'{"model": "m", "prompt": "w1", "priority": 7}'
    assert parse_body(body, "completion", "m", 16, 8).params.priority == 7
