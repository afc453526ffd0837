"""Tenants on one deployment: each tenant's share of the KV-cache pool and its limits, and the book that holds a
runtime to them.

A tenant (the config's ``tenants:`` section; docs/serving/tenants.md) has a KV share (``kv_share``, a fraction of
the pool's blocks, or ``kv_blocks``, a count), an optional request class (``priority_level``), an optional limit on
its requests in flight (``max_concurrency``: waiting and running) and an optional token rate
(``tokens_per_minute``: prompt plus requested output tokens, a token bucket holding one minute's worth). The
tenant ``default`` takes the blocks no named tenant has; a request that names no tenant is its.

:class:`TenantBook` is the runtime's accounting (the cpu runtime's scheduler, ``pipeline.engines.cpu_runtime``):

- ``accept`` at submit: an unknown tenant, or a request its share could never hold, is an ``InputError`` (a 4xx);
  a tenant at its concurrency or token-rate limit gets :class:`TenantLimitError`, which says when to retry;
- ``fits`` / ``reserve`` at admission: a request runs only while the blocks of its full length (prompt and max
  tokens), with those its tenant's running requests hold at theirs, fit the tenant's share;
- ``slot_share``: the running slots a tenant is owed, its KV share of the runtime's ``slots`` (at least one): with
  every slot taken, a request of a tenant below its slot share pauses a sequence of a tenant above its own, so a
  tenant whose share holds more requests than there are slots cannot keep the others waiting for one;
- ``finish``: its blocks and its place in flight come back.

:class:`TenantGate` is the same admission in front of an engine whose scheduler is not ours (vLLM's, under Triton's
vLLM model): a request is handed to the engine only while its blocks fit its tenant's share and the engine has a
free slot; until then it waits in the gate. A slot that frees goes first to a tenant below its slot share, and a
tenant at its slot share leaves one slot free for the others.

It imports nothing heavy (no torch): the config checks shares with :func:`resolve_blocks` at load. It imports nothing
of this project's but its errors either: publish copies this file beside the vLLM target's Triton model, whose
environment (vLLM's) has no ``pipeline`` package, and there an ``InputError`` is a plain ``ValueError`` (what the
Triton models answer as a 400).
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

try:
    from pipeline.errors import InputError
except ImportError:  # the copy beside the vLLM target's Triton model (publish.py), in vLLM's environment
    InputError = ValueError  # type: ignore[misc, assignment]

DEFAULT_TENANT = "default"
# A request may name its tenant in this header instead of its ``tenant`` input, so that a gateway in front of the
# pods (which authenticates the caller) sets it. tritonserver passes a header to the model as a request parameter
# only where its command line asks for it (TENANT_HEADER_ARGS): on HTTP infer and gRPC; Triton's generate
# endpoints forward no headers. An ensemble passes them to its first step alone (measured on the pinned server).
TENANT_HEADER = "x-tenant"
TENANT_HEADER_ARGS = (f"--http-header-forward-pattern=^{TENANT_HEADER}$",
                      f"--grpc-header-forward-pattern=^{TENANT_HEADER}$")
RATE_WINDOW_S = 60.0  # tokens_per_minute: the bucket holds one minute's tokens


@dataclass(frozen=True)
class TenantSpec:
    """One tenant, as the config's ``tenants:`` list gives it (exactly one of kv_share, kv_blocks)."""

    name: str
    kv_share: Optional[float] = None  # a fraction of the pool's blocks, (0, 1]
    kv_blocks: Optional[int] = None
    priority_level: Optional[int] = None
    max_concurrency: Optional[int] = None
    tokens_per_minute: Optional[int] = None


def specs_from(items: Sequence[object]) -> list[TenantSpec]:
    """TenantSpecs from config sections or plain dicts (a serving model's JSON parameter)."""
    out = []
    for item in items:
        d = item if isinstance(item, dict) else item.model_dump()  # type: ignore[attr-defined]
        out.append(TenantSpec(**{k: v for k, v in d.items() if v is not None}))
    return out


