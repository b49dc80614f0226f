"""Connecting to Ray: an address given (config or RAY_ADDRESS), else the head already running on this machine, else
a new local Ray bound to 127.0.0.1. The batch job, the Serve CLI and feature extraction all start Ray this way."""
from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def ensure_ray(address: str | None = None, num_cpus: int | None = None) -> str:
    """Connect to ``address`` / RAY_ADDRESS if given; else to the Ray head already running on this machine (what
    ``ray.init()`` does), else start a local Ray bound to 127.0.0.1. A stale record of a head that is gone is
    ignored. The job and the Serve CLI both start Ray this way; returns how it connected."""
    import ray
    if ray.is_initialized():
        return "already connected"
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address)
        return f"connected to {address}"
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    head = _local_head_address()
    if head is not None:
        if _reachable(head):
            # "auto", not the address read: Ray sends its token (~/.ray/auth_token, which `ray start` turns on
            # by default where one exists) only to a head it found itself, never to an address it was given
            ray.init(address="auto")
            return "connected to the Ray head running on this machine"
        log.warning("Ray records a head at %s on this machine but nothing answers there; starting a new one", head)
    ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=num_cpus)
    return "started a local Ray on 127.0.0.1"


def _local_head_address() -> str | None:
    """The address ``ray start`` recorded for this machine's head, if any (it may be stale)."""
    try:
        from ray._private.utils import read_ray_address
        return read_ray_address()
    except Exception:  # noqa: BLE001 - a private helper; no record is the safe answer
        return None


def _reachable(address: str, timeout: float = 2.0) -> bool:
    import socket
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


