"""pipeline/tenancy.py on its own: shares resolved against a pool, the book's admission, limits and their retry
hints. The cpu runtime holding real requests to it: tests/engines/test_cpu_runtime.py; through Triton:
tests/serving/test_tenants.py."""

from __future__ import annotations

import pytest

from pipeline.errors import InputError
from pipeline.tenancy import DEFAULT_TENANT, TenantBook, TenantLimitError, TenantSpec, resolve_blocks


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
