"""The batch job on a simulated multi-node Ray cluster (``ray.cluster_utils.Cluster``), in a process of its own so
that its Ray stays apart from any other: a head with no resources (as in infra/), three worker nodes with one CPU
and one logical GPU each, one engine per node (``actors.num_gpus: 1``, one thread).

    python bench/cluster_job.py node_loss --target DIR --draft DIR --workdir DIR [--out RESULT.json]
    python bench/cluster_job.py node_loss --target embedded --workdir DIR [--out RESULT.json]
    python bench/cluster_job.py bad_start node_loss --target DIR --draft DIR --workdir DIR

``node_loss``
    Two actors, 48 rows. Rows past the first 16 wait until those 16 are committed and the node of an actor holding
    some of the others is killed (its raylet and workers, no goodbye: a lost or preempted machine), so that the
    loss comes mid-job however fast the machine. Reports whether the job finished, every id's
    count, the first row any actor finished after the loss (``first_row_after_loss_s``) and the first row the lost
    actor's restarted process started and finished on the spare node (``lost_actor_started_s``,
    ``lost_actor_back_s``).

``bad_start``
    Two actors, 24 rows; the first engine to start raises in its constructor (a bad device, say).

Several scenarios run in turn on one cluster (a node lost stays lost: put ``node_loss`` last), each in
``WORKDIR/<scenario>/``; its result (``result.json`` there, and ``--out`` with the hardware and command, for one
scenario) holds every written id. ``tests/test_cluster.py`` runs both with the tests' tiny pair.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import pyarrow.parquet as pq


def rows(n: int) -> list[dict]:
    return [{"id": f"q{i}", "prompt": " ".join(f"w{(i * 7 + j) % 50}" for j in range(1 + i % 9))} for i in range(n)]


def job_config(target: str, head: str, inp: str, out: str, n_actors: int):
    """``target`` ``embedded``: the embedded pair (SmolLM2-135M-Instruct and its head), ``head`` unused."""
    from eagle_ray.batch.config import JobConfig
    pair = {} if target == "embedded" else {"target": target, "draft": head}
    return JobConfig(**{
        "engine": pair | {"dtype": "float32", "max_batch_size": 4, "max_model_len": 128 if pair else 512,
                          "threads": 1, "tree": {"total_tokens": 8, "depth": 3, "top_k": 3}},
        "sampling": {"max_new_tokens": 24, "ignore_eos": True},
        "input": {"uri": inp}, "output": {"uri": out, "rows_per_file": 8},
        "actors": {"num_actors": n_actors, "num_cpus": 1, "num_gpus": 1, "batch_size": 4,
                   "max_concurrent_batches": 2}})


MARKER = "fail-next-start"   # bad_start's file: the engine start that renames it fails
HOLD = "hold"   # node_loss's file: while it exists, only the first block's rows run
HOLD_FROM = 16   # the first row held (a block of the job is 4 batches of 4)
HOLD_MAX_S = 600   # a hold never lifted (the node was not lost) lets the job end, and the result say why


def worker_hooks(marker: str, hold: str):
    """A worker setup hook. The first GenerateStage to start (the one that takes ``marker``) raises. While ``hold``
    exists, a batch of rows past the first ``HOLD_FROM`` waits, its actor named in ``hold.<pid>``: ``lose_a_node``
    removes the node of an actor with rows still to run however fast the machine, then ``hold``."""
    def hook():
        import asyncio
        from eagle_ray.batch import stage
        start, call = stage.GenerateStage.__init__, stage.GenerateStage.__call__

        def init(self, *args, **kwargs):
            try:
                os.rename(marker, marker + ".taken")   # atomic: one actor of all takes it
            except FileNotFoundError:
                return start(self, *args, **kwargs)
            raise RuntimeError("this engine cannot start (simulated bad device)")

        async def held_call(self, batch):
            t0 = time.time()
            if os.path.exists(hold) and batch.num_rows and min(batch.column("row_index").to_pylist()) >= HOLD_FROM:
                Path(f"{hold}.tmp{os.getpid()}").write_text(self.worker_id)
                os.replace(f"{hold}.tmp{os.getpid()}", f"{hold}.{os.getpid()}")   # whole, for the killer to read
                while os.path.exists(hold) and time.time() - t0 < HOLD_MAX_S:
                    await asyncio.sleep(0.05)
            return await call(self, batch)
        stage.GenerateStage.__init__, stage.GenerateStage.__call__ = init, held_call
    return hook


def committed(out: Path) -> list[dict]:
    found = []
    for p in sorted(out.glob("part-*.parquet")):
        try:
            found += pq.read_table(p, columns=["id", "worker_id", "started_at", "finished_at"]).to_pylist()
        except Exception:  # noqa: BLE001 - a part being replaced
            pass
    return found


def node_of(cluster, pid: int):
    """The cluster node whose raylet started worker ``pid``."""
    import psutil
    parents = {p.pid for p in psutil.Process(pid).parents()}
    for node in cluster.worker_nodes:
        if any(info.process.pid in parents for info in node.all_processes.get("raylet", [])):
            return node
    raise LookupError(f"no worker node holds pid {pid}")


def main(scenarios: list[str], target: str, head: str, workdir: str) -> dict[str, dict]:
    """Each of ``scenarios`` in turn on one cluster; returns their results by name."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "num_gpus": 0, "include_dashboard": False})
    for _ in range(3):
        cluster.add_node(num_cpus=1, num_gpus=1)
    cluster.wait_for_nodes()
    work = Path(workdir)   # the marker and the hold are put there as their scenarios begin
    hook = worker_hooks(str(work / "bad_start" / MARKER), str(work / "node_loss" / HOLD))
    ray.init(address=cluster.address, runtime_env={"worker_process_setup_hook": hook}, log_to_driver=False)
    try:
        return {name: run_scenario(name, cluster, target, head, Path(workdir) / name) for name in scenarios}
    finally:
        ray.shutdown()
        cluster.shutdown()


