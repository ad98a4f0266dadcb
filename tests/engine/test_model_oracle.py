"""minillm's Llama and GGUF loader against transformers' own loading of the same GGUF file (the oracle).

Both dequantize the same Q4_1 weights to fp32, so the only differences are the order of floating-point operations.
Tolerance: max |logit difference| <= 1e-3. Logits of this model are O(10); fp32 rounding through 30 layers
accumulates to ~1e-5..1e-4 here (measured 6.5e-5 on the chat prompt), so 1e-3 leaves margin yet catches any real
bug (a wrong RoPE layout or a missing Q/K un-permutation gives errors of order 1-10).
"""
import pytest
import torch

import minillm
from tests.engine.prompts import CHAT_PROMPTS, PLAIN_PROMPTS

LOGIT_ATOL = 1e-3


def _prompt_ids(tokenizer):
    cases = [("plain:" + p[:20], tokenizer.encode(p)) for p in PLAIN_PROMPTS]
    cases += [("chat:" + p[:20], minillm.chat_prompt_ids(tokenizer, p)) for p in CHAT_PROMPTS]
    cases.append(("one token", [tokenizer.bos_token_id]))
    return cases


def test_prompt_lengths_cover_1_to_500(tokenizer):
    lengths = [len(ids) for _, ids in _prompt_ids(tokenizer)]
    assert min(lengths) == 1
    assert 400 <= max(lengths) <= 520, lengths
    assert len(lengths) >= 5


@pytest.mark.slow
def test_logits_match_transformers(model, tokenizer, hf_oracle):
    for name, ids in _prompt_ids(tokenizer):
        x = torch.tensor(ids)
        with torch.inference_mode():
            ours = model.compute_logits(model(x))
            theirs = hf_oracle(x[None]).logits[0].float()
        diff = (ours - theirs).abs().max().item()
        assert diff <= LOGIT_ATOL, f"{name} ({len(ids)} tokens): max |logit diff| {diff:.2e} > {LOGIT_ATOL}"
        assert torch.equal(ours.argmax(-1), theirs.argmax(-1)), f"{name}: argmax differs"


@pytest.mark.slow
def test_32_greedy_tokens_identical(model, tokenizer, hf_oracle):
    # Prompts whose greedy answers run past 32 tokens, so all 32 are compared (EOS would end both early).
    prompts = [minillm.chat_prompt_ids(tokenizer, "Tell me a long story about a lighthouse keeper."),
               tokenizer.encode(PLAIN_PROMPTS[1])]
    for prompt_ids in prompts:
        ours = minillm.generate(model, prompt_ids, max_new_tokens=32)
        with torch.inference_mode():
            out = hf_oracle.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids),
                                     dtype=torch.long), max_new_tokens=32, do_sample=False)
        theirs = out[0, len(prompt_ids):].tolist()
        assert len(ours) == 32, f"the answer ended after {len(ours)} tokens; choose a prompt with a longer answer"
        assert ours == theirs, f"greedy tokens differ:\n ours   {ours}\n theirs {theirs}"


def test_paris(model, tokenizer):
    ids = minillm.chat_prompt_ids(tokenizer, "What is the capital of France?")
    text = tokenizer.decode(minillm.generate(model, ids, max_new_tokens=16), skip_special_tokens=True)
    assert "Paris" in text, text


def test_config_read_from_gguf(model):
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.vocab_size, cfg.head_dim) == (30, 576, 9, 3, 49152, 64)
    assert cfg.rope_theta == 100000.0 and cfg.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight
