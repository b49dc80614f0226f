"""The job's ``summary.json``, folded from Arrow tables of output rows as they are committed, so that the driver's
memory does not grow with the output: a resume folds in the rows already there (the few columns it reads of them
anyway) and the run folds in each part it writes. What the summary holds and how exact it is:

- rows, errors and errors by kind over the whole output, and this run's generated tokens, per-actor rows, tokens
  and tokens/s, and its generation span: exact;
- tau's mean over the whole output: exact; its p50 and p90: from a histogram of tau rounded to 0.001, so each is
  within 0.0005 of the value a sort of every row's tau gives (the same rank: the row at ``int(q * n)``);
- ``tau_over_time``: this run's rows in tenths by finish order, each with its mean tau and head versions. Up to
  :data:`FinishOrder.ROWS` rows it is exact (rows sorted by ``finished_at``); past that the rows go into at most
  that many runs of equal size in the order they reach the driver (each batch sorted by ``finished_at``), so a
  tenth's edge falls within one run of rows (a thousandth of them) of the exact one.
"""
from __future__ import annotations

import math
from collections import Counter
from datetime import datetime

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

TAU_RESOLUTION = 1000   # histogram bins per unit of tau

# the columns a summary reads: of every row, and of this run's rows
COLUMNS = ("error", "error_kind", "tau")
RUN_COLUMNS = COLUMNS + ("output_tokens", "worker_id", "started_at", "finished_at", "head_version")


