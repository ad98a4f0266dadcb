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


def test_contiguous_cache_refuses_wrong_shapes_and_stays_unchanged():
    model = _tiny_model()  # 2 layers, 4 query heads, 2 KV heads, head_dim 8
    cache = ContiguousKVCache.for_model(model, capacity=4)
    q, k, v = torch.randn(3, 4, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    cache.forward(0, q, k, v)
    before = cache.keys(0).clone()
    bad_calls = {
        "wrong number of KV heads": ((q, torch.randn(3, 4, 8), torch.randn(3, 4, 8)), r"num_kv_heads=2.*\(3, 4, 8\)"),
        "wrong head_dim in k/v": ((q, torch.randn(3, 2, 4), torch.randn(3, 2, 4)), r"head_dim=8"),
        "k and v differ": ((q, k, torch.randn(3, 2, 8)[:2]), r"got k \(3, 2, 8\) and v \(2, 2, 8\)"),
        "k not 3-D": ((q, k.flatten(1), v.flatten(1)), r"k and v must both be"),
        "q heads not a multiple": ((torch.randn(3, 3, 8), k, v), r"multiple of num_kv_heads=2"),
        "q head_dim": ((torch.randn(3, 4, 6), k, v), r"head_dim=8"),
        "q and k token counts": ((torch.randn(2, 4, 8), k, v), r"same number of tokens, got 2 and 3"),
    }
    for name, (args, match) in bad_calls.items():
        with pytest.raises(ValueError, match=match):
            cache.forward(0, *args)
        assert cache.keys(0).shape[0] == 3 and torch.equal(cache.keys(0), before), f"{name}: cache changed"
    for layer in (2, -1):
        with pytest.raises(ValueError, match=rf"layer_idx must be in \[0, 2\), got {layer}"):
            cache.forward(layer, q, k, v)
    with pytest.raises(ValueError, match="num_kv_heads"):
        ContiguousKVCache(num_layers=2, num_kv_heads=0, head_dim=8)
