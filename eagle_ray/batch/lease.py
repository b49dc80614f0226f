"""One run at a time per output: a run holds ``_lease.json`` while it writes, since two runs on one output would
both run and commit every row.

- **Who may still be running.** A lease names its run, host, process id, the process's start time and what
  identifies its PID namespace (the namespace's inode and the kernel's boot id). A lease from the same host and
  namespace is judged by its process: while that process lives (paused with SIGSTOP, stuck in a long GC or swap,
  however long its heartbeat is silent) the lease is held; once it is gone (or its PID now names a process that
  started later) it is free at once, so a killed driver resumes right away. A lease from anywhere else (another
  host, or another container with the same host name: its PIDs mean nothing here) is judged by its heartbeat alone,
  renewed every ``stale_s / 4`` seconds and taken over once ``stale_s`` old.
- **Holding it.** A run re-reads the lease before each commit and before its summary (:meth:`OutputLease.check`),
  and its renewal stops writing once the lease names another run: a run that was taken over (it was silent past
  ``stale_s`` where only its heartbeat could speak for it) stops with :class:`LeaseLostError`, committing nothing
  more, instead of writing beside the run that took over.
- **Writing it** is atomic (a rename locally, one PUT on S3): a reader sees the old lease or the new one, never an
  empty file. On S3 two runs starting in the same second may both write it; each reads it back, and the one whose
  write did not last refuses.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time

from eagle_ray.batch.store import put_atomic
from eagle_ray.errors import ConfigError, EagleError

LEASE_FILE = "_lease.json"


class LeaseLostError(EagleError):
    """Another run took this run's output over: this run commits nothing more."""


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def process_started(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (``/proc/<pid>/stat``), or None where unknown: with
    the PID it names one process, never a later one given the same PID."""
    stat = _read(f"/proc/{pid}/stat")
    try:
        return int(stat.rsplit(")", 1)[1].split()[19]) if stat else None
    except (IndexError, ValueError):
        return None


def this_process() -> dict:
    """What names this process to another run reading its lease."""
    try:
        pid_ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pid_ns = None
    return {"host": socket.gethostname(), "pid": os.getpid(), "process_started": process_started(os.getpid()),
            "pid_ns": pid_ns, "boot_id": _read("/proc/sys/kernel/random/boot_id")}


class OutputLease:
    """``_lease.json`` of the output at ``root``, held by run ``run`` (the module's docstring says how)."""

    def __init__(self, fs, root: str, run: str, stale_s: float = 120.0):
        self.fs, self.path, self.stale_s = fs, f"{root}/{LEASE_FILE}", stale_s
        self.mine = {"run": run, **this_process()}
        self.lost: str | None = None          # why this run no longer holds it
        self._stop: threading.Event | None = None
        self._lock = threading.Lock()         # one read-then-write at a time (renewal and check)

    @property
    def root(self) -> str:
        return self.path.rsplit("/", 1)[0]

    def held(self) -> dict | None:
        try:
            return json.loads(self.fs.cat_file(self.path))
        except (FileNotFoundError, ValueError):
            return None

    def _write(self) -> None:
        put_atomic(self.fs, self.path, json.dumps(self.mine | {"heartbeat": time.time()}).encode())

    def same_process_space(self, held: dict) -> bool:
        """Whether ``held``'s PID names a process here: the same host, PID namespace and boot."""
        return all(held.get(k) == self.mine[k] for k in ("host", "pid_ns", "boot_id"))

    def alive(self, held: dict) -> bool:
        """Whether the run holding the lease may still be running."""
        if held.get("run") == self.mine["run"]:
            return False
        pid = held.get("pid")
        if self.same_process_space(held) and isinstance(pid, int):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return False   # its process is gone
            except OSError:
                pass           # alive, another user's
            started = held.get("process_started")
            return started is None or process_started(pid) in (None, started)   # else the PID was reused
        return time.time() - held.get("heartbeat", 0) < self.stale_s

    def acquire(self) -> None:
        held = self.held()
        if held and self.alive(held):
            silent = time.time() - held.get("heartbeat", 0)
            raise ConfigError(f"output.uri {self.root} is in use by run {held.get('run')} on {held.get('host')} "
                              f"(pid {held.get('pid')}), alive {silent:.0f} s ago: two runs on one output would both "
                              f"write every row; wait for it to end, or remove {self.path} if it died")
        self._write()
        time.sleep(0.2)
        if (self.held() or {}).get("run") != self.mine["run"]:
            raise ConfigError(f"output.uri {self.root}: another run took it at the same moment")
        self._stop = threading.Event()
        threading.Thread(target=self._renew, name="eagle-ray-lease", daemon=True).start()

    def check(self) -> None:
        """Raise :class:`LeaseLostError` unless this run still holds the lease (read again now)."""
        with self._lock:
            if self.lost is None:
                held = self.held()
                if (held or {}).get("run") != self.mine["run"]:
                    self._lose(held)
        if self.lost is not None:
            raise LeaseLostError(self.lost)

    def _lose(self, held: dict | None) -> None:
        self.lost = (f"output.uri {self.root} was taken over by run {held.get('run')} on {held.get('host')} (pid "
                     f"{held.get('pid')}) while this run was silent for over lease_stale_s ({self.stale_s:g} s): "
                     "this run stops and commits nothing more; the rows it committed stay"
                     if held else f"{self.path} was removed while this run held it: this run stops and commits "
                     "nothing more; the rows it committed stay")
        if self._stop is not None:
            self._stop.set()

    def _renew(self) -> None:
        while not self._stop.wait(self.stale_s / 4):
            try:
                with self._lock:
                    held = self.held()
                    if (held or {}).get("run") != self.mine["run"]:
                        self._lose(held)
                        return
                    self._write()
            except Exception:  # noqa: BLE001 - any store's error: retried next time; the lease outlives a few
                pass

    def release(self) -> None:
        if self._stop is not None:
            self._stop.set()
            with self._lock:
                if self.lost is None and (self.held() or {}).get("run") == self.mine["run"]:
                    self.fs.rm(self.path)
