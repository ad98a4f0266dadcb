"""The sampler, stage by stage against direct computations, then as a whole: greedy, seeds, distribution."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from minillm.outputs import SamplerOutput
from minillm.sample import Sampler, SamplingMetadata, compute_logits_indices, make_generator
from minillm.sample.logits_processors import apply_min_p, apply_min_tokens
from minillm.sample.ops.penalties import apply_penalties, token_counts
from minillm.sample.ops.random_sample import random_sample
from minillm.sample.ops.topk_topp import apply_top_k_top_p
from minillm.sample.sampler import apply_temperature, gather_logprobs
from minillm.sampling_params import SamplingParams

NEG = float("-inf")


# ---------------------------------------------------------------- direct (loop) references
def ref_top_k_top_p(row: np.ndarray, k: int, p: float) -> np.ndarray:
    """One row, the textbook way: keep the k largest (with ties), renormalise, keep the nucleus."""
    out = row.astype(np.float64).copy()
    V = len(out)
    if 0 < k < V:
        kth = np.sort(out)[::-1][k - 1]
        out[out < kth] = -np.inf
    if p < 1.0:
        probs = np.exp(out - out.max())
        probs /= probs.sum()
        order = np.argsort(-probs, kind="stable")
        keep, total = [], 0.0
        for i in order:
            keep.append(i)
            total += probs[i]
            if total >= p - 1e-6:  # float32 cumsum in the sampler: allow its rounding
                break
        mask = np.full(V, True)
        mask[keep] = False
        out[mask] = -np.inf
    return out


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.integers(2, 40), st.data())
def test_top_k_top_p_matches_direct(rows, vocab, data):
    seed = data.draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 3
    ks = data.draw(st.lists(st.integers(0, vocab + 2), min_size=rows, max_size=rows))
    ps = data.draw(st.lists(st.sampled_from([1.0, 0.9, 0.5, 0.2, 0.05]), min_size=rows, max_size=rows))
    got = apply_top_k_top_p(logits, torch.tensor(ks), torch.tensor(ps))
    for r in range(rows):
        want = ref_top_k_top_p(logits[r].numpy(), ks[r], ps[r])
        assert np.array_equal(np.isinf(want), torch.isinf(got[r]).numpy()), (ks[r], ps[r])
        kept = ~np.isinf(want)
        assert np.allclose(got[r].numpy()[kept], logits[r].numpy()[kept])  # kept logits are untouched


def test_top_k_ties_and_none():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    out = apply_top_k_top_p(logits, torch.tensor([1]), None)
    assert torch.isinf(out).tolist() == [[True, False, False, True]]  # both tied maxima kept
    assert apply_top_k_top_p(logits, None, None) is logits
    out = apply_top_k_top_p(logits, None, torch.tensor([1e-6]))
    assert (~torch.isinf(out)).sum() == 1  # a tiny p still keeps one token


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(2, 30), st.floats(0.0, 1.0), st.integers(0, 10**6))
def test_min_p_matches_direct(rows, vocab, mp, seed):
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 2
    out = apply_min_p(logits, torch.full((rows,), mp))
    probs = torch.softmax(logits.double(), -1)
    for r in range(rows):
        keep = probs[r] >= mp * probs[r].max() - 1e-7
        assert torch.equal(~torch.isinf(out[r]), keep) or mp in (0.0, 1.0)
        assert not torch.isinf(out[r, probs[r].argmax()])  # the top token always survives
    assert apply_min_p(logits, None) is logits


def test_penalties_match_direct():
    g = torch.Generator().manual_seed(1)
    V = 12
    logits = torch.randn(3, V, generator=g) * 2
    prompts = [[1, 2, 2], [], [5]]
    outputs = [[3, 3, 3, 1], [7], []]
    pres, freq, rep = torch.tensor([0.5, -1.0, 2.0]), torch.tensor([0.3, 0.0, -0.5]), torch.tensor([1.5, 0.8, 1.0])
    got = apply_penalties(logits, prompts, outputs, pres, freq, rep)
    want = logits.clone()
    for r in range(3):
        for t in range(V):
            if t in prompts[r] or t in outputs[r]:
                want[r, t] = want[r, t] / rep[r] if want[r, t] > 0 else want[r, t] * rep[r]
            c = outputs[r].count(t)
            want[r, t] -= freq[r] * c + pres[r] * (c > 0)
    torch.testing.assert_close(got, want)  # same float32 ops in the same order: exact up to rounding
    assert token_counts([[0, 0, 4], []], 5).tolist() == [[2, 0, 0, 0, 1], [0] * 5]
    with pytest.raises(ValueError, match="token ids"):
        token_counts([[9]], 5)


def test_temperature_and_min_tokens():
    logits = torch.tensor([[2.0, 4.0], [2.0, 4.0]])
    torch.testing.assert_close(apply_temperature(logits, torch.tensor([0.5, 0.0])),
                               torch.tensor([[4.0, 8.0], [2.0, 4.0]]))
    out = apply_min_tokens(logits, {1: (3, {0, 99})})  # ids outside the vocab are ignored
    assert out[0].tolist() == [2.0, 4.0] and out[1].tolist() == [NEG, 4.0]


def test_metadata_min_tokens_blocks_eos_until_reached():
    params = [SamplingParams(min_tokens=2, stop_token_ids=[7]), SamplingParams(min_tokens=2),
              SamplingParams(min_tokens=2, ignore_eos=True), SamplingParams(min_tokens=1)]
    md = SamplingMetadata.from_params(params, output_token_ids=[[], [1], [], [1]], eos_token_id=2)
    # Row 2 sets ignore_eos and EOS is still blocked (vLLM v0.33.0 adds EOS to _all_stop_token_ids whatever
    # ignore_eos is: vllm/sampling_params.py:SamplingParams.update_from_generation_config); row 3 is done.
    assert md.min_tokens == {0: (2, {2, 7}), 1: (2, {2}), 2: (2, {2})}


def test_min_tokens_blocks_eos_even_with_ignore_eos():
    """ignore_eos says EOS does not stop the request; under min_tokens EOS must not even be sampled. A greedy row
    whose argmax is EOS takes the next token until min_tokens is reached, then may take EOS again."""
    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0]] * 2)  # EOS (id 2) is the argmax of both rows
    p = SamplingParams.greedy(max_tokens=4, min_tokens=2, ignore_eos=True)
    md = SamplingMetadata.from_params([p, p], output_token_ids=[[1], [1, 3]], eos_token_id=2)
    # Row 0 has 1 token < min_tokens: EOS masked, so token 3. Row 1 has reached min_tokens: EOS allowed.
    assert Sampler()(logits, md).sampled_token_ids[:, 0].tolist() == [3, 2]


# ---------------------------------------------------------------- the whole sampler
def batch(params, vocab=50, seed=0, **kw):
    logits = torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(seed)) * 2
    return logits, SamplingMetadata.from_params(params, **kw)


def test_output_shape_and_dtype():
    logits, md = batch([SamplingParams(), SamplingParams.greedy(), SamplingParams(seed=4)])
    out = Sampler()(logits, md)
    assert isinstance(out, SamplerOutput) and out.logprobs_tensors is None
    assert out.sampled_token_ids.shape == (3, 1) and out.sampled_token_ids.dtype == torch.int32
    assert out.to_token_lists() == [[t] for t in out.sampled_token_ids[:, 0].tolist()]
    with pytest.raises(ValueError, match="num_reqs"):
        Sampler()(logits[:2], md)


def test_greedy_equals_argmax_whatever_the_filters():
    params = [SamplingParams(temperature=0, top_k=3, top_p=0.1, min_p=0.9), SamplingParams(temperature=0)]
    logits, md = batch(params, vocab=1000)
    out = Sampler()(logits, md).sampled_token_ids[:, 0]
    assert torch.equal(out.long(), logits.argmax(-1))
    # Mixed batch: greedy rows still take the argmax while the others sample.
    params = [SamplingParams(temperature=0), SamplingParams(temperature=2.0), SamplingParams(temperature=0)]
    logits, md = batch(params, vocab=1000, seed=3)
    out = Sampler()(logits, md).sampled_token_ids[:, 0].long()
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()


def test_penalty_changes_greedy_choice():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    md = SamplingMetadata.from_params([SamplingParams.greedy(presence_penalty=0.5)], output_token_ids=[[0]])
    assert Sampler()(logits, md).sampled_token_ids.item() == 1
    md = SamplingMetadata.from_params([SamplingParams.greedy(min_tokens=1)], eos_token_id=0)
    assert Sampler()(logits, md).sampled_token_ids.item() == 1  # EOS (id 0) masked before min_tokens


def run_steps(params, steps, vocab=100, others=()):
    """Sample `steps` tokens for params[0] (with persistent generators), next to `others` in the batch."""
    allp = [params] + list(others)
    gens = {i: make_generator(p.seed) for i, p in enumerate(allp) if p.seed is not None}
    toks = []
    for s in range(steps):
        g = torch.Generator().manual_seed(100 + s)
        logits = torch.cat([torch.randn(1, vocab, generator=g), torch.randn(len(others), vocab)])
        md = SamplingMetadata.from_params(allp, generators=gens)
        toks.append(Sampler()(logits, md).sampled_token_ids[0, 0].item())
    return toks


def test_seeded_sampling_is_reproducible_and_batch_independent():
    p = SamplingParams(seed=1234, temperature=1.5)
    alone = run_steps(p, 20)
    torch.manual_seed(999)  # the global generator must not matter for a seeded request
    crowded = run_steps(p, 20, others=[SamplingParams(), SamplingParams(seed=7), SamplingParams.greedy()])
    assert alone == crowded
    assert run_steps(SamplingParams(seed=1235, temperature=1.5), 20) != alone
    # The generator advances: the 20 tokens are not one draw repeated.
    assert len(set(alone)) > 5


def test_rows_sample_independently():
    """Two unseeded rows with the same uniform distribution: their joint frequencies factorise (chi-square)."""
    torch.manual_seed(0)
    n, V = 20000, 4
    logits = torch.zeros(2 * n, V)
    md = SamplingMetadata.from_params([SamplingParams()] * (2 * n))
    toks = Sampler()(logits, md).sampled_token_ids[:, 0].view(n, 2).numpy()
    table = np.zeros((V, V))
    np.add.at(table, (toks[:, 0], toks[:, 1]), 1)
    _, pvalue, _, _ = stats.chi2_contingency(table)
    assert pvalue > 1e-3, pvalue  # fixed seed: deterministic; a dependent sampler gives p ~ 0
    # Same seed in two rows: each has its own generator, so they draw the same token.
    md = SamplingMetadata.from_params([SamplingParams(seed=5), SamplingParams(seed=5), SamplingParams(seed=6)])
    t = Sampler()(torch.zeros(3, 1000), md).sampled_token_ids[:, 0].tolist()
    assert t[0] == t[1] and t[0] != t[2]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7, top_k=6),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.1, top_k=8, top_p=0.95),
])
def test_sampled_frequencies_match_filtered_distribution(params):
    """Chi-square goodness of fit of the exponential race against the distribution after all filters."""
    V, n = 12, 30000
    base = torch.linspace(-2.0, 1.5, V)[torch.randperm(V, generator=torch.Generator().manual_seed(2))]
    logits = base.expand(n, V).contiguous()
    md = SamplingMetadata.from_params([params] * n)
    probs = Sampler.filtered_probs(logits[:1], SamplingMetadata.from_params([params]))[0].double()
    torch.manual_seed(123)
    toks = Sampler()(logits, md).sampled_token_ids[:, 0].long()
    counts = torch.bincount(toks, minlength=V).double()
    support = probs > 0
    assert counts[~support].sum() == 0  # filtered-out tokens are never drawn
    assert int(support.sum()) < V  # the filters really removed something
    expected = probs[support] / probs[support].sum() * counts.sum()
    _, pvalue = stats.chisquare(counts[support].numpy(), expected.numpy())
    assert pvalue > 1e-3, pvalue


def test_random_sample_with_generators_and_zero_noise_guard():
    probs = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.0, 0.5]])
    out = random_sample(probs, {0: make_generator(1)})
    assert out[0] == 1 and out[1] in (0, 2)


def test_logprobs_sampled_first_with_rank():
    logits, md = batch([SamplingParams.greedy(logprobs=3), SamplingParams(logprobs=1), SamplingParams()], vocab=30)
    out = Sampler()(logits, md)
    lp = out.logprobs_tensors
    assert lp.logprob_token_ids.shape == (3, 4) and lp.logprob_token_ids.dtype == torch.int32
    assert lp.logprobs.shape == (3, 4) and lp.logprobs.dtype == torch.float32
    assert lp.selected_token_ranks.shape == (3,) and lp.selected_token_ranks.dtype == torch.int32
    ref = torch.log_softmax(logits, -1)
    sampled = out.sampled_token_ids[:, 0].long()
    assert torch.equal(lp.logprob_token_ids[:, 0].long(), sampled)
    torch.testing.assert_close(lp.logprobs[:, 0], ref.gather(1, sampled[:, None])[:, 0])
    top = ref.topk(3, -1)
    assert torch.equal(lp.logprob_token_ids[:, 1:].long(), top.indices)
    for r in range(3):
        assert lp.selected_token_ranks[r] == int((ref[r] >= ref[r, sampled[r]]).sum())
    assert lp.selected_token_ranks[0] == 1  # greedy token is the most likely
    ids, vals, ranks = lp.tolists()
    assert len(ids) == 3 and len(vals[0]) == 4 and ranks[0] == 1
    g = gather_logprobs(ref, 0, sampled)
    assert g.logprobs.shape == (3, 1)


def test_logits_indices():
    qsl = torch.tensor([0, 5, 6, 9])
    assert compute_logits_indices(qsl).tolist() == [4, 5, 8]
    with pytest.raises(ValueError, match="at least one scheduled token"):
        compute_logits_indices(torch.tensor([0, 2, 2]))
    with pytest.raises(ValueError, match="query_start_loc"):
        compute_logits_indices(torch.tensor([0]))
    with pytest.raises(ValueError, match="empty"):
        SamplingMetadata.from_params([])


@pytest.mark.parametrize("huge", [2**31, 2**63, 2**70])
def test_a_huge_top_k_samples_like_no_top_k(huge):
    """A top_k beyond the vocabulary keeps every token: same filtered distribution, same seeded draws as no top_k.
    Values of 2**63 and more do not fit the int64 tensor and must be clamped, not overflow."""
    V = 40
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(7)) * 2
    with_k = [SamplingParams(seed=11, top_k=huge), SamplingParams(seed=12, top_k=huge, top_p=0.7),
              SamplingParams(seed=13, top_k=5)]
    without = [SamplingParams(seed=11), SamplingParams(seed=12, top_p=0.7), SamplingParams(seed=13, top_k=5)]
    md_k, md_0 = SamplingMetadata.from_params(with_k), SamplingMetadata.from_params(without)
    assert md_k.top_k.dtype == torch.int64 and md_k.top_k[2] == 5  # a normal k is stored unchanged
    torch.testing.assert_close(Sampler.filtered_probs(logits, md_k), Sampler.filtered_probs(logits, md_0),
                               rtol=0, atol=0)

    def draws(params, steps=30):
        gens = {i: make_generator(p.seed) for i, p in enumerate(params)}  # kept across steps, as the engine does
        return [Sampler()(logits, SamplingMetadata.from_params(params, generators=gens)).sampled_token_ids[:, 0]
                .tolist() for _ in range(steps)]

    got, want = draws(with_k), draws(without)
    assert got == want and len({tuple(t) for t in got}) > 1  # same tokens, and not one draw repeated
