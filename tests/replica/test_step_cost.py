"""The step cost model's fit and predictions, and the scheduler's time-bounded chunks."""

import itertools

import pytest

from kvroute.replica.block_hash import HashSpec
from kvroute.replica.kv_cache_manager import KVCacheManager
from kvroute.replica.outputs import RequestId
from kvroute.replica.request import Request
from kvroute.replica.sampling_params import SamplingParams
from kvroute.replica.scheduler import PROBE_TOKENS, Scheduler, SchedulerConfig
from kvroute.replica.step_cost import StepCostModel, attention_pairs
from kvroute.replica.telemetry import ReplicaTelemetry

TRUE = (0.02, 3e-3, 1.4e-6)  # overhead s, s per token, s per pair: issue 31's CPU (6,525 tokens in 49 s)
_ids = itertools.count()


def true_seconds(tokens, pairs):
    o, u, v = TRUE
    return o + u * tokens + v * pairs


def trained() -> StepCostModel:
    """A model fed exact steps of several kinds: short prompts, chunks deep in a long one."""
    cost = StepCostModel()
    for tokens, start in [(5, 0), (40, 0), (512, 0), (512, 2048), (256, 4096), (2048, 0), (16, 6000)]:
        pairs = attention_pairs(start, start + tokens)
        cost.observe(tokens, pairs, true_seconds(tokens, pairs))
    return cost


def test_attention_pairs_count_every_position_up_to_each_token():
    assert attention_pairs(0, 1) == 1 and attention_pairs(0, 4) == 1 + 2 + 3 + 4
    assert attention_pairs(2, 4) == 3 + 4 == attention_pairs(0, 4) - attention_pairs(0, 2)


def test_the_fit_recovers_overhead_token_and_attention_costs():
    cost = trained()
    assert cost.fitted and cost.coef == pytest.approx(TRUE, rel=1e-6)
    # a long prompt's tail costs far more per token than its head
    assert cost.span_seconds(6000, 6512) == pytest.approx(512 * 3e-3 + 1.4e-6 * attention_pairs(6000, 6512))
    assert cost.span_seconds(6000, 6512) > 3 * cost.span_seconds(0, 512)
    assert cost.span_seconds(0, 6525) == pytest.approx(49.4, abs=0.1)
    assert cost.seconds(100, 0) == pytest.approx(0.02 + 0.3)


def test_one_step_is_a_rate_and_nothing_measured_is_no_model():
    cost = StepCostModel()
    assert not cost.fitted and cost.span_seconds(0, 1000) == 0.0
    cost.observe(100, attention_pairs(0, 100), 0.5)
    assert cost.coef == pytest.approx((0.0, 0.005, 0.0))


def test_the_fit_stays_non_negative_and_follows_a_slowdown():
    cost = trained()
    for _ in range(200):  # the machine got twice as slow (a neighbour), same kinds of step
        for tokens, start in [(40, 0), (512, 0), (512, 4096)]:
            pairs = attention_pairs(start, start + tokens)
            cost.observe(tokens, pairs, 2 * true_seconds(tokens, pairs))
    assert cost.coef == pytest.approx(tuple(2 * c for c in TRUE), rel=1e-3)
    noisy = StepCostModel()
    for tokens in (10, 20, 30):  # shorter steps slower: no negative per-token cost
        noisy.observe(tokens, attention_pairs(0, tokens), 0.1 - tokens * 1e-3)
    assert min(noisy.coef) >= 0.0


def test_tokens_within_inverts_the_cost_of_a_span():
    cost = trained()
    for start in (0, 1000, 6000):
        for seconds in (0.05, 0.25, 3.0):
            c = cost.tokens_within(seconds, start)
            assert cost.span_seconds(start, start + c) <= seconds < cost.span_seconds(start, start + c + 1)
    assert cost.tokens_within(0.0, 0) == 0


# ---------------------------------------------------------------------- the scheduler
BS = 16


def make_sched(target=0.25, budget=2048):
    kv = KVCacheManager(2048, BS, True)
    sched = Scheduler(SchedulerConfig(budget, 64, step_target_s=target), kv)
    sched.cost = trained()
    return sched


def make_req(n, base=0):
    return Request(RequestId(f"q{next(_ids)}"), list(range(base, base + n)), SamplingParams(max_tokens=4), HashSpec(BS))


def step(sched):
    out = sched.schedule()
    sched.update_after_step(out)
    for row in out.rows:
        if row.samples:
            row.request.append_token(7)
    return out


