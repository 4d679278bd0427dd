"""Pure routing policy for many replicas: send each request where its adapter is already live.

The router remembers the adapter it last sent to each replica: with one generation at a time per replica and few
requests in flight, that is the adapter live there (or about to be). A request prefers, in order:

1. replicas whose last adapter is its own (no swap);
2. replicas that have not served anything yet;
3. the rest, in the adapter's rendezvous-hash order, so an adapter that must move keeps moving to the same place.

Each rank is tried only while its replicas have room (Ray Serve's `max_ongoing_requests`), so a busy replica spills
its adapter over to the next rank rather than queueing without bound.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence


def _weight(adapter: str, replica: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{adapter}\0{replica}".encode(), digest_size=8).digest(), "big")


def preference(adapter: str, replicas: Sequence[str]) -> list[str]:
    """`replicas` in `adapter`'s rendezvous-hash order: the same inputs give the same order in every process."""
    return sorted(replicas, key=lambda r: _weight(adapter, r), reverse=True)


def rank_by_affinity(adapter: str, replicas: Sequence[str], last: Mapping[str, str]) -> list[list[str]]:
    """Ranks for a request router; `last` maps a replica to the adapter last routed to it ('' is the base model)."""
    ordered = preference(adapter, replicas)
    live = [r for r in ordered if r in last and last[r] == adapter]
    fresh = [r for r in ordered if r not in last]
    rest = [r for r in ordered if r not in live and r not in fresh]
    return [rank for rank in (live, fresh, *([r] for r in rest)) if rank]
