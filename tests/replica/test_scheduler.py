"""Exact block-level behaviour of the block pool, KV cache manager and scheduler."""

import itertools

import kvroute.replica.request as request_mod
from kvroute.replica.block_hash import HashSpec, hash_blocks
from kvroute.replica.kv_cache_manager import KVCacheManager
from kvroute.replica.outputs import RequestId
from kvroute.replica.request import Request, RequestStatus
from kvroute.replica.sampling_params import SamplingParams
from kvroute.replica.scheduler import Scheduler, SchedulerConfig

BS = 4
_ids = itertools.count()


def make_req(tokens, salt=None, max_tokens=8, bs=BS):
    return Request(RequestId(f"r{next(_ids)}"), list(tokens), SamplingParams(max_tokens=max_tokens), HashSpec(bs), salt)


def make_sched(num_blocks, budget=1000, chunked=True, page_aligned=True, max_seqs=64, caching=True):
    kv = KVCacheManager(num_blocks, BS, caching)
    return Scheduler(SchedulerConfig(budget, max_seqs, chunked, page_aligned), kv), kv


def run_step(sched, sample_token=7):
    """Schedule one step and pretend the model ran: append a token to sampling rows."""
    out = sched.schedule()
    sched.update_after_step(out)
    for row in out.rows:
        if row.samples:
            row.request.append_token(sample_token)
    return out


def finish(sched, req):
    sched.finish(req, "stop")


def test_seed_example_admission_counts_cached_blocks():
    sched, kv = make_sched(20, chunked=False)
    a = make_req(range(33))  # 8 full blocks + 1 token
    sched.add(a)
    run_step(sched)
    filler = make_req(range(1000, 1003))
    sched.add(filler)
    run_step(sched)
    assert kv.pool.num_free_blocks == 10
    b = make_req(list(range(32)) + list(range(500, 516)))  # 12 blocks, first 8 cached
    c = make_req(range(2000, 2048))  # 12 blocks, nothing cached
    sched.add(b)
    sched.add(c)
    out = sched.schedule()
    rows = {r.request.request_id: r for r in out.rows}
    assert b.request_id in rows and c.request_id not in rows
    assert b.num_cached_tokens == 32
    assert rows[b.request_id].num_computed == 32 and rows[b.request_id].num_new == 16
    assert kv.pool.num_free_blocks == 6  # only 4 new blocks were taken
    assert kv.req_blocks[b.request_id][:8] == kv.req_blocks[a.request_id][:8]
    assert [blk.ref_cnt for blk in kv.req_blocks[b.request_id][:8]] == [2] * 8


def test_budget_is_charged_only_for_computed_tokens():
    sched, kv = make_sched(64, budget=20, page_aligned=False)
    a = make_req(range(33))
    sched.add(a)
    while a.num_computed_tokens < 33:
        run_step(sched)
    b = make_req(list(range(32)) + list(range(600, 616)))  # 48 tokens, 32 cached
    d = make_req(range(3000, 3010))
    sched.add(b)
    sched.add(d)
    out = sched.schedule()
    rows = {r.request.request_id: r for r in out.rows}
    assert rows[a.request_id].num_new == 1  # a's decode
    assert rows[b.request_id].num_new == 16
    assert rows[d.request_id].num_new == 3  # what is left of the 20-token budget
    assert out.num_tokens == 20


