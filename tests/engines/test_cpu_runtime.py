"""The cpu target's reference runtime on a tiny real Llama: the paged quantized KV pool, greedy tokens equal
to the plain reference (solo and batched), streaming, cancel, continuous batching, input checks, and the
build stage that assembles the bundle."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from conftest import tiny_config

from pipeline.config import load_config
from pipeline.engines import reference
from pipeline.engines.cpu_runtime import AdaptiveBatchLimit, CpuRuntime, KVBlockPool, SamplingParams
from pipeline.errors import InputError
from pipeline.quant import quant_math as qm
from pipeline.runner import Runner
from pipeline.stages import STAGES
from pipeline.tenancy import TenantLimitError, TenantSpec

pytest.importorskip("modelopt.torch.quantization")


# ---------------------------------------------------------------- the block pool


def _kv(t, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, t, 8, generator=g) * 3, torch.randn(2, t, 8, generator=g)


@pytest.mark.parametrize("algo", [None, "INT8", "FP8"])
def test_pool_round_trip_across_blocks(algo):
    scales = [0.05, 0.02]
    pool = KVBlockPool(2, kv_heads=2, head_dim=8, tokens_per_block=4, num_blocks=8, quant_algo=algo,
                       scales=scales if algo else None)
    table = pool.allocate(3)  # 12 positions, written as 5 + 1 + 4 (crossing block edges)
    k, v = _kv(10)
    pool.write(1, table, 0, k[:, :5], v[:, :5])
    pool.write(1, table, 5, k[:, 5:6], v[:, 5:6])
    pool.write(1, table, 6, k[:, 6:], v[:, 6:])
    rk, rv = pool.read(1, table, 10)
    if algo is None:
        assert torch.equal(rk, k) and torch.equal(rv, v)
    elif algo == "INT8":  # codes round(x / scale), saturating at +-127 (KVBlockPool says why not at -128)
        assert pool.k[1].dtype == torch.int8
        for got, x in ((rk, k), (rv, v)):
            assert torch.allclose(got, torch.clamp(torch.round(x / scales[1]), -127, 127) * scales[1], atol=1e-6)
        assert float((k / scales[1]).min()) < -128 and float(rk.min()) == pytest.approx(-127 * scales[1])
    else:
        assert pool.k[1].dtype == torch.float8_e4m3fn
        assert torch.allclose(rk, qm.fp8_fake_quant(k, torch.tensor(scales[1] * 448)), rtol=1e-6, atol=1e-7)
    other = pool.allocate(1)  # another sequence's block is untouched by this one's writes
    assert other[0] not in table


def test_an_hf_unified_checkpoints_kv_scale_is_the_larger_of_k_and_v_per_layer(tmp_path):
    """The HF unified checkpoint keeps a layer's K and V scales apart; the runtime's one scale per layer is the
    larger (as ModelOpt's TensorRT-LLM export joins them), and a layer missing one is refused."""
    from safetensors.torch import save_file

    from pipeline.engines.cpu_runtime import kv_cache_algo, kv_cache_scales
    from pipeline.errors import IntegrityError

    (tmp_path / "hf_quant_config.json").write_text(json.dumps({"quantization": {"kv_cache_quant_algo": "FP8"}}))
    held = {"model.layers.0.self_attn.k_proj.k_scale": 1.5, "model.layers.0.self_attn.v_proj.v_scale": 1.0,
            "model.layers.1.self_attn.k_proj.k_scale": 1.0, "model.layers.1.self_attn.v_proj.v_scale": 2.25}
    save_file({k: torch.tensor(v) for k, v in held.items()}, str(tmp_path / "model.safetensors"))
    assert kv_cache_algo(tmp_path) == "FP8"
    assert kv_cache_scales(tmp_path, 2) == [1.5, 2.25]
    with pytest.raises(IntegrityError, match="a k_scale and a v_scale in each of the 3 layers"):
        kv_cache_scales(tmp_path, 3)


def test_pool_sizes_allocation_and_release():
    fp32 = KVBlockPool(3, kv_heads=2, head_dim=8, tokens_per_block=4, num_blocks=10, quant_algo=None)
    int8 = KVBlockPool(3, kv_heads=2, head_dim=8, tokens_per_block=4, num_blocks=10, quant_algo="INT8",
                       scales=[0.1] * 3)
    assert fp32.bytes == 4 * int8.bytes == 2 * 3 * 10 * 4 * 2 * 8 * 4
    a = int8.allocate(6)
    assert int8.free_blocks == 4
    with pytest.raises(RuntimeError, match="exhausted"):
        int8.allocate(5)
    int8.release(a)
    assert int8.free_blocks == 10 and len(set(int8.allocate(10))) == 10


def test_pool_refuses_missing_scales():
    from pipeline.errors import IntegrityError

    with pytest.raises(IntegrityError, match="one scaling factor per layer"):
        KVBlockPool(3, kv_heads=2, head_dim=8, tokens_per_block=4, num_blocks=10, quant_algo="INT8", scales=[0.1])


# ---------------------------------------------------------------- a real bundle of the tiny model


@pytest.fixture(scope="module")
def bundle(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("cpu_bundle")
    cfg = tiny_config(tmp, tiny_model_dir,
                      "quantization: {kv_cache: int8, accuracy: {max_perplexity_increase_pct: 100, "
                      "min_top1_agreement: 0.3, max_kl_divergence: 2}}")
    said = []
    Runner(load_config(cfg, ["build.kv_cache.tokens_per_block=4"]), STAGES, tmp / "work").run(["build"],
                                                                                             echo=said.append)
    out = tmp / "work" / "tiny" / "build"
    return out


@pytest.fixture(scope="module")
def runtime(bundle):
    with CpuRuntime.load(bundle / "cpu_bundle") as rt:
        yield rt


@pytest.fixture(scope="module")
def ref(bundle):
    return reference.load_reference(bundle / "cpu_bundle")


PROMPTS = [[5, 17, 99, 3, 250, 41, 7], [300, 12], [8, 8, 8, 9, 10, 11, 400, 401, 402, 20, 21], [100],
           [45, 46, 47, 48, 49], [200, 199, 198, 197, 196, 195]]


def test_build_writes_the_bundle_and_settings(bundle):
    settings = json.loads((bundle / "build_settings.json").read_text())
    assert settings["target"] == "cpu" and settings["artifact_dir"] == "cpu_bundle"
    assert settings["kv_cache"]["quant_algo"] == "INT8" and settings["kv_cache"]["tokens_per_block"] == 4
    assert settings["max_batch_size"] == 4 and settings["max_seq_len"] == 128
    runtime = json.loads((bundle / "cpu_bundle" / "runtime.json").read_text())
    assert runtime["num_blocks"] == 4 * 128 // 4
    assert not list((bundle / "cpu_bundle" / "model").glob("*.safetensors"))  # weights come from the checkpoint
    from pipeline.engines.build import checkpoint_sha256

    assert settings["checkpoint_sha256"] == checkpoint_sha256(bundle / "cpu_bundle" / "checkpoint")
    summary = json.loads((bundle / "manifest.json").read_text())["summary"]
    assert len(summary["smoke_test"]["output_ids"]) >= 1


def test_greedy_equals_the_reference_solo_and_batched(runtime, ref):
    model, algo, scales = ref
    assert algo == "INT8"
    params = SamplingParams(max_new_tokens=12, end_id=-1)
    solo = [runtime.generate(p, params) for p in PROMPTS]
    batched = [r.result(timeout=120) for r in [runtime.submit(p, params) for p in PROMPTS]]
    for p, s, b in zip(PROMPTS, solo, batched):
        want = reference.greedy(model, p, max_new_tokens=12, kv_quant_algo=algo, kv_scales=scales)
        assert reference.compare(s, want)["equal"], (p, s, want.tokens)  # batch of one: same arithmetic
        check = reference.compare(b, want)
        assert check["ok"], (p, b, want.tokens, check)


def test_the_runtime_stores_int8_codes_with_the_checkpoint_scales(bundle, runtime, ref):
    """The pool holds 1-byte codes scaled by the checkpoint's kv_cache_scaling_factor, and that quantization
    changes what the model computes (so the token-equality test above can tell a quantized cache from not)."""
    from pipeline.engines.cpu_runtime import kv_cache_scales

    model, algo, scales = ref
    assert runtime.pool.quant_algo == "INT8" and runtime.pool.k[0].dtype == torch.int8
    assert [float(s) for s in runtime.pool.scales] == pytest.approx(
        kv_cache_scales(bundle / "cpu_bundle" / "checkpoint", len(scales)))
    with CpuRuntime.load(bundle / "cpu_bundle", quantize_kv_cache=False) as fp32:
        assert fp32.pool.k[0].dtype == torch.float32 and runtime.pool.bytes * 4 == fp32.pool.bytes
    with_q = [reference.greedy(model, p, max_new_tokens=12, kv_quant_algo=algo,
                               kv_scales=scales).logits for p in PROMPTS[:3]]
    without = [reference.greedy(model, p, max_new_tokens=12).logits for p in PROMPTS[:3]]
    diff = max(float((a[-1] - b[-1]).abs().max()) for a, b in zip(with_q, without))
    assert diff > 1e-4


def test_stream_cancel_and_continuous_batching(runtime):
    long = runtime.submit(PROMPTS[0], SamplingParams(max_new_tokens=60, end_id=-1))
    stream = long.stream()
    first = [next(stream) for _ in range(3)]  # the long request is decoding
    before = dict(runtime.steps)
    short = runtime.submit(PROMPTS[1], SamplingParams(max_new_tokens=4, end_id=-1))
    assert len(short.result(timeout=60)) == 4 and short.finish_reason == "length"
    assert not long.done  # the short one joined the running batch and left it first
    after = runtime.steps
    assert after["decode_sequences"] - before["decode_sequences"] > after["decode"] - before["decode"]
    long.cancel()
    rest = list(stream)
    assert long.finish_reason == "cancelled" and first + rest == long.output_ids and len(long.output_ids) < 60
    # the runtime keeps serving after a cancel, and freed the blocks
    assert runtime.generate(PROMPTS[3], SamplingParams(max_new_tokens=3, end_id=-1))
    assert runtime.pool.free_blocks == runtime.pool.num_blocks


def test_stop_tokens_and_seeded_sampling(runtime):
    first = runtime.generate(PROMPTS[2], SamplingParams(max_new_tokens=5, end_id=-1))
    stopped = runtime.submit(PROMPTS[2], SamplingParams(max_new_tokens=5, end_id=-1, stop_token_ids=(first[1],)))
    assert stopped.result(timeout=60) == first[:2] and stopped.finish_reason == "stop"
    sampled = [runtime.generate(PROMPTS[0], SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.9, seed=s,
                                                           end_id=-1)) for s in (3, 3, 4)]
    assert sampled[0] == sampled[1] and sampled[0] != sampled[2]


@pytest.mark.parametrize("prompt,params,match", [
    ([], SamplingParams(), "empty"),
    (list(range(65)), SamplingParams(), "max_input_len=64"),
    ([1] * 60, SamplingParams(max_new_tokens=100), "exceeds max_seq_len=128"),
    ([1, 99999], SamplingParams(), "outside the vocabulary"),
    ([1], SamplingParams(max_new_tokens=0), "at least 1"),
    ([1], SamplingParams(top_p=0), "top_p"),
    ([1], SamplingParams(temperature=-1), "temperature"),
])
def test_bad_requests_are_refused_and_the_runtime_keeps_serving(runtime, prompt, params, match):
    with pytest.raises(InputError, match=match):
        runtime.submit(prompt, params)
    assert len(runtime.generate([1, 2, 3], SamplingParams(max_new_tokens=2, end_id=-1))) == 2


def test_many_threads_submitting_at_once(runtime):
    results = {}

    def worker(i):
        results[i] = runtime.generate(PROMPTS[i % len(PROMPTS)], SamplingParams(max_new_tokens=6, end_id=-1))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(10)]  # more than max_batch_size
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert sorted(results) == list(range(10)) and all(len(v) == 6 for v in results.values())