def test_a_lone_long_prompt_takes_four_step_targets():
    sched = make_sched()
    sched.add(make_req(6500))
    assert [r.num_new for r in step(sched).rows] == [sched.cost.tokens_within(4 * 0.25, 0) // BS * BS]
    fast = make_sched()
    fast.cost = StepCostModel()
    fast.cost.observe(2048, attention_pairs(0, 2048), 0.06)  # a GPU: 2,048 tokens in 60 ms
    fast.add(make_req(6500))
    assert [r.num_new for r in step(fast).rows] == [2048]  # the token budget binds first


def test_short_requests_beside_a_long_prefill_bound_the_step_time():
    sched = make_sched()
    long = make_req(6500)
    sched.add(long)
    step(sched)  # alone: four targets' worth
    start = long.num_computed_tokens
    shorts = [make_req(5, base=10_000 + 100 * i) for i in range(3)]
    for r in shorts:
        sched.add(r)
    out = step(sched)
    rows = {r.request.request_id: r for r in out.rows}
    assert all(rows[r.request_id].num_new == 5 for r in shorts)  # every short prompt whole, at once
    chunk = rows[long.request_id].num_new
    # shortest remaining prompt first: the long one gets what the short ones leave, in whole blocks
    left = 0.25 - TRUE[0] - sum(sched.cost.span_seconds(0, 5) for _ in shorts)
    assert chunk == max(sched.cost.tokens_within(left, start), BS) // BS * BS
    predicted = sched.cost.seconds(out.num_tokens, out.attention_pairs)
    assert predicted <= 0.25
    out = step(sched)  # the shorts decode now: the long chunk takes what their decodes leave
    decode_s = sum(sched.cost.span_seconds(r.num_computed_tokens - 1, r.num_computed_tokens) for r in shorts)
    chunk = [r.num_new for r in out.rows if r.request is long][0]
    assert chunk == max(sched.cost.tokens_within(0.25 - TRUE[0] - decode_s, start + rows[long.request_id].num_new), BS) // BS * BS
    assert sched.cost.seconds(out.num_tokens, out.attention_pairs) <= 0.25


def test_a_deep_chunk_still_advances_one_block():
    sched = make_sched(target=0.001)  # nothing fits the target: one block a step
    long = make_req(6500)
    sched.add(long)
    step(sched)
    sched.add(make_req(5, base=20_000))
    assert [r.num_new for r in step(sched).rows] == [BS, 5]


def test_an_overhead_past_the_target_still_leaves_the_prefills_half_of_it():
    sched = make_sched(target=0.01)  # the 20 ms overhead alone passes it
    long = make_req(6500)
    sched.add(long)
    step(sched)
    sched.add(make_req(5, base=25_000))
    start = long.num_computed_tokens
    assert [r.num_new for r in step(sched).rows] == [max(sched.cost.tokens_within(0.01 / 2 / 2, start), BS) // BS * BS, 5]


def test_no_target_leaves_the_token_budget():
    sched = make_sched(target=None)
    sched.add(make_req(6500))
    sched.add(make_req(5, base=30_000))
    assert [r.num_new for r in step(sched).rows] == [2048]  # as before: the 5-token prompt waits


def test_the_load_report_prices_the_queue_with_the_cost_model():
    sched = make_sched()
    telemetry = ReplicaTelemetry("r", sched, sched.kv)
    assert telemetry.load().queued_prefill_s == 0.0
    long = make_req(6500)
    sched.add(long)
    step(sched)
    start = long.num_computed_tokens
    sched.add(make_req(40, base=40_000))
    load = telemetry.load()
    assert load.queued_prefill_tokens == 6500 - start + 40
    assert load.queued_prefill_s == pytest.approx(sched.cost.span_seconds(start, 6500) + sched.cost.span_seconds(0, 40))
    # the tail of the long prompt costs more per token than its head did
    assert sched.cost.span_seconds(start, 6500) / (6500 - start) > sched.cost.span_seconds(0, start) / start
    # telemetry feeds each prefill step's duration to the model
    before = sched.cost.coef
    telemetry.observe_step(sched.schedule(), 10.0)
    assert sched.cost.coef != before


def test_the_first_chunk_is_a_probe_until_a_step_is_measured():
    """Before the engine has timed any step, a time-bounded scheduler cannot price a
    chunk: it takes ``PROBE_TOKENS`` (not seconds of blind prefill at a CPU's rate)."""
    sched = make_sched()
    sched.cost = StepCostModel()  # nothing measured
    sched.add(make_req(6500))
    sched.add(make_req(5, base=30_000))
    assert [r.num_new for r in step(sched).rows] == [PROBE_TOKENS, 5]
