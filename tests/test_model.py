"""The model's building blocks and its contracts: RoPE, the Q/K un-permutation, chunked calls, bad input."""
import numpy as np
import pytest
import torch

from minillm.attention.contiguous import ContiguousKVCache
from minillm.config import LlamaConfig
from minillm.loaders.gguf_loader import unpermute_qk
from minillm.model.layers import RotaryEmbedding
from minillm.model.llama import LlamaForCausalLM

TINY = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=10000.0,
                   tie_word_embeddings=False)


def _tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(TINY)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return model.eval()


def test_unpermute_inverts_llama_cpp_permutation():
    heads, head_dim, cols = 3, 8, 5
    w = np.arange(heads * head_dim * cols, dtype=np.float32).reshape(heads * head_dim, cols)
    # llama.cpp's converter: reshape(heads, 2, head_dim // 2, cols).swapaxes(1, 2)
    permuted = w.reshape(heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(w.shape)
    np.testing.assert_array_equal(unpermute_qk(permuted, heads), w)
    np.testing.assert_array_equal(unpermute_qk(torch.from_numpy(permuted), heads).numpy(), w)


def test_rope_preserves_norm_and_is_relative():
    rope = RotaryEmbedding(16, 10000.0)
    q = torch.randn(1, 2, 16)
    k = torch.randn(1, 2, 16)
    dots = []
    for shift in (0, 7, 100):
        qr, kr = rope(torch.tensor([5 + shift]), q, k)
        _, kr2 = rope(torch.tensor([2 + shift]), q, k)
        assert torch.allclose(qr.norm(dim=-1), q.norm(dim=-1), atol=1e-5)
        dots.append((qr * kr2).sum(-1))
    # q.k after RoPE depends only on the distance between positions (5 - 2), not on the shift.
    assert torch.allclose(dots[0], dots[1], atol=1e-4) and torch.allclose(dots[0], dots[2], atol=1e-4)


def test_chunked_calls_equal_one_call():
    model = _tiny_model()
    ids = torch.randint(0, TINY.vocab_size, (11,))
    with torch.inference_mode():
        full = model(ids)
        cache = ContiguousKVCache.for_model(model, capacity=2)  # small capacity: exercises the growth path
        parts = [model(ids[a:b], torch.arange(a, b), attn=cache) for a, b in ((0, 4), (4, 5), (5, 11))]
    assert cache.num_tokens == 11
    # fp32, 2 layers: differences are rounding only (~1e-7); 1e-5 leaves margin.
    torch.testing.assert_close(torch.cat(parts), full, atol=1e-5, rtol=1e-5)


def test_bad_inputs_are_refused_clearly():
    model = _tiny_model()
    with pytest.raises(ValueError, match="1-D"):
        model(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 97\)"):
        model(torch.tensor([3, 97]))
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        LlamaConfig(num_attention_heads=9, num_key_value_heads=2)
    cache = ContiguousKVCache.for_model(model)
    with pytest.raises(ValueError, match="num_tokens must be in"):
        cache.truncate(5)


def test_kv_bytes_per_token_of_smollm2():
    # 2 (K and V) x 30 layers x 3 KV heads x 64 dims x 4 bytes (fp32)
    assert LlamaConfig().kv_cache_bytes_per_token(4) == 46080