# ---------------------------------------------------------------- the adaptive batch limit


def test_adaptive_limit_halves_above_the_target_and_grows_by_one_below_while_it_binds():
    c = AdaptiveBatchLimit(target_ms=100, max_batch_size=8)
    assert c.observe(200, running=8) == 4  # 200 > 1.1 x 100: halve, and start the average again
    assert c.observe(105, running=4) == 4  # within the band (90..110): keep
    assert c.observe(150, running=4) == 2  # average 0.3 x 150 + 0.7 x 105 = 118.5 > 110
    assert c.observe(50, running=1) == 2  # fast, but the limit is not what holds sequences back: keep
    assert c.observe(50, running=2) == 3  # fast while binding: one more
    assert c.observe(80, running=3) == 4
    for _ in range(10):
        c.observe(10, running=c.limit)
    assert c.limit == 8  # never past max_batch_size
    for _ in range(10):
        c.observe(1000, running=c.limit)
    assert c.limit == 1 and c.changes == 4 + 4 + 3  # never below one sequence
    with pytest.raises(InputError, match="positive step-latency target"):
        AdaptiveBatchLimit(target_ms=0, max_batch_size=8)


def test_with_chunked_prefill_the_adaptive_limit_moves_the_chunk_first():
    """Over the target the prompt chunk halves (down to its base) before the batch limit does; under it, while
    prompts wait, the chunk grows by one token (up to max_chunk) before the limit grows."""
    c = AdaptiveBatchLimit(target_ms=100, max_batch_size=8, chunk=8, max_chunk=11)
    assert c.observe(50, running=8, prefill_waiting=True) == 8 and c.chunk == 9  # slack goes to the prefill
    c.observe(50, running=8, prefill_waiting=True)
    c.observe(50, running=8, prefill_waiting=True)
    assert c.chunk == 11
    assert c.observe(50, running=8, prefill_waiting=True) == 8 and c.chunk == 11  # at max_chunk: nothing to grow
    # over (the average: 0.3 x 500 + 0.7 x 50 = 185): the chunk halves, to its base 8
    assert c.observe(500, running=8, prefill_waiting=True) == 8 and c.chunk == 8
    assert c.observe(200, running=8, prefill_waiting=True) == 4 and c.chunk == 8  # at its base: the limit halves
    assert c.observe(50, running=4, prefill_waiting=False) == 5 and c.chunk == 8  # nothing to prefill: the limit
    assert AdaptiveBatchLimit(target_ms=100, max_batch_size=8).chunk is None  # whole prompts: no chunk to move


