"""Sampler: exact processing semantics, reproducibility of seeded rows, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from kvroute.replica.sampler import (
    SampleRequest,
    Sampler,
    apply_filters,
    apply_penalties,
    process_logits,
    step_seed,
)
from kvroute.replica.sampling_params import SamplingParams

VOCAB = 64


def row(params: SamplingParams | None = None, prompt=(1, 2, 3), output=(), eos=frozenset({0})) -> SampleRequest:
    return SampleRequest(params or SamplingParams(), list(prompt), list(output), frozenset(eos))


def rand_logits(n: int, vocab: int = VOCAB, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, vocab, generator=g) * scale  # distinct values: no ties


# ---------------------------------------------------------------- greedy and filters


def test_greedy_is_argmax_batched():
    logits = rand_logits(8)
    out = Sampler()(logits, [row(SamplingParams(temperature=0.0)) for _ in range(8)])
    assert out.token_ids == logits.argmax(dim=1).tolist()
    assert out.logprobs == [None] * 8


def test_greedy_ties_go_to_lowest_id():
    logits = torch.zeros(2, 10)
    logits[0, [3, 7]] = 5.0
    logits[1, [9, 2, 4]] = 1.0
    out = Sampler()(logits, [row(SamplingParams(temperature=0.0)) for _ in range(2)])
    assert out.token_ids == [3, 2]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_greedy_accepts_half_precision(dtype):
    logits = rand_logits(4).to(dtype)
    logits[1, [5, 9]] = 20.0  # ties in the model's dtype go to the lowest id too
    out = Sampler()(logits, [row(SamplingParams(temperature=0.0)) for _ in range(4)])
    assert out.token_ids == logits.float().argmax(dim=1).tolist()
    assert out.token_ids[1] == 5


def test_half_precision_greedy_rows_that_need_more_than_an_argmax():
    """bf16 logits with a penalty, min_tokens and logprobs in the batch: the rows are
    processed in float32 as before (the argmax-only shortcut does not apply)."""
    logits = rand_logits(3).to(torch.bfloat16)
    rows = [
        row(SamplingParams(temperature=0.0, repetition_penalty=1e6), prompt=[int(logits[0].float().argmax())]),
        row(SamplingParams(temperature=0.0, min_tokens=1), eos={int(logits[1].float().argmax())}),
        row(SamplingParams(temperature=0.0, logprobs=1)),
    ]
    out = Sampler()(logits, rows)
    want = Sampler()(logits.float(), rows)
    assert out.token_ids == want.token_ids
    assert out.token_ids[0] != logits[0].float().argmax() and out.token_ids[1] != logits[1].float().argmax()
    assert out.logprobs[2] is not None and out.logprobs[2].token_id == out.token_ids[2]


@pytest.mark.parametrize("temperature", [0.1, 1.0, 2.5, 100.0])
def test_top_k_1_is_greedy_at_any_temperature(temperature):
    logits = rand_logits(16, seed=1)
    params = SamplingParams(temperature=temperature, top_k=1)
    out = Sampler(seed=3)(logits, [row(params) for _ in range(16)])
    assert out.token_ids == logits.argmax(dim=1).tolist()


def test_top_k_1_with_ties_is_greedy():
    logits = torch.zeros(1, 10)
    logits[0, [6, 4, 8]] = 2.0
    sampler = Sampler(seed=0)
    for _ in range(20):
        assert sampler(logits, [row(SamplingParams(top_k=1))]).token_ids == [4]


def test_tiny_top_p_is_argmax():
    logits = rand_logits(16, seed=2)
    params = SamplingParams(temperature=1.7, top_p=1e-6)
    out = Sampler(seed=5)(logits, [row(params) for _ in range(16)])
    assert out.token_ids == logits.argmax(dim=1).tolist()


def test_min_p_one_is_argmax():
    logits = rand_logits(16, seed=3)
    params = SamplingParams(temperature=0.8, min_p=1.0)
    out = Sampler(seed=7)(logits, [row(params) for _ in range(16)])
    assert out.token_ids == logits.argmax(dim=1).tolist()


def test_filters_keep_exact_sets():
    # probabilities 0.5, 0.25, 0.125, 0.0625, 0.0625 at temperature 1
    probs = torch.tensor([[0.0625, 0.25, 0.0625, 0.5, 0.125]])
    logits = probs.log()
    kept = lambda p: torch.isfinite(apply_filters(logits, [p]))[0].nonzero().flatten().tolist()  # noqa: E731
    assert kept(SamplingParams(top_k=2)) == [1, 3]
    assert kept(SamplingParams(top_k=4)) == [0, 1, 3, 4]  # tie at 0.0625 (ids 0, 2): lowest wins
    assert kept(SamplingParams(top_p=0.5)) == [3]  # 0.5 alone reaches 0.5
    assert kept(SamplingParams(top_p=0.51)) == [1, 3]
    assert kept(SamplingParams(top_p=0.8)) == [1, 3, 4]  # 0.875 >= 0.8, 0.75 is not
    assert kept(SamplingParams(top_p=1.0)) == [0, 1, 2, 3, 4]
    assert kept(SamplingParams(min_p=0.25)) == [1, 3, 4]  # >= 0.125
    assert kept(SamplingParams(min_p=0.3)) == [1, 3]
    # top_p is applied to the distribution renormalized after top_k: {0.5, 0.25} -> 2/3, 1/3
    assert kept(SamplingParams(top_k=2, top_p=0.6)) == [3]
    assert kept(SamplingParams(top_k=2, top_p=0.7)) == [1, 3]
    assert kept(SamplingParams(top_k=4, top_p=0.999)) == [0, 1, 3, 4]  # same tie rule when sorting
    # min_p after top_k / top_p compares against the max, unaffected by renormalization
    assert kept(SamplingParams(top_k=3, min_p=0.5)) == [1, 3]


def test_tiny_temperature_is_finite_and_near_greedy():
    logits = torch.arange(50, dtype=torch.float32).flip(0).unsqueeze(0) * 0.1  # argmax 0
    out = Sampler()(logits.expand(8, 50), [row(SamplingParams(temperature=1e-30, seed=i)) for i in range(8)])
    assert out.token_ids == [0] * 8


def test_filters_temperature_divides_logits():
    logits = rand_logits(2, seed=4)
    out = apply_filters(logits, [SamplingParams(temperature=0.5), SamplingParams(temperature=2.0)])
    torch.testing.assert_close(out, logits / torch.tensor([[0.5], [2.0]]), rtol=0, atol=0)


def test_process_logits_leaves_input_alone():
    logits = rand_logits(3, seed=5)
    before = logits.clone()
    rows = [
        row(SamplingParams(temperature=0.0, repetition_penalty=1.3)),
        row(SamplingParams(top_k=3, min_tokens=2), eos={5}),
        row(),
    ]
    out = process_logits(logits, rows)
    assert torch.equal(logits, before)
    assert torch.isfinite(out[1]).sum().item() == 3
    assert torch.equal(out[2], logits[2])


# ---------------------------------------------------------------- penalties and min_tokens


def test_repetition_penalty_hf_semantics():
    logits = torch.tensor([[2.0, -2.0, 3.0, -1.0, 0.5, 4.0]])
    r = row(SamplingParams(repetition_penalty=2.0), prompt=[0, 1], output=[3, 3])
    out = apply_penalties(logits, [r])
    assert out.tolist() == [[1.0, -4.0, 3.0, -2.0, 0.5, 4.0]]


def test_frequency_and_presence_penalties_openai_semantics():
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0]])
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    # the prompt does not count for frequency / presence
    r = row(params, prompt=[4, 4, 4], output=[1, 2, 2, 2])
    out = apply_penalties(logits, [r])
    assert out.tolist() == [[1.0, 1.0 - 0.5 - 0.25, 1.0 - 1.5 - 0.25, 1.0, 1.0]]


def test_negative_penalties_reward():
    logits = torch.zeros(1, 4)
    r = row(SamplingParams(frequency_penalty=-1.0, presence_penalty=-0.5), prompt=[], output=[2, 2])
    assert apply_penalties(logits, [r]).tolist() == [[0.0, 0.0, 2.5, 0.0]]


def test_penalties_combined_order_and_batch_rows_independent():
    logits = rand_logits(4, vocab=8, seed=6)
    p = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.3, presence_penalty=0.2)
    rows = [
        row(p, prompt=[1, 2], output=[2, 5, 5]),
        row(),  # default: untouched
        row(SamplingParams(repetition_penalty=0.5), prompt=[7], output=[]),
        row(SamplingParams(presence_penalty=1.0), prompt=[], output=[0]),
    ]
    out = apply_penalties(logits, rows)
    exp = logits.clone()
    for t in (1, 2, 5):  # repetition first, over prompt + output
        x = exp[0, t]
        exp[0, t] = x / 1.5 if x > 0 else x * 1.5
    exp[0, 2] -= 0.3 * 1 + 0.2
    exp[0, 5] -= 0.3 * 2 + 0.2
    x = exp[2, 7]
    exp[2, 7] = x / 0.5 if x > 0 else x * 0.5
    exp[3, 0] -= 1.0
    torch.testing.assert_close(out, exp, rtol=0, atol=1e-6)
    assert torch.equal(out[1], logits[1])


def test_default_rows_take_fast_path():
    logits = rand_logits(4)
    out = apply_penalties(logits, [row() for _ in range(4)])
    assert out is logits  # no copy, no work


def test_min_tokens_suppresses_eos_and_stop_ids():
    logits = torch.zeros(1, 8)
    logits[0, 0] = 10.0  # EOS
    logits[0, 6] = 9.0  # stop token
    logits[0, 3] = 1.0
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[6], ignore_eos=True)
    sampler = Sampler()
    assert sampler(logits, [row(params, output=[])]).token_ids == [3]
    assert sampler(logits, [row(params, output=[3])]).token_ids == [3]
    assert sampler(logits, [row(params, output=[3, 3])]).token_ids == [0]
    out = apply_penalties(logits, [row(params, output=[3], eos={0, 7})])
    assert out[0, 0] == -math.inf and out[0, 6] == -math.inf and out[0, 7] == -math.inf
    assert out[0, 3] == 1.0


def test_min_tokens_suppression_when_sampling():
    logits = torch.zeros(1, 4)
    logits[0, 0] = 20.0
    params = SamplingParams(min_tokens=1, seed=1)
    for step in range(5):
        tok = Sampler()(logits, [row(params, output=[])]).token_ids[0]
        assert tok != 0


# ---------------------------------------------------------------- randomness


def test_seeded_rows_independent_of_batch_and_order():
    vocab = 1000
    logits = rand_logits(6, vocab=vocab, seed=7, scale=1.0)
    params = [
        SamplingParams(seed=11),
        SamplingParams(seed=12, temperature=0.7, top_p=0.9),
        SamplingParams(seed=13, top_k=50, repetition_penalty=1.2),
        SamplingParams(seed=14, min_p=0.05, temperature=1.3),
    ]
    outputs = [[5, 6], [], [1, 2, 3], [9]]
    rows = [row(p, output=o) for p, o in zip(params, outputs)]
    alone = [Sampler(seed=s)(logits[i : i + 1], [rows[i]]).token_ids[0] for i, s in enumerate(range(4))]
    # inside a bigger batch, with unseeded and greedy neighbours, in reverse order
    extra = [row(SamplingParams()), row(SamplingParams(temperature=0.0))]
    perm = [3, 2, 1, 0]
    batch_rows = [extra[0]] + [rows[i] for i in perm] + [extra[1]]
    batch_logits = torch.cat([logits[4:5]] + [logits[i : i + 1] for i in perm] + [logits[5:6]])
    mixed = Sampler(seed=99)(batch_logits, batch_rows).token_ids
    assert [mixed[1 + perm.index(i)] for i in range(4)] == alone


def test_seeded_row_depends_only_on_seed_and_position():
    vocab = 500
    params = SamplingParams(seed=1234, temperature=1.0)
    logits = rand_logits(20, vocab=vocab, seed=8, scale=0.5)
    sampler = Sampler(seed=0)
    out: list[int] = []
    for step in range(20):  # generate, as an engine would
        out.append(sampler(logits[step : step + 1], [row(params, output=out)]).token_ids[0])
    # "preempted" after 12 tokens, resumed on a fresh sampler with the tokens so far
    resumed = out[:12]
    other = Sampler(seed=42)
    other(rand_logits(3, vocab=vocab), [row(SamplingParams()) for _ in range(3)])  # other history
    for step in range(12, 20):
        resumed.append(other(logits[step : step + 1], [row(params, output=resumed)]).token_ids[0])
    assert resumed == out


def test_different_seeds_differ():
    vocab = 100
    logits = torch.zeros(1, vocab)  # uniform: two seeds agree with prob 1/100 per token
    sampler = Sampler()
    a = [sampler(logits, [row(SamplingParams(seed=1), output=[0] * i)]).token_ids[0] for i in range(200)]
    b = [sampler(logits, [row(SamplingParams(seed=2), output=[0] * i)]).token_ids[0] for i in range(200)]
    assert sum(x == y for x, y in zip(a, b)) < 15
    assert len(set(a)) > 50  # and a seed's stream is not stuck on one token


def test_unseeded_sampler_seed_reproducible_and_advances():
    logits = torch.zeros(4, 100)
    rows = [row() for _ in range(4)]
    s1, s2 = Sampler(seed=3), Sampler(seed=3)
    first = [s1(logits, rows).token_ids for _ in range(3)]
    assert first == [s2(logits, rows).token_ids for _ in range(3)]
    assert first[0] != first[1] or first[1] != first[2]


def test_step_seed_mixes():
    seeds = {step_seed(s, i) for s in range(50) for i in range(50)}
    assert len(seeds) == 2500
    assert all(0 <= x < 2**63 for x in seeds)
    assert step_seed(-1, 0) != step_seed(1, 0)


@pytest.mark.parametrize("seeded", [False, True])
def test_empirical_distribution_matches_softmax(seeded):
    vocab = 8
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2]])
    n = 20000
    batch = 500
    sampler = Sampler(seed=2024)
    counts = torch.zeros(vocab)
    for b in range(n // batch):
        if seeded:
            rows = [row(SamplingParams(seed=b * batch + j)) for j in range(batch)]
        else:
            rows = [row() for _ in range(batch)]
        toks = sampler(logits.expand(batch, vocab), rows).token_ids
        counts += torch.bincount(torch.tensor(toks), minlength=vocab).float()
    expected = torch.softmax(logits[0], 0) * n
    chi2 = (((counts - expected) ** 2) / expected).sum().item()
    assert chi2 < 40.0, (chi2, counts, expected)  # 7 dof: p(chi2 > 24) ~ 0.001


def test_temperature_sharpens_distribution():
    logits = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    n = 4000
    sampler = Sampler(seed=1)
    hot = sampler(logits.expand(n, 4), [row(SamplingParams(temperature=5.0)) for _ in range(n)]).token_ids
    cold = sampler(logits.expand(n, 4), [row(SamplingParams(temperature=0.2)) for _ in range(n)]).token_ids
    p_hot = hot.count(0) / n  # e^0.2 / (e^0.2 + 3) ~ 0.29
    p_cold = cold.count(0) / n  # e^5 / (e^5 + 3) ~ 0.98
    assert abs(p_hot - 0.2899) < 0.04 and abs(p_cold - 0.9802) < 0.02


def test_sampled_tokens_stay_inside_filtered_set():
    logits = rand_logits(64, vocab=200, seed=9)
    params = SamplingParams(top_k=5, temperature=1.5)
    out = Sampler(seed=4)(logits, [row(params) for _ in range(64)]).token_ids
    allowed = logits.topk(5, dim=1).indices.tolist()
    assert all(t in a for t, a in zip(out, allowed))


# ---------------------------------------------------------------- logprobs


def test_logprobs_from_raw_distribution_sorted():
    logits = rand_logits(3, vocab=50, seed=10)
    rows = [
        row(SamplingParams(logprobs=5, temperature=0.0, repetition_penalty=1.5), prompt=range(10)),
        row(SamplingParams(logprobs=0, seed=3, temperature=0.5)),
        row(SamplingParams()),
    ]
    out = Sampler()(logits, rows)
    lsm = torch.log_softmax(logits, dim=1)
    assert out.logprobs[2] is None
    for i in (0, 1):
        lp = out.logprobs[i]
        assert lp is not None and lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(lsm[i, out.token_ids[i]].item(), abs=1e-6)
    assert out.logprobs[1].top == {}
    top = out.logprobs[0].top
    assert list(top) == lsm[0].topk(5).indices.tolist()
    assert list(top.values()) == sorted(top.values(), reverse=True)
    for t, v in top.items():
        assert v == pytest.approx(lsm[0, t].item(), abs=1e-6)


def test_logprobs_raw_even_when_penalties_change_choice():
    logits = torch.tensor([[2.5, 1.0, 0.0]])
    r = row(SamplingParams(temperature=0.0, logprobs=2, presence_penalty=2.0), output=[0])
    out = Sampler()(logits, [r])
    assert out.token_ids == [1]  # 2.5 - 2 = 0.5 < 1.0
    lsm = torch.log_softmax(logits, dim=1)[0]
    assert out.logprobs[0].logprob == pytest.approx(lsm[1].item(), abs=1e-6)
    assert list(out.logprobs[0].top) == [0, 1]


def test_empty_batch_and_bad_shape():
    assert Sampler()(torch.zeros(0, 10), []).token_ids == []
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(2, 10), [row()])
