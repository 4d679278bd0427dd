"""Pure routing policy for many replicas: the least busy replica, and among equals the one where the adapter is live.

The router counts the requests it has in flight on each replica and remembers the adapter it last sent to each:
with one generation at a time per replica, that adapter is the one live there (or about to be). A swap costs
milliseconds (see the README's performance table) while waiting behind another generation costs a whole one, so
replicas are ordered by:

1. requests in flight (fewest first);
2. whether the request's adapter is live there (no swap), then whether the replica has served nothing yet;
3. the adapter's rendezvous-hash order, so an adapter that must move keeps moving to the same place, and a replica
   leaving changes nothing for adapters that did not prefer it.

Each replica is its own rank: Ray Serve's router tries them in this order and skips a full one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence


def _weight(adapter: str, replica: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{adapter}\0{replica}".encode(), digest_size=8).digest(), "big")


def preference(adapter: str, replicas: Sequence[str]) -> list[str]:
    """`replicas` in `adapter`'s rendezvous-hash order: the same inputs give the same order in every process."""
    return sorted(replicas, key=lambda r: _weight(adapter, r), reverse=True)


def rank_by_affinity(
    adapter: str, replicas: Sequence[str], last: Mapping[str, str], in_flight: Mapping[str, int]
) -> list[list[str]]:
    """Ranks for a request router. `last`: the adapter last routed to each replica ('' is the base model);
    `in_flight`: requests routed there and not finished."""
    order = {r: i for i, r in enumerate(preference(adapter, replicas))}

    def key(r: str) -> tuple:
        affinity = 0 if last.get(r) == adapter and r in last else 1 if r not in last else 2
        return in_flight.get(r, 0), affinity, order[r]

    return [[r] for r in sorted(replicas, key=key)]