def resolve_blocks(specs: Sequence[TenantSpec], pool_blocks: int) -> dict[str, int]:
    """{tenant: KV blocks} for a pool of ``pool_blocks``: a fraction rounds down; ``default`` gets the rest.
    Shares that sum past the pool are an InputError naming each one."""
    out: dict[str, int] = {}
    for i, s in enumerate(specs):
        out[s.name] = s.kv_blocks if s.kv_blocks is not None else int(math.floor((s.kv_share or 0) * pool_blocks))
        if out[s.name] < 1:
            raise InputError(f"tenants[{i}] ({s.name}): kv_share {s.kv_share} of the pool's {pool_blocks} KV blocks "
                             f"is less than one block; give it a larger share or kv_blocks")
    total = sum(out.values())
    if total > pool_blocks:
        parts = ", ".join(f"tenants[{i}].{'kv_blocks' if s.kv_blocks is not None else 'kv_share'} "
                          f"{s.kv_blocks if s.kv_blocks is not None else s.kv_share} ({s.name}: {out[s.name]})"
                          for i, s in enumerate(specs))
        raise InputError(f"tenants: the KV shares sum to {total} blocks, past the pool's {pool_blocks} ({parts}); "
                         f"lower them, or raise the pool (build.max_batch_size or build.max_seq_len, a rebuild)")
    out[DEFAULT_TENANT] = pool_blocks - total
    return out


def check_names(specs: Sequence[TenantSpec]) -> None:
    """Each tenant named once, none ``default`` (the unassigned remainder); an InputError otherwise."""
    names = [s.name for s in specs]
    if DEFAULT_TENANT in names or len(set(names)) != len(names):
        raise InputError(f"tenants: names must be unique and not {DEFAULT_TENANT!r} (the unassigned remainder), "
                         f"got {names}")