def test_only_the_chunk_blocks_are_allocated_and_chunks_are_page_aligned():
    sched, kv = make_sched(64, budget=10)
    r = make_req(range(30))
    sched.add(r)
    chunks = []
    while r.num_output_tokens == 0:
        out = run_step(sched)
        chunks.append(out.rows[0].num_new)
        assert len(kv.req_blocks[r.request_id]) == -(-r.num_computed_tokens // BS)
    assert chunks == [8, 8, 8, 6]


def test_chunks_without_page_alignment_fill_the_budget():
    sched, kv = make_sched(64, budget=10, page_aligned=False)
    r = make_req(range(30))
    sched.add(r)
    chunks = []
    while r.num_output_tokens == 0:
        chunks.append(run_step(sched).rows[0].num_new)
    assert chunks == [10, 10, 10]


def test_fully_cached_prompt_still_computes_its_last_token():
    sched, kv = make_sched(64)
    a = make_req(range(33))
    sched.add(a)
    run_step(sched)
    # 33 tokens: 8 full blocks cached, the last token is computed.
    b = make_req(range(33))
    sched.add(b)
    row = [r for r in sched.schedule().rows if r.request is b][0]
    assert (row.num_computed, row.num_new) == (32, 1)
    # 32 tokens = exactly 8 blocks: the block holding the last token is recomputed.
    c = make_req(range(32))
    sched.add(c)
    row = [r for r in sched.schedule().rows if r.request is c][0]
    assert (row.num_computed, row.num_new) == (28, 4)
    assert row.samples


def test_lru_eviction_order_tail_of_chain_first():
    sched, kv = make_sched(8)
    a = make_req(range(12))  # 3 full blocks
    b = make_req(range(100, 108))  # 2 full blocks
    sched.add(a)
    run_step(sched)
    sched.add(b)
    run_step(sched)
    a_blocks = [blk.block_id for blk in kv.req_blocks[a.request_id]]  # 4 blocks (12 tokens + 1 output)
    b_blocks = [blk.block_id for blk in kv.req_blocks[b.request_id]]
    stored, _, _ = kv.take_events()
    assert len(stored) == 5  # 3 full blocks from a, 2 from b
    finish(sched, a)
    finish(sched, b)
    free = kv.pool.free_block_ids()
    # a's partial (unhashed) block goes to the very front, then the never-used blocks,
    # then a's chain tail-first, then b's chain tail-first (freed later = more recent).
    assert a_blocks == [0, 1, 2, 3] and b_blocks == [4, 5]
    assert free == [3, 6, 7, 2, 1, 0, 5, 4]
    # Taking 4 blocks consumes the 3 empty ones, then evicts a's tail block first.
    taken = kv.pool.take_new_blocks(4)
    assert taken[-1].block_id == a_blocks[2]
    assert kv.take_events() == ([], [a.block_hashes[2]], False)


def test_ref_counts_shared_blocks_and_no_leak():
    sched, kv = make_sched(32)
    reqs = [make_req(list(range(16)) + [900 + i] * 5) for i in range(3)]
    for r in reqs:
        sched.add(r)
    run_step(sched)
    # The first admission registers the prefix blocks when its step is scheduled; the
    # next two, admitted in the same step, already hit them (each layer stores the
    # step's K/V before any sequence attends).
    assert [r.num_cached_tokens for r in reqs] == [0, 16, 16]
    run_step(sched)
    shared = kv.req_blocks[reqs[0].request_id][:4]
    later = make_req(list(range(16)) + [1])
    sched.add(later)
    run_step(sched)
    assert kv.req_blocks[later.request_id][:4] == shared
    assert [b.ref_cnt for b in shared] == [4, 4, 4, 4]
    assert later.num_cached_tokens == 16
    assert kv.pool.num_free_blocks == 32 - 4 - 3 * 2 - 1
    for r in reqs + [later]:
        finish(sched, r)
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    assert kv.pool.num_free_blocks == 32


def test_cache_salt_isolates_tenants():
    sched, kv = make_sched(32)
    a = make_req(range(20), salt="alice")
    sched.add(a)
    run_step(sched)
    for salt, expect in (("bob", 0), (None, 0), ("alice", 16)):
        r = make_req(range(20), salt=salt)
        assert kv.get_computed_blocks(r)[1] == expect


def test_forced_hash_collision_never_reuses_the_wrong_block(monkeypatch):
    # Every block of every request gets the same chain of hashes: 0, 1, 2, ...
    monkeypatch.setattr(request_mod, "hash_blocks", lambda spec, toks, parent=None, **kw: [
        (0 if parent is None else 0) + i for i in range(len(toks) // spec.block_size)
    ])
    sched, kv = make_sched(32)
    a = make_req(range(20))
    sched.add(a)
    run_step(sched)
    b = make_req(range(100, 120))
    assert b.update_block_hashes()[:4] == a.block_hashes[:4]  # the collision is real
    assert kv.get_computed_blocks(b) == ([], 0)
    sched.add(b)
    run_step(sched)
    assert b.num_cached_tokens == 0
    assert set(map(id, kv.req_blocks[b.request_id])).isdisjoint(map(id, kv.req_blocks[a.request_id]))


def test_preemption_frees_the_newest_and_requeues_it_first():
    sched, kv = make_sched(6)
    a = make_req(range(8), max_tokens=12)
    b = make_req(range(100, 108), max_tokens=12)
    sched.add(a)
    sched.add(b)
    run_step(sched)  # each holds 2 blocks; decoding soon needs more than the 6 there are
    assert kv.pool.num_free_blocks == 2
    preempted = []
    for _ in range(8):
        out = run_step(sched)
        preempted += out.preempted
        if preempted:
            break
    assert preempted == [b.request_id]
    assert b.status is RequestStatus.PREEMPTED and sched.waiting[0] is b
    assert b.num_computed_tokens == 0
    assert b.request_id not in kv.req_blocks
    assert a.status is RequestStatus.RUNNING


def test_block_hashes_are_memoized():
    calls = []
    real = request_mod.hash_blocks

    def counting(spec, toks, parent=None, **kw):
        calls.append(len(toks))
        return real(spec, toks, parent=parent, **kw)

    r = make_req(range(9))
    request_mod.hash_blocks, saved = counting, request_mod.hash_blocks
    try:
        r.update_block_hashes()
        for t in range(20):
            r.append_token(t)
            r.update_block_hashes()
    finally:
        request_mod.hash_blocks = saved
    assert sum(calls) == 28  # every full block's tokens hashed exactly once
    assert r.block_hashes == hash_blocks(HashSpec(BS), r.token_ids)


def test_events_are_net_per_batch():
    kv = KVCacheManager(2, BS)
    r = make_req(range(4))
    kv.allocate_slots(r, 4)
    kv.free(r)
    kv.pool.take_new_blocks(2)  # evicts r's block in the same batch it was stored
    assert kv.take_events() == ([], [], False)


def test_queued_prefill_tokens_count_only_uncached_tokens():
    sched, kv = make_sched(64, max_seqs=1)
    a = make_req(range(33))
    sched.add(a)
    run_step(sched)
    b = make_req(list(range(32)) + list(range(700, 708)))  # 40 tokens, 32 cached
    c = make_req(range(900, 920))  # 20 tokens, none cached
    sched.add(b)
    sched.add(c)
    # a is running (prefill done); b and c wait behind max_num_seqs=1.
    assert sched.queued_prefill_tokens() == (40 - 32) + 20


def test_queued_prefill_tokens_count_a_shared_prefix_once():
    """A prefix that requests ahead will compute (a running prefill's rest, an earlier
    waiting request's prompt) is counted once, as the engine computes it once; and the
    count is what admission then computes."""
    sched, kv = make_sched(64, budget=8, max_seqs=4)
    lead = make_req(range(24))  # 6 blocks; an 8-token budget: a chunk of 2 blocks a step
    sched.add(lead)
    run_step(sched)
    assert sched.queued_prefill_tokens() == 16  # the lead's rest
    f1 = make_req(list(range(24)) + [500, 501])  # the lead's 6 blocks + 2 tokens
    f2 = make_req(list(range(20)) + [600, 601, 602])  # 5 of its blocks + 3 tokens
    cold = make_req(range(300, 310))  # 2 blocks + 2: nothing shared
    f3 = make_req(list(range(300, 308)) + [700])  # cold's 2 blocks + 1
    for r in (f1, f2, cold, f3):
        sched.add(r)
    # lead 16; f1: blocks 0-1 cached, 2-5 the lead's -> 2; f2 -> 3; cold 10; f3 -> 1
    assert sched.queued_prefill_tokens() == 16 + 2 + 3 + 10 + 1
    # on an idle replica the first of a prefix counts it whole, the next only its suffix
    other, _ = make_sched(64)
    for r in (make_req(list(range(24)) + [500, 501]), make_req(range(300, 310)), make_req(list(range(300, 308)) + [700])):
        other.add(r)
    assert other.queued_prefill_tokens() == 26 + 10 + 1
    uncached, _ = make_sched(64, caching=False)  # nothing shared without a prefix cache
    for r in (make_req(list(range(24)) + [500, 501]), make_req(list(range(24)) + [502])):
        uncached.add(r)
    assert uncached.queued_prefill_tokens() == 26 + 25
    sched2, _ = make_sched(64, budget=1000)
    a, b = make_req(range(100, 140)), make_req(list(range(100, 136)) + [9, 9])
    sched2.add(a)
    sched2.add(b)
    assert sched2.queued_prefill_tokens() == 40 + 2
    out = run_step(sched2)  # both admitted in one step: b computes only its suffix
    assert [(r.num_computed, r.num_new) for r in out.rows] == [(0, 40), (36, 2)]


def _lora_req(name, base):
    return Request(RequestId(f"r{next(_ids)}"), list(range(base, base + 5)), SamplingParams(max_tokens=8), HashSpec(BS),
                   lora_name=name)  # fmt: skip


def test_a_cold_adapter_is_passed_over_and_the_thinnest_running_adapter_drains_for_it():
    """Two slots, running a (twice) and b (once): c is passed over and the requests of
    running adapters behind it are admitted, except b's: b has the fewest running and
    drains, so c takes its slot as soon as b's request ends (it keeps its place)."""
    kv = KVCacheManager(100, BS, True)
    sched = Scheduler(SchedulerConfig(1000, 64, True, True, max_loras=2), kv)
    a1, a2, b1 = _lora_req("a", 0), _lora_req("a", 100), _lora_req("b", 200)
    for r in (a1, a2, b1):
        sched.add(r)
    run_step(sched)
    c, a3, b2 = _lora_req("c", 300), _lora_req("a", 400), _lora_req("b", 500)
    for r in (c, a3, b2):
        sched.add(r)
    run_step(sched)
    assert {r.request_id for r in sched.running} == {a1.request_id, a2.request_id, b1.request_id, a3.request_id}
    assert [r.request_id for r in sched.waiting] == [c.request_id, b2.request_id]
    finish(sched, b1)
    run_step(sched)
    assert c.status == RequestStatus.RUNNING and b2.status == RequestStatus.WAITING  # b2 waits for a or c now
    assert {r.lora_name for r in sched.running} == {"a", "c"}
