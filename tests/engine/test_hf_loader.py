"""The Hugging Face directory loader against transformers on a tiny random Llama saved with save_pretrained."""
import pytest
import torch
from transformers import LlamaConfig as HFLlamaConfig
from transformers import LlamaForCausalLM as HFLlama

import minillm
from minillm.loaders.hf_loader import config_from_hf


@pytest.mark.parametrize("tied", [False, True])
def test_hf_directory_matches_transformers(tmp_path, tied):
    torch.manual_seed(0)
    cfg = HFLlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                        rope_theta=500.0, tie_word_embeddings=tied)
    ref = HFLlama(cfg).eval()
    ref.save_pretrained(tmp_path)
    ours = minillm.load_model(tmp_path, tokenizer=False)
    assert ours.config.rope_theta == 500.0 and ours.config.num_key_value_heads == 2
    ids = torch.randint(0, 128, (40,))
    with torch.inference_mode():
        a = ours.compute_logits(ours(ids))
        b = ref(ids[None]).logits[0]
    # Random weights give logits of O(1); fp32 rounding is ~1e-6, so 1e-4 is tight enough to catch any error.
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_missing_paths_give_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        minillm.load_model(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        minillm.load_model(tmp_path, tokenizer=False)
    with pytest.raises(ValueError, match="Llama-family"):
        config_from_hf({"model_type": "gpt2"})
