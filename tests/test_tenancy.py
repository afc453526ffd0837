"""pipeline/tenancy.py on its own: shares resolved against a pool, the book's admission, limits and their retry
hints. The cpu runtime holding real requests to it: tests/engines/test_cpu_runtime.py; through Triton:
tests/serving/test_tenants.py."""

from __future__ import annotations

import pytest

from pipeline.errors import InputError
from pipeline.tenancy import DEFAULT_TENANT, TenantBook, TenantGate, TenantLimitError, TenantSpec, resolve_blocks


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_shares_round_down_and_the_default_tenant_takes_the_rest():
    got = resolve_blocks([TenantSpec("a", kv_share=0.5), TenantSpec("b", kv_blocks=10)], 41)
    assert got == {"a": 20, "b": 10, DEFAULT_TENANT: 11}


@pytest.mark.parametrize("specs, match", [
    ([TenantSpec("a", kv_share=0.75), TenantSpec("b", kv_blocks=30)],
     r"sum to 105 blocks, past the pool's 100 \(tenants\[0\]\.kv_share 0\.75 \(a: 75\), tenants\[1\]\.kv_blocks 30"),
    ([TenantSpec("a", kv_share=0.001)], r"tenants\[0\] \(a\): kv_share 0\.001 of the pool's 100 KV blocks is less "
                                        r"than one block"),
])
def test_shares_past_the_pool_are_refused_naming_each_field(specs, match):
    with pytest.raises(InputError, match=match):
        resolve_blocks(specs, 100)


def test_names_must_be_unique_and_not_the_default_tenants():
    for names in (["a", "a"], ["default"]):
        with pytest.raises(InputError, match="names must be unique and not 'default'"):
            TenantBook([TenantSpec(n, kv_blocks=1) for n in names], 10)


def test_a_tenant_is_admitted_within_its_share_and_gets_its_blocks_back():
    book = TenantBook([TenantSpec("a", kv_blocks=10)], 30)
    assert book.resolve("a") == "a" and book.resolve(None) == book.resolve("") == DEFAULT_TENANT
    with pytest.raises(InputError, match=r"unknown tenant 'z': this deployment serves a \(or no tenant named"):
        book.resolve("z")
    with pytest.raises(InputError, match="needs 11 KV blocks at its full length, more than tenant a's share of 10"):
        book.accept("a", 0, 44, 11)
    for key in (1, 2):
        book.accept("a", key, 24, 6)
    book.reserve("a", 1, 6)
    assert book.fits("a", 4) and not book.fits("a", 5)  # 6 + 5 > 10: request 2 waits
    assert book.stats()["a"] == {"quota_blocks": 10, "reserved_blocks": 6, "in_flight": 2, "accepted": 2,
                                 "rejected": 0}
    book.finish("a", 1)
    book.finish("a", 1)  # told twice (a request ends once): counted once
    assert book.fits("a", 6) and book.stats()["a"]["reserved_blocks"] == 0 and book.stats()["a"]["in_flight"] == 1
    assert book.stats()[DEFAULT_TENANT]["quota_blocks"] == 20


def test_every_block_assigned_leaves_requests_that_name_no_tenant_nowhere_to_go():
    book = TenantBook([TenantSpec("a", kv_share=1.0)], 8)
    with pytest.raises(InputError, match="every KV block is assigned to a named tenant: name one of a"):
        book.resolve(None)


def test_concurrency_limit_refuses_with_a_retry_hint_and_counts_the_rejection():
    clock = Clock()
    book = TenantBook([TenantSpec("a", kv_blocks=10, max_concurrency=2)], 10, clock=clock)
    book.accept("a", 1, 8, 2)
    book.accept("a", 2, 8, 2)
    with pytest.raises(TenantLimitError, match="tenant a has 2 requests in flight, its max_concurrency") as e:
        book.accept("a", 3, 8, 2)
    assert e.value.retry_after_s >= 1
    clock.t += 10.0  # request 1 took 10 s: the hint follows the tenant's request times
    book.finish("a", 1)
    book.accept("a", 3, 8, 2)
    with pytest.raises(TenantLimitError) as e:
        book.accept("a", 4, 8, 2)
    assert e.value.retry_after_s == 3  # 0.8 x 1 s + 0.2 x 10 s, rounded up
    assert book.stats()["a"]["rejected"] == 2 and book.stats()["a"]["accepted"] == 3