class FinishOrder:
    """This run's rows in the order they finished, in at most ``ROWS`` runs of equal size: each run's row count,
    tau sum and head versions. Rows are kept one by one (and sorted by finish time at the end) until there are
    ``ROWS``; then neighbours merge pairwise, doubling the run size, and later rows fill runs in arrival order."""
    ROWS = 1024

    def __init__(self):
        self.size = 1                                        # rows per run once merged
        self.runs: list[list] = []                           # [rows, tau sum, head versions, finished (size 1)]

    def add(self, tau: np.ndarray, head: np.ndarray, finished: np.ndarray) -> None:
        order = np.argsort(finished, kind="stable")
        tau, head, finished = tau[order], head[order], finished[order]
        i = 0
        while i < len(tau):
            if self.size == 1:
                self.runs.append([1, float(tau[i]), {int(head[i])}, int(finished[i])])
                i += 1
            else:
                last = self.runs[-1] if self.runs and self.runs[-1][0] < self.size else None
                if last is None:
                    last = [0, 0.0, set(), None]
                    self.runs.append(last)
                take = min(self.size - last[0], len(tau) - i)
                last[0] += take
                last[1] += float(tau[i:i + take].sum())
                last[2].update(int(h) for h in np.unique(head[i:i + take]))
                i += take
            if len(self.runs) > self.ROWS and self.runs[-1][0] >= self.size:
                self._merge()

    def _merge(self) -> None:
        if self.size == 1:
            self.runs.sort(key=lambda r: r[3])
        runs = self.runs
        self.runs = [[a[0] + b[0], a[1] + b[1], a[2] | b[2], None]
                     for a, b in zip(runs[0::2], runs[1::2])] + ([runs[-1]] if len(runs) % 2 else [])
        self.size *= 2

    def tenths(self) -> list[dict]:
        runs = sorted(self.runs, key=lambda r: r[3]) if self.size == 1 else self.runs
        total = sum(r[0] for r in runs)
        block = max(1, -(-total // 10))
        out, rows, tau, heads = [], 0, 0.0, set()
        for r in runs:
            rows, tau, heads = rows + r[0], tau + r[1], heads | r[2]
            if rows >= block:
                out.append({"rows": rows, "tau": round(tau / rows, 4), "head_versions": sorted(heads)})
                rows, tau, heads = 0, 0.0, set()
        if rows:
            out.append({"rows": rows, "tau": round(tau / rows, 4), "head_versions": sorted(heads)})
        return out


class JobSummary:
    """Folds output rows into the summary: :meth:`add` each table (``this_run`` for the rows this run wrote),
    :meth:`result` at the end."""

    def __init__(self):
        self.rows = self.errors = self.generated = 0
        self.error_kinds: Counter = Counter()
        self.tau_bins: Counter = Counter()       # round(tau * TAU_RESOLUTION) -> rows
        self.tau_sum, self.tau_rows = 0.0, 0
        self.actors: dict[str, list] = {}         # worker -> [rows, tokens, first started, last finished]
        self.first_started = self.last_finished = None
        self.order = FinishOrder()
        self._pending: list[pa.Table] = []
        self._pending_rows = 0

    FOLD_ROWS = 1 << 14   # this run's rows are folded this many at a time (each fold costs some 30 compute calls)

    def add(self, table: pa.Table, this_run: bool = False) -> None:
        if this_run:   # only the columns the summary reads, held until a fold's worth has come
            self._pending.append(table.select(RUN_COLUMNS))
            self._pending_rows += table.num_rows
            if self._pending_rows >= self.FOLD_ROWS:
                self._fold_pending()
        else:
            self._fold(table, False)

    def _fold_pending(self) -> None:
        if self._pending:
            table = pa.concat_tables(self._pending, promote_options="default")
            self._pending, self._pending_rows = [], 0
            self._fold(table, True)

    def _fold(self, table: pa.Table, this_run: bool) -> None:
        if table.num_rows == 0:
            return
        self.rows += table.num_rows
        failed = pc.fill_null(pc.greater(pc.utf8_length(table.column("error")), 0), False)
        errors = pc.sum(failed).as_py() or 0
        if errors:
            self.errors += errors
            kinds = pc.value_counts(pc.fill_null(table.column("error_kind").filter(failed), "unknown"))
            self.error_kinds.update({k.as_py(): n.as_py() for k, n in zip(kinds.field("values"), kinds.field("counts"))})
        ok = table.filter(pc.invert(failed)) if errors else table
        tau = ok.column("tau")
        with_tau = pc.fill_null(pc.greater(tau, 0), False)
        taus = tau.filter(with_tau)
        if len(taus):
            self.tau_sum += pc.sum(taus).as_py()
            self.tau_rows += len(taus)
            bins = pc.value_counts(pc.cast(pc.round(pc.multiply(taus, float(TAU_RESOLUTION))), pa.int64()))
            self.tau_bins.update({k.as_py(): n.as_py() for k, n in zip(bins.field("values"), bins.field("counts"))})
        if this_run and ok.num_rows:
            self._add_run(ok, with_tau)

    def _add_run(self, ok: pa.Table, with_tau) -> None:
        tokens = ok.column("output_tokens")
        self.generated += pc.sum(tokens).as_py() or 0
        started, finished = ok.column("started_at"), ok.column("finished_at")
        lo, hi = pc.min(started).as_py(), pc.max(finished).as_py()
        if lo is not None:
            self.first_started = lo if self.first_started is None else min(self.first_started, lo)
        if hi is not None:
            self.last_finished = hi if self.last_finished is None else max(self.last_finished, hi)
        per = ok.group_by("worker_id").aggregate([("output_tokens", "sum"),
                                                  ("output_tokens", "count", pc.CountOptions(mode="all")),
                                                  ("started_at", "min"), ("finished_at", "max")])
        for w, tok, n, first, last in zip(*(per.column(c).to_pylist() for c in (
                "worker_id", "output_tokens_sum", "output_tokens_count", "started_at_min", "finished_at_max"))):
            a = self.actors.setdefault(w, [0, 0, first, last])
            a[0] += n
            a[1] += tok or 0
            a[2] = _earliest(a[2], first)
            a[3] = _latest(a[3], last)
        timed = ok.filter(with_tau)
        if timed.num_rows:
            self.order.add(timed.column("tau").to_numpy(),
                           pc.fill_null(timed.column("head_version"), 0).to_numpy(),
                           pc.fill_null(pc.cast(timed.column("finished_at"), pa.int64()), 0).to_numpy())

    def tau_percentile(self, q: float) -> float | None:
        """The tau at rank ``int(q * n)`` of every row's tau in order, to the histogram's resolution."""
        if not self.tau_rows:
            return None
        rank, seen = min(self.tau_rows - 1, int(q * self.tau_rows)), 0
        for key in sorted(self.tau_bins):
            seen += self.tau_bins[key]
            if seen > rank:
                return key / TAU_RESOLUTION
        return None   # not reached: the bins count every row

    def result(self, written_this_run: int, wall: float) -> dict:
        self._fold_pending()
        gen = self.generated
        span = (self.last_finished - self.first_started).total_seconds() if self.first_started and \
            self.last_finished else None
        per_actor = {w: {"rows": a[0], "tokens": a[1],
                         "tokens_per_s": a[1] / max((a[3] - a[2]).total_seconds(), 1e-9) if a[2] and a[3] else None}
                     for w, a in self.actors.items()}
        return {
            "rows": self.rows, "errors": self.errors, "written_this_run": written_this_run,
            "error_kinds": dict(self.error_kinds),
            "tau_mean": self.tau_sum / self.tau_rows if self.tau_rows else None,
            "tau_p50": self.tau_percentile(0.5), "tau_p90": self.tau_percentile(0.9),
            "tau_resolution": 1 / TAU_RESOLUTION,
            "generated_tokens_this_run": gen, "wall_s": wall,
            "generated_tokens_per_s": gen / wall if wall > 0 else None,
            "generation_span_s": span,
            "generation_tokens_per_s": gen / span if span else None,
            "per_actor": per_actor, "tau_over_time": self.order.tenths(),
        }


def _earliest(a: datetime | None, b: datetime | None):
    return b if a is None else a if b is None else min(a, b)


def _latest(a: datetime | None, b: datetime | None):
    return b if a is None else a if b is None else max(a, b)


def format_summary(s: dict) -> str:
    def f(x, spec=".2f"):
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)
    lines = ["", "eagle-ray job summary", "---------------------",
             f"rows            {s['rows']}", f"errors          {s['errors']}  {s['error_kinds'] or ''}",
             f"tau mean/p50/p90 {f(s['tau_mean'])} / {f(s['tau_p50'])} / {f(s['tau_p90'])}",
             f"generated tokens {s['generated_tokens_this_run']} in {s['wall_s']:.1f} s = "
             f"{f(s['generated_tokens_per_s'], '.1f')} tok/s (generation only: {f(s['generation_tokens_per_s'], '.1f')})",
             "per actor:"]
    for w, a in s["per_actor"].items():
        lines.append(f"  {str(w):<40} rows {a['rows']:>6}  tokens {a['tokens']:>8}  {f(a['tokens_per_s'], '.1f')} tok/s")
    if s.get("tau_over_time"):
        lines.append("tau over time    " + " ".join(f"{b['tau']:.2f}" for b in s["tau_over_time"]))
    return "\n".join(lines)
