"""Rejection sampling of draft tokens: output layout with placeholders, greedy exactness, distribution kept."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from minillm.outputs import PLACEHOLDER_TOKEN_ID
from minillm.sample import RejectionSampler, SamplingMetadata, assemble_spec_output, make_generator
from minillm.sample.logits_indices import compute_spec_decode_logits_indices
from minillm.sampling_params import SamplingParams
from minillm.spec_decode.metadata import SpecDecodeMetadata
from minillm.spec_decode.ngram_proposer import NgramProposer


def ref_assemble(drafts, accepted, recovered, bonus):
    """Per request, the obvious loop."""
    width = max((len(d) for d in drafts), default=0) + 1
    out = []
    for d, a, r, b in zip(drafts, accepted, recovered, bonus):
        row = []
        for j in range(len(d)):
            if a[j]:
                row.append(d[j])
            else:
                row.append(r[j])
                break
        else:
            row.append(b)
        out.append(row + [PLACEHOLDER_TOKEN_ID] * (width - len(row)))
    return out


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=6), st.data())
def test_assemble_matches_loop(num_draft, data):
    drafts = [data.draw(st.lists(st.integers(0, 99), min_size=n, max_size=n)) for n in num_draft]
    accepted = [data.draw(st.lists(st.booleans(), min_size=n, max_size=n)) for n in num_draft]
    recovered = [data.draw(st.lists(st.integers(0, 99), min_size=n, max_size=n)) for n in num_draft]
    bonus = data.draw(st.lists(st.integers(0, 99), min_size=len(num_draft), max_size=len(num_draft)))
    flat = lambda xs, dt: torch.tensor([v for x in xs for v in x], dtype=dt)  # noqa: E731
    got = assemble_spec_output(flat(drafts, torch.long), flat(accepted, torch.bool), flat(recovered, torch.long),
                               torch.tensor(bonus), num_draft)
    assert got.dtype == torch.int32 and got.shape == (len(num_draft), max(num_draft) + 1)
    assert got.tolist() == ref_assemble(drafts, accepted, recovered, bonus)


def test_spec_decode_logits_indices():
    # Request 0: a prefill chunk of 5 (no drafts); request 1: 1 token + 2 drafts; request 2: 1 token + 1 draft.
    qsl = torch.tensor([0, 5, 8, 10])
    li, target, bonus = compute_spec_decode_logits_indices(qsl, [0, 2, 1])
    assert li.tolist() == [4, 5, 6, 7, 8, 9]
    assert target.tolist() == [1, 2, 4] and bonus.tolist() == [0, 3, 5]
    with pytest.raises(ValueError, match="num_draft_tokens"):
        compute_spec_decode_logits_indices(qsl, [0, 3, 1])
    md = SpecDecodeMetadata.make([[7, 8], [], [9]])
    assert md.max_spec_len == 2 and md.draft_lists() == [[7, 8], [], [9]]
    assert md.logits_indices.tolist() == [0, 1, 2, 3, 4, 5] and md.bonus_logits_indices.tolist() == [2, 3, 5]


def greedy_reference(target_rows, drafts):
    """What plain greedy decoding would emit: argmax at each position until the first draft differs."""
    out, r = [], 0
    for d in drafts:
        row = []
        for j in range(len(d) + 1):
            tok = int(target_rows[r + j].argmax())
            row.append(tok)
            if j == len(d) or d[j] != tok:
                break
        out.append(row)
        r += len(d) + 1
    return out


@pytest.mark.parametrize("seed", range(5))
def test_greedy_verification_gives_exactly_the_greedy_tokens(seed):
    g = torch.Generator().manual_seed(seed)
    V = 8  # small vocabulary so drafts often match
    num = [3, 0, 2, 4, 1]
    rows = sum(num) + len(num)
    logits = torch.randn(rows, V, generator=g)
    argmax = logits.argmax(-1).tolist()
    drafts, r = [], 0
    for n in num:  # half the drafts are the target's argmax, half random
        drafts.append([argmax[r + j] if torch.rand(1, generator=g) < 0.7 else int(torch.randint(V, (1,), generator=g))
                       for j in range(n)])
        r += n + 1
    sm = SpecDecodeMetadata.make(drafts)
    md = SamplingMetadata.from_params([SamplingParams.greedy()] * len(num))
    out = RejectionSampler()(sm, None, logits, md).sampled_token_ids
    assert out.shape == (5, 5) and out.dtype == torch.int32
    assert RejectionSampler.parse_output(out, V) == greedy_reference(logits, drafts)


def test_all_drafts_right_gives_bonus_and_placeholders():
    V = 6
    logits = torch.full((4, V), -5.0)
    for r, t in enumerate([1, 2, 3, 4]):
        logits[r, t] = 5.0
    md = SamplingMetadata.from_params([SamplingParams.greedy()])
    out = RejectionSampler()(SpecDecodeMetadata.make([[1, 2, 3]]), None, logits, md).sampled_token_ids
    assert out.tolist() == [[1, 2, 3, 4]]  # three accepted drafts + the bonus token
    out = RejectionSampler()(SpecDecodeMetadata.make([[1, 0, 3]]), None, logits, md).sampled_token_ids
    assert out.tolist() == [[1, 2, -1, -1]]  # second draft wrong: the target's token, then placeholders
    # No drafts at all: [num_reqs, 1], like the plain sampler.
    out = RejectionSampler()(SpecDecodeMetadata.make([[]]), None, logits[:1], md).sampled_token_ids
    assert out.tolist() == [[1]]
    with pytest.raises(ValueError, match="rows"):
        RejectionSampler()(SpecDecodeMetadata.make([[1]]), None, logits, md)


def first_token_counts(p_logits, drafts, draft_probs, V):
    n = len(drafts)
    logits = torch.stack([p_logits, torch.zeros(V)]).repeat(n, 1)  # [draft row, bonus row] per request
    sm = SpecDecodeMetadata.make([[d] for d in drafts])
    md = SamplingMetadata.from_params([SamplingParams()] * n)
    out = RejectionSampler()(sm, draft_probs, logits, md).sampled_token_ids
    assert bool((out[:, 0] >= 0).all())
    return np.bincount(out[:, 0].numpy(), minlength=V)


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_probabilistic_rule_keeps_the_target_distribution(with_draft_probs):
    """Whatever the draft, the first emitted token is distributed as the target p (chi-square)."""
    torch.manual_seed(7)
    V, n = 6, 30000
    p_logits = torch.tensor([1.0, 0.2, -0.5, 2.0, -1.0, 0.0])
    p = torch.softmax(p_logits.double(), 0).numpy()
    if with_draft_probs:
        q = torch.tensor([0.05, 0.4, 0.3, 0.1, 0.1, 0.05])
        drafts = torch.multinomial(q, n, replacement=True).tolist()
        draft_probs = q.expand(n, V).contiguous()
    else:  # n-gram drafter: always proposes token 1, with no probability attached
        drafts, draft_probs = [1] * n, None
    counts = first_token_counts(p_logits, drafts, draft_probs, V)
    p = p / p.sum()
    _, pvalue = stats.chisquare(counts, p * counts.sum())
    assert pvalue > 1e-3, (pvalue, counts / n, p)
    # And the check has teeth: the draft distribution itself is rejected.
    if with_draft_probs:
        qd = q.double().numpy()
        assert stats.chisquare(counts, qd / qd.sum() * counts.sum()).pvalue < 1e-6


def test_seeded_request_is_reproducible_in_any_batch():
    V = 50
    g = torch.Generator().manual_seed(3)
    mine = torch.randn(4, V, generator=g)  # 3 drafts + bonus
    other = torch.randn(2, V, generator=g)
    p = SamplingParams(seed=11, temperature=1.0)
    alone = RejectionSampler()(SpecDecodeMetadata.make([[1, 2, 3]]), None, mine,
                               SamplingMetadata.from_params([p])).sampled_token_ids[0]
    torch.manual_seed(1)
    both = RejectionSampler()(SpecDecodeMetadata.make([[4], [1, 2, 3]]), None, torch.cat([other, mine]),
                              SamplingMetadata.from_params([SamplingParams(), p])).sampled_token_ids[1]
    assert alone.tolist() == both.tolist()


def test_mixed_greedy_and_random_batch_shapes():
    V = 30
    logits = torch.randn(2 + 4 + 1, V)
    md = SamplingMetadata.from_params([SamplingParams.greedy(), SamplingParams(top_k=5), SamplingParams(seed=1)],
                                      generators={2: make_generator(1)})
    out = RejectionSampler()(SpecDecodeMetadata.make([[3], [1, 2, 3], []]), None, logits, md).sampled_token_ids
    assert out.shape == (3, 4) and out.dtype == torch.int32
    parsed = RejectionSampler.parse_output(out, V)
    assert [len(r) for r in parsed][2] == 1 and all(1 <= len(r) <= 4 for r in parsed)
    for row in out.tolist():  # placeholders only after the real tokens
        real = [t != PLACEHOLDER_TOKEN_ID for t in row]
        assert real == sorted(real, reverse=True)


def test_ngram_proposer():
    prop = NgramProposer(prompt_lookup_min=1, prompt_lookup_max=3, num_speculative_tokens=2)
    assert prop.propose([1, 2, 3, 4, 1, 2]) == [3, 4]  # suffix [1, 2] seen at the start
    assert prop.propose([1, 2, 3, 9, 2, 3, 5, 2, 3]) == [9, 2]  # longest match first, earliest occurrence
    assert prop.propose([5, 6, 7]) == []
    assert prop.propose([7]) == []
    assert NgramProposer(2, 2, 5).propose([1, 2, 3, 1, 2]) == [3, 1, 2]  # stops at the end of the sequence
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(prompt_lookup_min=0)
    with pytest.raises(ValueError, match="prompt_lookup_max"):
        NgramProposer(3, 2)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        NgramProposer(num_speculative_tokens=0)


@pytest.mark.slow
def test_spec_decode_on_the_real_model_equals_plain_greedy(model, tokenizer):
    """n-gram drafts verified by SmolLM2 give token for token what greedy decoding gives."""
    import minillm

    prompt = minillm.chat_prompt_ids(tokenizer, "Repeat exactly: the cat sat on the mat, the cat sat on the mat.")
    want = minillm.generate(model, prompt, max_new_tokens=12)
    prop = NgramProposer(1, 3, 3)
    cache = model.new_kv_cache(capacity=len(prompt) + 40)
    md = SamplingMetadata.from_params([SamplingParams.greedy()])
    tokens, out = list(prompt), []
    pending = list(prompt)  # tokens not yet in the KV cache
    accepted_drafts = 0
    with torch.inference_mode():
        while len(out) < len(want):
            drafts = prop.propose(tokens)[: len(want) - len(out) - 1]
            ids = pending + drafts
            start = cache.num_tokens
            hidden = model(torch.tensor(ids), torch.arange(start, start + len(ids)), attn=cache)
            logits = model.compute_logits(hidden[len(ids) - len(drafts) - 1:])
            sampled = RejectionSampler()(SpecDecodeMetadata.make([drafts]), None, logits, md).sampled_token_ids
            new = RejectionSampler.parse_output(sampled, logits.shape[1])[0]
            accepted_drafts += len(new) - 1
            cache.truncate(start + len(pending) + len(new) - 1)  # drop K/V of rejected drafts
            tokens += new
            out += new
            pending = [new[-1]]
    assert out[: len(want)] == want
    assert accepted_drafts > 0  # the drafter helped at least once
