"""The in-memory store of /v1/responses (`store: true`), bounded in bytes and split by tenant.

Each entry is kept as the JSON bytes it is served as (the response object) and the JSON of
its turn (its input and output as chat messages, what `previous_response_id` continues), so
what it holds in memory is what it counts: those bytes plus ENTRY_OVERHEAD.

    entry_bytes   one entry's cap: a bigger one is not stored (server/responses_api.py says
                  so: a 400 when the request set `store: true` itself, else `store: false`)
    tenant_bytes  each tenant's quota: a tenant's new entry evicts its own least recently
                  used ones, never another tenant's
    total_bytes   all tenants together, a backstop for many tenants (--cache-salt-from
                  header:NAME): past it, the tenant holding the most bytes loses its least
                  recently used entry first. With total_bytes >= tenants * tenant_bytes (one
                  tenant per --api-key key) no tenant's entry is ever evicted by another's.

A tenant (`owner`) is a hash of the request's API key or tenant header (b"": a server without
keys, one tenant shared by all); an entry is seen only by its owner: another's id is a 404.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from conveyor.server.errors import APIError

# What an entry costs beyond its JSON: its id, its objects, its place in the indexes.
ENTRY_OVERHEAD = 512


@dataclass(slots=True)
class _Stored:
    response: bytes  # the response object's JSON, as GET serves it
    messages: bytes  # this turn's input and output, as a JSON list of chat messages
    previous: str | None

    @property
    def size(self) -> int:
        return len(self.response) + len(self.messages) + ENTRY_OVERHEAD


@dataclass(slots=True)
class _Tenant:
    entries: OrderedDict[str, _Stored] = field(default_factory=OrderedDict)
    bytes: int = 0


class ResponseStore:
    """Stored responses by id, per tenant, least recently used evicted first (see the module
    docstring for the three limits)."""

    def __init__(self, total_bytes: int, tenant_bytes: int, entry_bytes: int) -> None:
        if not 0 < entry_bytes <= tenant_bytes <= total_bytes:
            raise ValueError(
                "the response store needs 0 < entry_bytes <= tenant_bytes <= total_bytes, got "
                f"{entry_bytes}, {tenant_bytes}, {total_bytes}."
            )
        self.total_bytes, self.tenant_bytes, self.entry_bytes = (
            total_bytes, tenant_bytes, entry_bytes
        )  # fmt: skip
        self.bytes = 0  # held over all tenants
        self._tenants: dict[bytes, _Tenant] = {}

    def tenant_bytes_held(self, owner: bytes) -> int:
        """What `owner`'s entries hold (their JSON and ENTRY_OVERHEAD each)."""
        tenant = self._tenants.get(owner)
        return 0 if tenant is None else tenant.bytes

    def fits(self, num_bytes: int) -> bool:
        """Whether an entry of `num_bytes` of JSON (response and messages) may be stored."""
        return num_bytes + ENTRY_OVERHEAD <= self.entry_bytes

    def put(
        self, response_id: str, response: bytes, messages: bytes, previous: str | None, owner: bytes
    ) -> bool:
        """Store an entry, evicting as the module docstring says; False: over entry_bytes,
        not stored."""
        entry = _Stored(response, messages, previous)
        if entry.size > self.entry_bytes:
            return False
        while self.tenant_bytes_held(owner) + entry.size > self.tenant_bytes:
            self._evict(owner)
        while self.bytes + entry.size > self.total_bytes:
            self._evict(max(self._tenants, key=lambda o: self._tenants[o].bytes))
        tenant = self._tenants.setdefault(owner, _Tenant())
        tenant.entries[response_id] = entry
        tenant.bytes += entry.size
        self.bytes += entry.size
        return True

    def _evict(self, owner: bytes, response_id: str | None = None) -> None:
        """Drop `owner`'s entry `response_id` (None: its least recently used one)."""
        tenant = self._tenants[owner]
        if response_id is None:
            response_id = next(iter(tenant.entries))
        entry = tenant.entries.pop(response_id)
        tenant.bytes -= entry.size
        self.bytes -= entry.size
        if not tenant.entries:
            del self._tenants[owner]

    def _entry(self, response_id: str, owner: bytes, param: str | None = None) -> _Stored:
        tenant = self._tenants.get(owner)
        entry = None if tenant is None else tenant.entries.get(response_id)
        if tenant is None or entry is None:
            raise APIError(
                f"No stored response with id {response_id[:80]!r} (this server keeps responses "
                "created with store true in memory, each API key's least recently used "
                f"evicted past {self.tenant_bytes} bytes).",
                param=param,
                status=404,
            )
        tenant.entries.move_to_end(response_id)
        return entry

    def get(self, response_id: str, owner: bytes) -> bytes:
        """The stored response object's JSON; APIError 404 if `owner` has no such entry."""
        return self._entry(response_id, owner).response

    def delete(self, response_id: str, owner: bytes) -> None:
        self._entry(response_id, owner)
        self._evict(owner, response_id)

    def history(self, response_id: str, owner: bytes) -> list[bytes]:
        """The JSON of each turn of the conversation up to and including `response_id`'s,
        oldest first.

        Raises:
            APIError: 404 (param previous_response_id), a turn of it is not stored.
        """
        turns, seen = [], set()
        next_id: str | None = response_id
        while next_id is not None and next_id not in seen:
            seen.add(next_id)
            entry = self._entry(next_id, owner, "previous_response_id")
            turns.append(entry.messages)
            next_id = entry.previous
        return turns[::-1]
