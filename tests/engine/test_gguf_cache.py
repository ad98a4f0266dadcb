"""The disk cache of a GGUF file's dequantized weights and tokenizer (minillm/loaders/gguf_cache.py): what comes
back from it is exactly what the file gives, a changed file is never read from a stale entry, and the cache can be
moved or turned off."""
import os

import pytest
import torch

import minillm
from minillm.loaders import gguf_cache, gguf_loader

TEXTS = ["The capital of France is", "  spaces,\ttabs\nand newlines ", "数字 12345 and émojis 🙂",
         "<|im_start|>user\nHi<|im_end|>"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MINILLM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_cached_load_equals_the_file_bit_for_bit(cache, monkeypatch):
    path = minillm.default_model_path()
    first, tok_first = minillm.load_model()  # reads the file, then writes the entry
    assert (gguf_cache.entry_dir(path, "model") / "model.safetensors").is_file()
    assert gguf_cache.tokenizer_dir(path) is not None

    def no_file(*a, **k):
        raise AssertionError("the second load read the GGUF file instead of the cache")

    monkeypatch.setattr(gguf_loader, "read_gguf_state", no_file)
    second, tok_second = minillm.load_model()
    assert second.config == first.config
    a, b = first.state_dict(), second.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert second.lm_head.weight is second.model.embed_tokens.weight  # tied as after a load from the file
    # the rotary buffers are re-created, not cached
    assert torch.equal(second.model.layers[0].self_attn.rotary_emb.inv_freq,
                       first.model.layers[0].self_attn.rotary_emb.inv_freq)
    for text in TEXTS:
        assert tok_second.encode(text) == tok_first.encode(text), text
    ids = minillm.chat_prompt_ids(tok_first, "What is the capital of France?")
    assert minillm.chat_prompt_ids(tok_second, "What is the capital of France?") == ids
    assert tok_second.decode(ids) == tok_first.decode(ids)
    assert (tok_second.eos_token_id, tok_second.bos_token_id, len(tok_second)) == \
        (tok_first.eos_token_id, tok_first.bos_token_id, len(tok_first))
    assert tok_second.chat_template == tok_first.chat_template


def test_the_key_follows_the_file_and_the_loader_version(cache, tmp_path, monkeypatch):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"x" * 10)
    before = gguf_cache.entry_dir(f, "model")
    os.utime(f, ns=(1, 1))
    touched = gguf_cache.entry_dir(f, "model")
    f.write_bytes(b"x" * 11)
    os.utime(f, ns=(1, 1))
    resized = gguf_cache.entry_dir(f, "model")
    monkeypatch.setattr(gguf_cache, "CACHE_VERSION", gguf_cache.CACHE_VERSION + 1)
    assert len({before, touched, resized, gguf_cache.entry_dir(f, "model")}) == 4
    assert before.parent.parent == cache


def test_off_writes_nothing_and_a_read_only_cache_only_costs_speed(tmp_path, monkeypatch):
    monkeypatch.setenv("MINILLM_CACHE_DIR", "off")
    assert gguf_cache.cache_root() is None and gguf_cache.entry_dir(minillm.default_model_path(), "model") is None
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("a file where the cache directory would go")
    monkeypatch.setenv("MINILLM_CACHE_DIR", str(blocked))
    gguf_cache.save_tokenizer(minillm.default_model_path(), object())  # cannot write there: not raised
    assert blocked.read_text().startswith("a file")


def test_a_second_writer_keeps_the_first_entry(cache, tmp_path):
    target = cache / "m" / "model"
    target.mkdir(parents=True)
    (target / "theirs").write_text("1")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "ours").write_text("2")
    gguf_cache._publish(mine, target)
    assert sorted(p.name for p in target.iterdir()) == ["theirs"] and not mine.exists()