def run_scenario(scenario: str, cluster, target: str, head: str, work: Path) -> dict:
    from eagle_ray.batch.job import run_job

    work.mkdir(parents=True, exist_ok=True)
    n_rows = {"node_loss": 48, "bad_start": 24}[scenario]
    (work / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows(n_rows)))
    out = work / "out"
    for stale in work.glob(f"{HOLD}.*"):   # an earlier run's in this folder
        stale.unlink()
    (work / {"bad_start": MARKER, "node_loss": HOLD}[scenario]).touch()
    cfg = job_config(target, head, str(work / "in.jsonl"), str(out), 2)
    result: dict = {"scenario": scenario, "rows": n_rows}
    stop = threading.Event()

    def lose_a_node():
        try:
            while not stop.is_set():
                held = sorted(work.glob(f"{HOLD}.[0-9]*"))
                if held and len(committed(out)) >= HOLD_FROM:   # the first block's rows committed, the others held
                    worker = held[0].read_text()   # host:pid:actor
                    node = node_of(cluster, int(worker.split(":")[1]))
                    result["removed_at"] = datetime.now(timezone.utc).isoformat()
                    result["rows_before"] = len(committed(out))
                    result["lost_worker"] = worker
                    cluster.remove_node(node, allow_graceful=False)
                    return
                time.sleep(0.05)
            result["killer"] = (f"the job ended before its first {HOLD_FROM} rows were committed while a batch was "
                                f"held (batches wait up to {HOLD_MAX_S} s)")
        except BaseException as e:  # noqa: BLE001 - said in the result, not lost in a thread
            result["killer"] = f"{type(e).__name__}: {e}"
        finally:
            (work / HOLD).unlink(missing_ok=True)   # the batches held go on

    killer = threading.Thread(target=lose_a_node, daemon=True) if scenario == "node_loss" else None
    if killer:
        killer.start()
    t0 = time.time()
    try:
        summary = run_job(cfg, print_fn=lambda line: print(line, file=sys.stderr, flush=True))
        result["exit"] = "ok"
        result["summary_rows"] = summary["rows"]
    except BaseException as e:  # noqa: BLE001 - the scenario's outcome, whatever it is
        result["exit"] = f"{type(e).__name__}: {str(e)[:500]}"
    finally:
        stop.set()
        if killer:
            killer.join(timeout=60)
    result["wall_s"] = round(time.time() - t0, 1)
    written = committed(out)
    result["ids"] = [r["id"] for r in written]
    if scenario == "node_loss" and "removed_at" in result:
        removed = datetime.fromisoformat(result["removed_at"])
        lost_actor = result["lost_worker"].split(":")[2]
        lost_pid = result["lost_worker"].split(":")[1]
        after = sorted(r["finished_at"] for r in written if r["finished_at"] > removed)
        restarted = [r for r in written if r["worker_id"].split(":")[2] == lost_actor
                     and r["worker_id"].split(":")[1] != lost_pid]
        # rows flowing again: the first row any actor finished after the loss; the lost actor back: the first row
        # its restarted process started (its engine loaded, its batches retried), and finished
        result["first_row_after_loss_s"] = round((after[0] - removed).total_seconds(), 1) if after else None
        for key, col in (("lost_actor_started_s", "started_at"), ("lost_actor_back_s", "finished_at")):
            first = min((r[col] for r in restarted), default=None)
            result[key] = round((first - removed).total_seconds(), 1) if first else None
        result["rows_by_restarted_actor"] = len(restarted)
    if scenario == "bad_start":
        result["failed_starts"] = len(list(work.glob(f"{MARKER}.taken")))
    result["workers"] = sorted({r["worker_id"] for r in written})
    (work / "result.json").write_text(json.dumps(result, default=str))
    return result


if __name__ == "__main__":
    import argparse
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from harness import command_line, write_result
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("scenario", nargs="+", choices=["node_loss", "bad_start"])
    p.add_argument("--target", required=True, help="a target's folder, or `embedded` for the embedded pair")
    p.add_argument("--draft", default=None, help="the head's folder (not with `--target embedded`)")
    p.add_argument("--notes", default=None, help="said in the result file (e.g. what else ran on the machine)")
    p.add_argument("--workdir", required=True)
    p.add_argument("--out", default=None, help="the result with the hardware and command (one scenario)")
    a = p.parse_args()
    if a.out and len(a.scenario) > 1:
        p.error("--out takes the result of one scenario")
    for outcome in main(a.scenario, a.target, a.draft, a.workdir).values():
        write_result(a.out, {k: v for k, v in outcome.items() if k != "ids"} |
                     {"ids_written": len(outcome["ids"]), "ids_distinct": len(set(outcome["ids"]))} |
                     ({"notes": a.notes} if a.notes else {}),
                     command_line("bench/cluster_job.py", sys.argv[1:]))