class TenantLimitError(Exception):
    """A tenant at its concurrency or token-rate limit: retry after ``retry_after_s`` (HTTP's Retry-After)."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass
class _Tenant:
    spec: TenantSpec
    quota_blocks: int
    reserved_blocks: int = 0
    in_flight: int = 0
    accepted: int = 0
    rejected: int = 0
    bucket: float = 0.0  # tokens left (tokens_per_minute)
    refilled_at: float = 0.0
    mean_request_s: float = 1.0  # a moving average of its requests' time in flight: concurrency's retry hint
    _started: dict = field(default_factory=dict)  # request key -> (time accepted, blocks reserved)


class TenantBook:
    """Each tenant's share and what it holds (thread-safe). ``pool_blocks``: the runtime's KV pool; ``slots``: the
    sequences it runs at once (None: no slot shares)."""

    def __init__(self, specs: Sequence[TenantSpec], pool_blocks: int, *, slots: Optional[int] = None,
                 clock: Callable[[], float] = time.monotonic):
        check_names(specs)
        blocks = resolve_blocks(specs, pool_blocks)
        self.clock, self.pool_blocks, self.slots = clock, pool_blocks, slots
        self._lock = threading.Lock()
        now = clock()
        self.tenants = {s.name: _Tenant(s, blocks[s.name], bucket=float(s.tokens_per_minute or 0), refilled_at=now)
                        for s in specs}
        self.tenants[DEFAULT_TENANT] = _Tenant(TenantSpec(DEFAULT_TENANT), blocks[DEFAULT_TENANT], refilled_at=now)

    def resolve(self, name: Optional[str]) -> str:
        """The tenant a request names (none or empty: ``default``); an unknown one is an InputError."""
        name = name or DEFAULT_TENANT
        named = sorted(n for n in self.tenants if n != DEFAULT_TENANT)
        if name not in self.tenants:
            raise InputError(f"unknown tenant {name!r}: this deployment serves {', '.join(named)} (or no tenant "
                             f"named: the default tenant)")
        if self.tenants[name].quota_blocks == 0:
            raise InputError(f"every KV block is assigned to a named tenant: name one of {', '.join(named)} in the "
                             f"request's tenant input")
        return name

    def slot_share(self, name: str) -> Optional[int]:
        """The running slots tenant ``name`` is owed: its share of the blocks, of the slots, rounded down, at least
        one (none for a tenant with no blocks); None without slot shares."""
        if self.slots is None:
            return None
        quota = self.tenants[name].quota_blocks
        return max(1, self.slots * quota // self.pool_blocks) if quota else 0

    def accept(self, name: str, key: object, tokens: int, full_blocks: int) -> None:
        """Count a submitted request in (``tokens``: prompt plus max tokens; ``full_blocks``: its blocks at that
        length), or refuse it: InputError where its share could never hold it, TenantLimitError at a limit."""
        with self._lock:
            t = self.tenants[name]
            if full_blocks > t.quota_blocks:
                raise InputError(f"the request needs {full_blocks} KV blocks at its full length, more than tenant "
                                 f"{name}'s share of {t.quota_blocks}: send a shorter prompt or fewer max tokens")
            rate = t.spec.tokens_per_minute
            if rate is not None and tokens > rate:
                raise InputError(f"the request's {tokens} tokens (prompt plus max tokens) exceed tenant {name}'s "
                                 f"tokens_per_minute of {rate}: it could never be admitted")
            try:
                if t.spec.max_concurrency is not None and t.in_flight >= t.spec.max_concurrency:
                    raise TenantLimitError(f"tenant {name} has {t.in_flight} requests in flight, its max_concurrency",
                                           max(1, math.ceil(t.mean_request_s)))
                if rate is not None:
                    now = self.clock()
                    t.bucket = min(float(rate), t.bucket + (now - t.refilled_at) * rate / RATE_WINDOW_S)
                    t.refilled_at = now
                    if tokens > t.bucket:
                        wait = (tokens - t.bucket) * RATE_WINDOW_S / rate
                        raise TenantLimitError(f"tenant {name} is past its tokens_per_minute of {rate}",
                                               max(1, math.ceil(wait)))
                    t.bucket -= tokens
            except TenantLimitError:
                t.rejected += 1
                raise
            t.in_flight += 1
            t.accepted += 1
            t._started[key] = (self.clock(), 0)

    def fits(self, name: str, full_blocks: int) -> bool:
        with self._lock:
            t = self.tenants[name]
            return t.reserved_blocks + full_blocks <= t.quota_blocks

    def reserve(self, name: str, key: object, full_blocks: int) -> None:
        """An accepted request admitted to run: its full length's blocks are its tenant's until it finishes."""
        with self._lock:
            t = self.tenants[name]
            started, held = t._started[key]
            t.reserved_blocks += full_blocks - held
            t._started[key] = (started, full_blocks)

    def finish(self, name: str, key: object) -> None:
        """A request ended (answered, cancelled or failed): its blocks and its place in flight come back."""
        with self._lock:
            t = self.tenants[name]
            if key not in t._started:
                return
            started, held = t._started.pop(key)
            t.reserved_blocks -= held
            t.in_flight -= 1
            t.mean_request_s = 0.8 * t.mean_request_s + 0.2 * (self.clock() - started)

    def stats(self) -> dict[str, dict[str, int]]:
        """{tenant: quota_blocks, reserved_blocks, in_flight, accepted, rejected}."""
        with self._lock:
            return {n: {"quota_blocks": t.quota_blocks, "reserved_blocks": t.reserved_blocks,
                        "in_flight": t.in_flight, "accepted": t.accepted, "rejected": t.rejected}
                    for n, t in self.tenants.items()}


@dataclass
class _Waiting:
    tenant: str
    key: object
    blocks: int
    priority: int  # the request class, 1 the highest (0: none)
    order: int  # arrival
    start: Callable[[], None]


class TenantGate:
    """A book's admission in front of an engine that schedules on its own (vLLM): ``submit`` counts a request in
    (``TenantBook.accept``, which may refuse it) and hands it to the engine (its ``start``) once the blocks of its
    full length fit its tenant's share beside those its tenant's started requests hold, and the engine runs fewer
    than the book's ``slots`` (its max sequences: more would wait in the engine's own queue, first come first
    served, where one tenant's requests could keep another's waiting). A freed slot goes to the waiting request of
    a tenant below its slot share first (``TenantBook.slot_share``), then by request class, then by arrival; and a
    tenant at its slot share takes a slot only while another stays free, so that a tenant below its share finds one
    at once. Nothing is paused: a started request runs to its end (the cpu runtime pauses one instead, and keeps no
    slot free). ``finish`` when a started request ends, ``cancel`` for one that may still wait.
    ``block_tokens``: the engine's tokens per KV block."""

    def __init__(self, book: TenantBook, block_tokens: int):
        self.book, self.block_tokens = book, block_tokens
        self._lock = threading.Lock()
        self._waiting: list[_Waiting] = []
        self._started: dict[object, str] = {}  # the requests the engine has: key -> tenant
        self._order = itertools.count()

    def blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_tokens)

    def submit(self, tenant: Optional[str], key: object, *, tokens: int, priority: int,
               start: Callable[[], None]) -> str:
        """Count in a request of ``tokens`` (prompt plus max tokens) and start it now or once it fits; returns its
        tenant. InputError / TenantLimitError as ``TenantBook.resolve`` and ``accept`` raise them."""
        name = self.book.resolve(tenant)
        blocks = self.blocks(tokens)
        self.book.accept(name, key, tokens, blocks)
        with self._lock:
            self._waiting.append(_Waiting(name, key, blocks, priority, next(self._order), start))
            ready = self._admit()
        for w in ready:
            w.start()
        return name

    def cancel(self, tenant: str, key: object) -> bool:
        """A request cancelled while it waits leaves the gate (its place in flight back); False: it has started, and
        the engine must abort it (``finish`` follows when it ends)."""
        with self._lock:
            found = next((w for w in self._waiting if w.key == key), None)
            if found is None:
                return False
            self._waiting.remove(found)
        self.book.finish(tenant, key)
        return True

    def finish(self, key: object) -> None:
        """A started request ended (answered, aborted or failed): its blocks and slot come back, and the waiting
        requests that fit now start. Told twice, it counts once."""
        with self._lock:
            tenant = self._started.pop(key, None)
        if tenant is None:
            return
        self.book.finish(tenant, key)
        with self._lock:
            ready = self._admit()
        for w in ready:
            w.start()

    def waiting(self) -> int:
        with self._lock:
            return len(self._waiting)

    def waiting_by_tenant(self) -> dict[str, int]:
        """{tenant: its requests waiting in the gate}, the tenants with none left out."""
        with self._lock:
            counts: dict[str, int] = {}
            for w in self._waiting:
                counts[w.tenant] = counts.get(w.tenant, 0) + 1
            return counts

    def _owed_a_slot(self, tenant: str) -> bool:
        """Whether ``tenant`` has fewer started requests than its slot share (always, without slots)."""
        share = self.book.slot_share(tenant)
        return share is None or sum(1 for t in self._started.values() if t == tenant) < share

    def _admit(self) -> list[_Waiting]:
        """The waiting requests to start now, their blocks reserved (the gate's lock held)."""
        ready = []
        slots = self.book.slots
        while slots is None or len(self._started) < slots:
            owed = {t: self._owed_a_slot(t) for t in {w.tenant for w in self._waiting}}
            # a tenant at its slot share takes a slot only while another stays free, for a tenant below its own
            fitting = [w for w in self._waiting if self.book.fits(w.tenant, w.blocks)
                       and (owed[w.tenant] or slots is None or len(self._started) < slots - 1)]
            if not fitting:
                break
            best = min(fitting, key=lambda w: (not owed[w.tenant], w.priority or math.inf, w.order))
            self._waiting.remove(best)
            self.book.reserve(best.tenant, best.key, best.blocks)
            self._started[best.key] = best.tenant
            ready.append(best)
        return ready