def test_token_rate_is_a_bucket_of_a_minutes_tokens_and_says_when_enough_has_refilled():
    clock = Clock()
    book = TenantBook([TenantSpec("a", kv_blocks=10, tokens_per_minute=600)], 10, clock=clock)
    with pytest.raises(InputError, match="601 tokens .* exceed tenant a's tokens_per_minute of 600"):
        book.accept("a", 0, 601, 1)
    book.accept("a", 1, 500, 1)
    with pytest.raises(TenantLimitError, match="past its tokens_per_minute of 600") as e:
        book.accept("a", 2, 200, 1)  # 100 left; 100 more refill in 10 s
    assert e.value.retry_after_s == 10
    clock.t += 10.0
    book.accept("a", 2, 200, 1)
    clock.t += 1000.0
    book.accept("a", 3, 600, 1)  # refilled to the bucket's size, no more
    with pytest.raises(TenantLimitError):
        book.accept("a", 4, 1, 1)


def test_a_tenant_is_owed_its_share_of_the_slots_at_least_one():
    book = TenantBook([TenantSpec("a", kv_share=0.75), TenantSpec("b", kv_blocks=3)], 100, slots=8)
    assert {n: book.slot_share(n) for n in book.tenants} == {"a": 6, "b": 1, DEFAULT_TENANT: 1}
    assert TenantBook([TenantSpec("a", kv_share=1.0)], 100, slots=8).slot_share(DEFAULT_TENANT) == 0
    assert TenantBook([TenantSpec("a", kv_share=0.5)], 100).slot_share("a") is None  # no slots given


def test_the_gate_starts_a_request_once_its_blocks_fit_and_keeps_a_slot_for_a_tenant_below_its_share():
    """TenantGate (admission in front of vLLM): a tenant's requests start while their full-length blocks fit its
    share and the engine has a free slot; a tenant at its slot share leaves one slot free, so another tenant's
    request starts at once; a freed slot goes to the tenant below its slot share, whatever arrived first; a request
    cancelled while waiting leaves without starting; refusals are the book's."""
    book = TenantBook([TenantSpec("a", kv_blocks=8), TenantSpec("b", kv_blocks=8, max_concurrency=2)], 20, slots=3)
    gate = TenantGate(book, block_tokens=16)
    assert book.slot_share("a") == book.slot_share("b") == 1
    started: list[str] = []

    def submit(tenant, key, tokens, priority=0):
        return gate.submit(tenant, key, tokens=tokens, priority=priority, start=lambda: started.append(key))

    assert submit("a", "a1", 40) == "a"  # 3 blocks
    assert submit("a", "a2", 40) == "a"  # 6 of a's 8; past its slot share, one slot stays free
    submit("a", "a3", 40)  # would fit a slot, not a's share (9 > 8)
    submit("a", "a4", 16)  # 1 block: fits a's share; the last free slot is kept
    assert started == ["a1", "a2"] and gate.waiting() == 2
    assert book.stats()["a"]["reserved_blocks"] == 6
    submit("b", "b1", 100)  # 7 blocks: takes the free slot at once
    submit("b", "b2", 16)  # 1 block, no slot: waits
    assert started == ["a1", "a2", "b1"]
    with pytest.raises(TenantLimitError, match="max_concurrency"):
        submit("b", "b3", 16)
    with pytest.raises(InputError, match="unknown tenant 'z'"):
        submit("z", "z1", 16)
    gate.finish("a1")  # a slot frees and stays free: a and b each hold their slot share (1)
    assert started == ["a1", "a2", "b1"] and gate.waiting() == 3  # a3, a4, b2
    gate.finish("a1")  # told twice: counted once
    assert book.stats()["a"]["reserved_blocks"] == 3
    assert gate.cancel("a", "a3") and not gate.cancel("a", "a2")  # a3 waited: gone; a2 runs: the engine aborts it
    assert book.stats()["a"]["in_flight"] == 2  # a2 runs, a4 waits (a1 ended, a3 cancelled)
    gate.finish("a2")  # now a is below its share: a4, which came before b2, starts
    assert started == ["a1", "a2", "b1", "a4"] and gate.waiting() == 1
    gate.finish("b1")  # and b is: b2 starts
    assert started[-1] == "b2" and gate.waiting() == 0
    gate.finish("a4")
    gate.finish("b2")
    assert book.stats()["b"] == {"quota_blocks": 8, "reserved_blocks": 0, "in_flight": 0, "accepted": 2,
                                 "rejected": 1}