def test_adaptive_runtime_runs_one_sequence_at_a_time_under_an_unreachable_target(bundle):
    """A step target no step can meet: after the first burst (admitted at max_batch_size, then never
    preempted) the limit falls to one, and the next burst decodes one sequence per step, with the same tokens
    as the plain runtime's solo runs."""
    params = SamplingParams(max_new_tokens=6, end_id=-1)
    with CpuRuntime.load(bundle / "cpu_bundle", adaptive_target_ms=1e-3) as rt:
        first = [rt.submit(p, params) for p in PROMPTS]
        [r.result(timeout=120) for r in first]
        assert rt.stats()["batch_limit"] == 1 and rt.adaptive.changes >= 2
        before = dict(rt.steps)
        second = [rt.submit(p, params) for p in PROMPTS[:3]]
        got = [r.result(timeout=120) for r in second]
        decodes = rt.steps["decode"] - before["decode"]
        assert rt.steps["decode_sequences"] - before["decode_sequences"] == decodes  # one sequence a step
    with CpuRuntime.load(bundle / "cpu_bundle") as plain:
        assert got == [plain.generate(p, params) for p in PROMPTS[:3]]


def test_max_running_caps_the_sequences_decoded_together_and_sizes_the_pool(bundle, runtime):
    """triton.max_running 2 on a build for more: no decode step runs more than two sequences, the pool holds
    two sequences' share of the build's blocks, the tokens are the plain runtime's; above the build's limit
    it is refused."""
    params = SamplingParams(max_new_tokens=6, end_id=-1)
    settings = json.loads((bundle / "cpu_bundle" / "runtime.json").read_text())
    assert settings["max_batch_size"] > 2
    with CpuRuntime.load(bundle / "cpu_bundle", max_running=2) as rt:
        assert rt.stats()["requests_max"] == 2 and rt.stats()["batch_limit"] == 2
        assert rt.pool.num_blocks == -(-settings["num_blocks"] * 2 // settings["max_batch_size"])
        seen = []
        reqs = [rt.submit(p, params) for p in PROMPTS]
        while not all(r.done for r in reqs):
            seen.append(len(rt._running))
            time.sleep(0.005)
        got = [r.result(timeout=120) for r in reqs]
        assert max(seen) <= 2 < len(PROMPTS)
        assert rt.steps["decode_sequences"] <= 2 * rt.steps["decode"]
        assert rt.steps["decode_sequences"] > rt.steps["decode"]  # two did run together
    assert got == [runtime.generate(p, params) for p in PROMPTS]
    with pytest.raises(InputError, match=r"max_running 99 is outside 1\.\.\d+ \(the build's max_batch_size\)"):
        CpuRuntime.load(bundle / "cpu_bundle", max_running=99)


def test_chunked_prefill_gives_the_whole_prompts_tokens_and_interleaves_with_decoding(bundle, runtime, ref):
    """prefill_chunk 3: a prompt goes through the model 3 tokens a step, packed into one forward with the
    running sequences' next tokens, each token attending to its own sequence's K/V in the pool. With an fp32
    cache the greedy tokens are the whole-prompt prefill's; with the INT8 cache they agree with the reference as
    the whole-prompt runtime does. A sequence already decoding gets a token in every step the new prompt's
    chunks take, and those steps are one forward each."""
    model, algo, scales = ref
    params = SamplingParams(max_new_tokens=8, end_id=-1)
    with CpuRuntime.load(bundle / "cpu_bundle", quantize_kv_cache=False) as whole, \
            CpuRuntime.load(bundle / "cpu_bundle", quantize_kv_cache=False, prefill_chunk=3) as chunked:
        assert [chunked.generate(p, params) for p in PROMPTS] == [whole.generate(p, params) for p in PROMPTS]
        assert chunked.steps["prefill_chunks"] == sum(-(-len(p) // 3) for p in PROMPTS)
        assert whole.steps["prefill"] == chunked.steps["prefill"] == len(PROMPTS)
        assert whole.steps["packed"] == 0 and whole.steps["prefill_chunks"] == 0
    with CpuRuntime.load(bundle / "cpu_bundle", prefill_chunk=3) as rt:
        for p in PROMPTS:
            check = reference.compare(rt.generate(p, params), reference.greedy(model, p, max_new_tokens=8,
                                                                               kv_quant_algo=algo, kv_scales=scales))
            assert check["ok"], (p, check)
        long = rt.submit(PROMPTS[0], SamplingParams(max_new_tokens=100, end_id=-1))
        stream = long.stream()
        next(stream)
        before, steps = len(long.output_ids), dict(rt.steps)
        new = rt.submit(PROMPTS[2], params)  # 11 tokens: four chunks, four steps
        next(new.stream())
        assert len(long.output_ids) - before >= 3
        assert rt.steps["prefill_chunks"] - steps["prefill_chunks"] == 4
        long.cancel()
        assert len(new.result(timeout=120)) == 8
        assert rt.pool.free_blocks == rt.pool.num_blocks
    with pytest.raises(InputError, match="prefill_chunk must be a positive number"):
        CpuRuntime.load(bundle / "cpu_bundle", prefill_chunk=0)



def _by_first_token(reqs: dict) -> list:
    """The names of finished ``reqs`` ({name: Request}) in the order their first tokens came out."""
    return sorted(reqs, key=lambda name: reqs[name].first_token_at)


def test_a_more_urgent_request_is_admitted_before_earlier_ones_and_gets_the_same_tokens(bundle, runtime):
    """One sequence at a time (max_running 1), the slot held by a long request: two requests of priority 2
    queue, then one of priority 1 (the lower, the sooner). When the slot frees, the urgent one runs first, then
    the others first come, first served; with equal priorities the order is arrival. Priorities change when a
    request runs, not its tokens."""
    params = SamplingParams(max_new_tokens=4, end_id=-1)
    for priorities, expected in (((2, 2, 1), ["urgent", "first", "second"]),
                                 ((2, 2, 2), ["first", "second", "urgent"])):
        with CpuRuntime.load(bundle / "cpu_bundle", max_running=1) as rt:
            hog = rt.submit(PROMPTS[0], SamplingParams(max_new_tokens=100, end_id=-1))
            next(hog.stream())  # it runs: the others wait for its slot
            reqs = {name: rt.submit(PROMPTS[i], params, priority=p)
                    for i, (name, p) in enumerate(zip(("first", "second", "urgent"), priorities), start=1)}
            assert rt.stats()["requests_waiting"] == 3
            hog.cancel()
            got = {name: r.result(timeout=120) for name, r in reqs.items()}
            assert _by_first_token(reqs) == expected
        assert got == {name: runtime.generate(PROMPTS[i], params) for i, name in enumerate(got, start=1)}


def test_a_more_urgent_request_pauses_a_less_urgent_running_one_which_resumes_first(bundle, runtime):
    """Every slot taken (max_running 1) by a long request of priority 2, another of priority 2 waiting: a
    priority-1 request pauses the running one and is answered before it ends; the paused sequence then resumes
    ahead of the waiting request of its class, from the KV blocks it kept, so its tokens equal a solo run's.
    Equal classes never pause each other; a paused request that is cancelled gives its blocks back."""
    long, short = SamplingParams(max_new_tokens=100, end_id=-1), SamplingParams(max_new_tokens=4, end_id=-1)
    with CpuRuntime.load(bundle / "cpu_bundle", max_running=1) as rt:
        hog = rt.submit(PROMPTS[0], long, priority=2)
        next(hog.stream())
        with rt._lock:  # both queued before the scheduler looks again
            waiter = rt.submit(PROMPTS[3], short, priority=2)
            urgent = rt.submit(PROMPTS[1], short, priority=1)
        assert len(urgent.result(timeout=120)) == 4
        assert len(hog.output_ids) < 100  # answered while the long request was paused, not after it
        assert len(hog.result(timeout=120)) == 100 and len(waiter.result(timeout=120)) == 4
        assert urgent.finished_at < hog.finished_at < waiter.first_token_at
        assert rt.steps["paused"] == 1  # the waiter, of the hog's class, paused nothing
        assert hog.output_ids == runtime.generate(PROMPTS[0], long)
        assert urgent.output_ids == runtime.generate(PROMPTS[1], short)

        hog = rt.submit(PROMPTS[0], long, priority=2)
        next(hog.stream())
        urgent = rt.submit(PROMPTS[1], SamplingParams(max_new_tokens=16, end_id=-1), priority=1)
        next(urgent.stream())
        assert rt.stats()["requests_paused"] == 1
        hog.cancel()
        assert len(urgent.result(timeout=120)) == 16 and hog.result(timeout=120) and hog.finish_reason == "cancelled"
        assert rt.stats()["requests_paused"] == 0 and rt.pool.free_blocks == rt.pool.num_blocks


def test_an_urgent_request_longer_than_the_pool_beside_the_running_one_waits_for_it(bundle):
    """max_running 1: the pool holds one max_seq_len sequence (32 blocks of 4 tokens). A priority-1 request whose
    full length does not fit beside the running one's (27 + 16 blocks) waits for it instead of pausing it, and
    both are answered in full: admitted beside it, it would run the pool dry and fail every request in flight
    (seen as "KV block pool exhausted" through Triton). Then a paused sequence resumes where the most urgent
    waiting request does not fit beside it, so that request does not wait forever for the blocks it holds."""
    long = SamplingParams(max_new_tokens=100, end_id=-1)
    with CpuRuntime.load(bundle / "cpu_bundle", max_running=1) as rt:
        assert rt.pool.num_blocks == 32
        hog = rt.submit(PROMPTS[0], long, priority=2)
        next(hog.stream())
        urgent = rt.submit(PROMPTS[1], SamplingParams(max_new_tokens=60, end_id=-1), priority=1)
        assert len(hog.result(timeout=120)) == 100 and len(urgent.result(timeout=120)) == 60
        assert (hog.finish_reason, urgent.finish_reason) == ("length", "length")
        assert hog.finished_at < urgent.first_token_at and rt.steps["paused"] == 0

        hog = rt.submit(PROMPTS[0], long, priority=3)
        next(hog.stream())
        with rt._lock:  # both queued before the scheduler looks again
            short = rt.submit(PROMPTS[1], SamplingParams(max_new_tokens=4, end_id=-1), priority=1)
            big = rt.submit(PROMPTS[3], SamplingParams(max_new_tokens=60, end_id=-1), priority=1)
        assert len(short.result(timeout=120)) == 4  # it paused the hog; the big one fits beside neither
        assert len(big.result(timeout=120)) == 60 and len(hog.result(timeout=120)) == 100
        assert short.finished_at < hog.finished_at < big.first_token_at and rt.steps["paused"] == 1
        assert rt.pool.free_blocks == rt.pool.num_blocks


def test_with_chunked_prefill_a_more_urgent_prompt_is_prefilled_first(bundle):
    """prefill_chunk 2, both prompts admitted in one step: the chunks go to the urgent prompt first, so its
    first token comes out before the earlier, less urgent prompt's; without priorities the order is arrival."""
    params = SamplingParams(max_new_tokens=4, end_id=-1)
    with CpuRuntime.load(bundle / "cpu_bundle", prefill_chunk=2) as rt:
        for urgency, expected in ((1, ["urgent", "batch"]), (2, ["batch", "urgent"])):
            with rt._lock:  # both queued before the scheduler looks: admitted in one step
                reqs = {"batch": rt.submit(PROMPTS[2], params, 2), "urgent": rt.submit(PROMPTS[1], params, urgency)}
            assert [len(r.result(timeout=120)) for r in reqs.values()] == [4, 4]
            assert _by_first_token(reqs) == expected


# ---------------------------------------------------------------- tenants: the pool partitioned


def _held_by(rt: CpuRuntime, tenant: str) -> int:
    """KV blocks the tenant's sequences hold in the pool now."""
    with rt._lock:
        return sum(len(s.blocks) for s in rt._prefilling + rt._running + rt._paused if s.request.tenant == tenant)


def _flood_then_interactive(rt: CpuRuntime, **tenant_of) -> tuple[list, object, list[int]]:
    """Four long requests (27 blocks each at full length), then one short one, queued in one go; the most blocks
    the long ones' tenant held at once, sampled until all are answered."""
    long, short = SamplingParams(max_new_tokens=100, end_id=-1), SamplingParams(max_new_tokens=6, end_id=-1)
    with rt._lock:
        hogs = [rt.submit(PROMPTS[0], long, tenant=tenant_of.get("hogs")) for _ in range(4)]
        quick = rt.submit(PROMPTS[1], short, tenant=tenant_of.get("quick"))
    held = []
    while not all(r.done for r in [*hogs, quick]):
        held.append(_held_by(rt, tenant_of.get("hogs") or "default"))
        time.sleep(0.005)
    return hogs, quick, held


def test_a_tenant_never_holds_more_than_its_share_and_another_tenants_request_goes_past_its_queue(bundle, runtime):
    """A pool of 128 blocks (4 sequences of 32): tenant a has 40 blocks, room for one 107-token request (27 blocks)
    at a time; b a quarter. a floods with four; b's short request, queued behind them, is admitted at once and
    answered while a's first still runs. In one shared pool the four take every slot and the short request waits
    for the first to end. The answers are the plain runtime's either way, and every block comes back."""
    tenants = [TenantSpec("a", kv_blocks=40), TenantSpec("b", kv_share=0.25)]
    with CpuRuntime.load(bundle / "cpu_bundle", tenants=tenants) as rt:
        assert rt.pool.num_blocks == 128
        assert {n: t["quota_blocks"] for n, t in rt.stats()["tenants"].items()} == {"a": 40, "b": 32, "default": 56}
        hogs, quick, held = _flood_then_interactive(rt, hogs="a", quick="b")
        assert max(held) <= 40 and max(held) >= 26  # one at a time, at up to its full length
        assert quick.finished_at < hogs[0].finished_at
        assert all(hogs[i].finished_at < hogs[i + 1].first_token_at for i in range(3))
        got = [r.result() for r in [*hogs, quick]]
        stats = rt.stats()["tenants"]
        assert stats["a"] == {"quota_blocks": 40, "reserved_blocks": 0, "in_flight": 0, "accepted": 4, "rejected": 0}
        assert stats["b"]["accepted"] == 1 and rt.pool.free_blocks == rt.pool.num_blocks
    with CpuRuntime.load(bundle / "cpu_bundle") as shared:
        hogs, quick, held = _flood_then_interactive(shared)
        assert max(held) > 40 and quick.first_token_at > hogs[0].finished_at
    expected = runtime.generate(PROMPTS[0], SamplingParams(max_new_tokens=100, end_id=-1))
    assert got == [expected] * 4 + [runtime.generate(PROMPTS[1], SamplingParams(max_new_tokens=6, end_id=-1))]


def test_tenant_requests_are_refused_with_what_to_fix_or_when_to_retry(bundle, runtime):
    """An unknown tenant, a request the tenant's share could never hold, a tenant named where there are none: input
    errors. b at its max_concurrency: a TenantLimitError with a retry hint, counted; a request cancelled while it
    waits for its tenant's blocks gives its place back."""
    params = SamplingParams(max_new_tokens=6, end_id=-1)
    with pytest.raises(InputError, match="unknown tenant 'a': this deployment has no tenants"):
        runtime.submit(PROMPTS[1], params, tenant="a")
    tenants = [TenantSpec("a", kv_blocks=30), TenantSpec("b", kv_blocks=8, max_concurrency=1)]
    with CpuRuntime.load(bundle / "cpu_bundle", tenants=tenants) as rt:
        with pytest.raises(InputError, match=r"unknown tenant 'c': this deployment serves a, b"):
            rt.submit(PROMPTS[1], params, tenant="c")
        with pytest.raises(InputError, match="needs 27 KV blocks at its full length, more than tenant b's share of 8"):
            rt.submit(PROMPTS[0], SamplingParams(max_new_tokens=100, end_id=-1), tenant="b")
        with rt._lock:
            first = rt.submit(PROMPTS[1], params, tenant="b")
            with pytest.raises(TenantLimitError, match="tenant b has 1 requests in flight") as e:
                rt.submit(PROMPTS[1], params, tenant="b")
        assert e.value.retry_after_s >= 1 and len(first.result(timeout=60)) == 6
        assert len(rt.submit(PROMPTS[1], params, tenant="b").result(timeout=60)) == 6  # its place came back
        with rt._lock:
            running = rt.submit(PROMPTS[0], SamplingParams(max_new_tokens=80, end_id=-1), tenant="a")
            waiting = rt.submit(PROMPTS[0], SamplingParams(max_new_tokens=80, end_id=-1), tenant="a")
        next(running.stream())
        waiting.cancel()
        assert len(running.result(timeout=120)) == 80 and waiting.result(timeout=60) == []
        assert waiting.finish_reason == "cancelled"
        stats = rt.stats()["tenants"]
        assert (stats["b"]["accepted"], stats["b"]["rejected"]) == (2, 1)
        assert stats["a"]["in_flight"] == stats["a"]["reserved_blocks"] == 0


def test_a_tenant_whose_share_holds_more_requests_than_slots_leaves_another_its_slot(bundle):
    """max_running 4, a pool of 128 blocks: a's three quarters hold thirteen 27-token requests (7 blocks each), b's
    quarter is owed one of the four slots. Eight of a's and one of b's queued in one go: a's four fill the slots,
    and b's request pauses a's latest, so it is answered before any of a's; the paused one resumes and every answer
    is whole. With no tenants, the same request waits for one of a's to end."""
    long, short = SamplingParams(max_new_tokens=20, end_id=-1), SamplingParams(max_new_tokens=6, end_id=-1)
    tenants = [TenantSpec("a", kv_share=0.75), TenantSpec("b", kv_share=0.25)]
    for named in (True, False):
        with CpuRuntime.load(bundle / "cpu_bundle", max_running=4, tenants=tenants if named else ()) as rt:
            with rt._lock:
                flood = [rt.submit(PROMPTS[0], long, tenant="a" if named else None) for _ in range(8)]
                quick = rt.submit(PROMPTS[1], short, tenant="b" if named else None)
            assert [len(r.result(timeout=120)) for r in flood] == [20] * 8 and len(quick.result(timeout=60)) == 6
            first_done = min(r.finished_at for r in flood)
            if named:
                assert rt.tenants.slot_share("a") == 3 and rt.tenants.slot_share("b") == 1
                assert quick.finished_at < first_done and rt.steps["paused"] == 1
            else:
                assert quick.first_token_at > first_done and rt.steps["paused"] == 0
