"""KV connectors (chapter 9): round trips, the scheduler's bookkeeping, failed transfers, and the prefill/decode
pair against one engine, in one process (shared storage) and in two (torch.distributed)."""
from __future__ import annotations

import json
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.config import KVTransferConfig
from minillm.distributed import JobExecutor
from minillm.distributed.disaggregation import disaggregated_worker, prefill_then_decode, run_requests
from minillm.distributed.kv_transfer import (KVConnectorFactory, KVConnectorRole, PromptKVConnectorMetadata, ReqMeta,
                                             SharedStorageConnector, prompt_key)
from minillm.distributed.kv_transfer.torch_distributed_connector import make_header, parse_header
from minillm.engine.arg_utils import EngineArgs
from minillm.engine.llm_engine import LLMEngine
from minillm.sampling_params import SamplingParams
from tests.engine_helpers import TINY, single_thread, tiny_model  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("single_thread")

# Chunked prefill (a 16-token budget cuts every prompt) and prefix caching (the chat template's common prefix).
PAIR_ARGS = dict(block_size=4, num_gpu_blocks=160, max_num_batched_tokens=16, max_model_len=256,
                 enable_prefix_caching=True, enable_chunked_prefill=True)
QUESTIONS = ["What is the capital of France?",
             "Write one sentence about why a long prompt is prefilled in chunks.",
             "What is the capital of France? Answer in one word.",
             "Name three colours."]


def storage(path, role: str) -> dict:
    return {"kv_connector": "SharedStorageConnector", "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": str(path)}}


def chat_ids(tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer.encode(text)


def one_engine(model, prompts, max_tokens, **args) -> dict[str, list[int]]:
    engine = LLMEngine(model, None, EngineArgs(**{**PAIR_ARGS, **args}))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return run_requests(engine, [(f"req-{i}", p, params) for i, p in enumerate(prompts)])


# -- configuration ----------------------------------------------------------------------------------------------------
def test_config_and_factory_errors_name_what_is_allowed(tmp_path):
    with pytest.raises(ValueError, match="kv_role must be one of"):
        KVTransferConfig("SharedStorageConnector", kv_role="producer")
    with pytest.raises(ValueError, match="unknown key"):
        KVTransferConfig.from_any({"kv_connector": "SharedStorageConnector", "role": "kv_producer"})
    with pytest.raises(ValueError, match="JSON"):
        KVTransferConfig.from_any("{not json")
    assert KVTransferConfig.from_any(json.dumps(storage(tmp_path, "kv_consumer"))).is_kv_consumer
    with pytest.raises(ValueError, match="built in: .*SharedStorageConnector"):
        KVConnectorFactory.create_connector(KVTransferConfig("NoSuchConnector"), KVConnectorRole.WORKER, TINY, 4)
    with pytest.raises(ValueError, match="peer_rank"):
        KVConnectorFactory.create_connector(KVTransferConfig("TorchDistributedConnector"), KVConnectorRole.WORKER,
                                            TINY, 4)
    with pytest.raises(ValueError, match="kv_transfer_config"):
        EngineArgs(kv_transfer_config=42)


def test_header_round_trip_and_refusals():
    assert parse_header(make_header("req-7 ünïcode", 123, 456)) == ("req-7 ünïcode", 123, 456)
    with pytest.raises(ValueError, match="not a KV transfer header"):
        parse_header(torch.zeros(260, dtype=torch.int64))
    with pytest.raises(ValueError, match="at most 256"):
        make_header("x" * 300, 1, 0)


# -- the connector alone: save, then load into other blocks ---------------------------------------------------------
def random_caches(num_blocks: int, block_size: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, TINY.num_key_value_heads, TINY.head_dim)
    return [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(TINY.num_hidden_layers)]


@settings(max_examples=25, deadline=None)
@given(block_size=st.sampled_from([1, 2, 4, 16]), num_tokens=st.integers(1, 40), data=st.data())
def test_shared_storage_save_then_load_gives_identical_kv(tmp_path_factory, block_size, num_tokens, data):
    path = tmp_path_factory.mktemp("kv")
    num_blocks = -(-num_tokens // block_size)
    pool = list(range(1, 3 * num_blocks + 2))
    src_blocks = data.draw(st.permutations(pool))[:num_blocks]
    dst_blocks = data.draw(st.permutations(pool))[:num_blocks]
    start = data.draw(st.integers(0, num_tokens - 1))  # a local prefix hit the load must not overwrite
    config = KVTransferConfig(**storage(path, "kv_both"))
    saver = SharedStorageConnector(config, KVConnectorRole.WORKER, TINY, block_size)
    loader = SharedStorageConnector(config, KVConnectorRole.WORKER, TINY, block_size)
    src = random_caches(len(pool) + 1, block_size, 0)
    dst = random_caches(len(pool) + 1, block_size, 1)
    before = [(k.clone(), v.clone()) for k, v in dst]
    saver.register_kv_caches(src)
    loader.register_kv_caches(dst)
    key = prompt_key(list(range(num_tokens)))

    saver.bind_connector_metadata(PromptKVConnectorMetadata(saves=[ReqMeta("a", key, src_blocks, 0, num_tokens)]))
    for layer, kv_layer in enumerate(src):
        saver.save_kv_layer(layer, kv_layer, None)
    saver.wait_for_save()
    loader.bind_connector_metadata(PromptKVConnectorMetadata(loads=[ReqMeta("b", key, dst_blocks, start, num_tokens)]))
    loader.start_load_kv()
    assert loader.get_block_ids_with_load_errors() == set()

    def rows(caches, blocks, a, b):
        return [torch.stack([k[blocks[p // block_size], p % block_size] for p in range(a, b)]) for k, _ in caches] + \
               [torch.stack([v[blocks[p // block_size], p % block_size] for p in range(a, b)]) for _, v in caches]
    for got, want in zip(rows(dst, dst_blocks, start, num_tokens), rows(src, src_blocks, start, num_tokens)):
        assert torch.equal(got, want)
    if start:  # the positions before the load's start keep what they had
        for got, want in zip(rows(dst, dst_blocks, 0, start), rows(before, dst_blocks, 0, start)):
            assert torch.equal(got, want)


def test_a_damaged_file_is_a_load_error_on_the_blocks_it_should_fill(tmp_path):
    config = KVTransferConfig(**storage(tmp_path, "kv_both"))
    conn = SharedStorageConnector(config, KVConnectorRole.WORKER, TINY, 4)
    caches = random_caches(8, 4, 0)
    conn.register_kv_caches(caches)
    conn.bind_connector_metadata(PromptKVConnectorMetadata(saves=[ReqMeta("a", "k", [1, 2, 3], 0, 10)]))
    for layer, kv_layer in enumerate(caches):
        conn.save_kv_layer(layer, kv_layer, None)
    conn.wait_for_save()
    (tmp_path / "k" / "layer_1.safetensors").write_bytes(b"truncated")
    before = [k.clone() for k, _ in caches]
    conn.bind_connector_metadata(PromptKVConnectorMetadata(loads=[ReqMeta("b", "k", [4, 5, 6], 4, 10)]))
    conn.start_load_kv()
    assert conn.get_block_ids_with_load_errors() == {5, 6}  # positions 4..9 live in the 2nd and 3rd blocks
    assert all(torch.equal(k, b) for (k, _), b in zip(caches, before)), "a failed load must write nothing"


# -- the scheduler: a request whose K/V has not arrived waits, others go ahead -------------------------------------
class NotYetConnector(SharedStorageConnector):
    """Answers "not yet" for ``extra["late"]`` until ``extra["ready"]`` is set."""

    def _num_available_tokens(self, request):
        extra = self._config.kv_connector_extra_config
        if request.request_id in extra["late"] and not extra.get("ready"):
            return None
        return super()._num_available_tokens(request)


def test_a_request_waiting_for_its_kv_lets_others_run(tmp_path):
    model = tiny_model()
    extra = {"shared_storage_path": str(tmp_path), "late": {"req-0"}}
    args = dict(PAIR_ARGS, kv_transfer_config={"kv_connector": "NotYetConnector", "kv_role": "kv_consumer",
                                               "kv_connector_extra_config": extra,
                                               "kv_connector_module_path": __name__})
    engine = LLMEngine(model, None, EngineArgs(**args))
    params = SamplingParams(max_tokens=8, temperature=0.0)
    engine.add_request("req-0", list(range(1, 11)), params)
    engine.add_request("req-1", list(range(20, 30)), params)
    for _ in range(3):
        engine.step()
    assert [r.request_id for r in engine.scheduler.waiting] == ["req-0"], "req-0 waits, in its place"
    assert engine.scheduler.requests["req-1"].num_output_tokens > 0, "req-1 went ahead"
    extra["ready"] = True
    outputs = run_requests(engine, [])
    assert set(outputs) == {"req-0", "req-1"}
    assert engine.get_num_free_blocks() == engine.num_gpu_blocks - 1


# -- the pair in one process: shared storage --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chat_prompts(tokenizer):
    return [chat_ids(tokenizer, q) for q in QUESTIONS]


@pytest.fixture(scope="module")
def reference(model, chat_prompts):
    return one_engine(model, chat_prompts, 10)


def pair(model, path, prompts):
    prefill = LLMEngine(model, None, EngineArgs(**PAIR_ARGS, kv_transfer_config=storage(path, "kv_producer")))
    decode = LLMEngine(model, None, EngineArgs(**PAIR_ARGS, kv_transfer_config=storage(path, "kv_consumer")))
    return prefill, decode


def test_shared_storage_pair_equals_one_engine_on_smollm2(model, chat_prompts, reference, tmp_path):
    prefill, decode = pair(model, tmp_path, chat_prompts)
    got = prefill_then_decode(prefill, decode, chat_prompts, SamplingParams(max_tokens=10, temperature=0.0))
    assert got == reference
    # Every prompt token but the last came from the prefill engine or the decode engine's own prefix cache.
    assert decode.stats.num_external_prompt_tokens + decode.stats.num_cached_prompt_tokens == \
        sum(len(p) - 1 for p in chat_prompts)
    assert decode.stats.num_external_prompt_tokens > 0
    assert decode.stats.num_scheduled_tokens == sum(len(t) for t in got.values()), "only the last prompt token and " \
        "the decodes ran on the decode engine"
    for engine in (prefill, decode):
        assert engine.get_num_free_blocks() == engine.num_gpu_blocks - 1


@pytest.mark.parametrize("damage", ["no meta.json (a writer died)", "a truncated layer file", "too few tokens"])
def test_a_failed_transfer_recomputes_and_leaks_nothing(model, chat_prompts, reference, tmp_path, damage):
    prefill, decode = pair(model, tmp_path, chat_prompts)
    params = SamplingParams(max_tokens=10, temperature=0.0)
    run_requests(prefill, [(f"req-{i}", p, params.clone(max_tokens=1)) for i, p in enumerate(chat_prompts)])
    victim = tmp_path / prompt_key(chat_prompts[1])
    if damage.startswith("no meta"):
        (victim / "meta.json").unlink()
    elif damage.startswith("a truncated"):
        (victim / "layer_7.safetensors").write_bytes(b"\0" * 10)
    else:
        meta = json.loads((victim / "meta.json").read_text())
        import safetensors.torch
        for layer in range(meta["num_layers"]):
            f = str(victim / f"layer_{layer}.safetensors")
            safetensors.torch.save_file({"kv": safetensors.torch.load_file(f)["kv"][:, :3].contiguous()}, f)
    got = run_requests(decode, [(f"req-{i}", p, params) for i, p in enumerate(chat_prompts)])
    assert got == reference
    worker = decode.kv_connector_worker
    assert worker.stats["failed_loads"] == (0 if damage.startswith("no meta") else 1)
    assert worker.stats["loaded_requests"] == len(chat_prompts) - 1
    assert decode.get_num_free_blocks() == decode.num_gpu_blocks - 1
    # The blocks that failed to load stayed in the prefix cache and were recomputed in place (v0.33.0 under
    # "recompute"): the same prompt again gives the same tokens.
    again = run_requests(decode, [("again", chat_prompts[1], params)])
    assert again["again"] == reference["req-1"]


# -- the pair in two processes: torch.distributed -------------------------------------------------------------------
@pytest.fixture(scope="module")
def executor(model):
    with JobExecutor({"smollm": model}, world_size=2, timeout_s=60.0) as ex:
        yield ex
    assert ex.alive_ranks == []


@pytest.mark.timeout(240)
def test_torch_distributed_pair_equals_one_engine_on_smollm2(executor, chat_prompts, reference):
    prefill, decode = executor.run_job(disaggregated_worker, kwargs=dict(
        model="smollm", prompts=chat_prompts, max_tokens=10, engine_kwargs=PAIR_ARGS))
    assert decode["outputs"] == reference
    cfg = executor.configs["smollm"]
    sent_tokens = sum(len(p) for p in chat_prompts)
    assert prefill["bytes_sent"] == decode["bytes_received"] == sent_tokens * cfg.kv_cache_bytes_per_token(4)
    assert decode["stats"]["num_external_prompt_tokens"] + decode["stats"]["num_cached_prompt_tokens"] == \
        sum(len(p) - 1 for p in chat_prompts)
    # The prefill engine's requests finished before their sends did: their blocks were held, then all came back.
    assert any(rec["pending_sends"] for rec in prefill["trace"])
    for rank in (prefill, decode):
        assert rank["free_blocks"] == rank["num_blocks"] - 1


@pytest.mark.timeout(240)
def test_damaged_and_lost_transfers_recompute(executor, chat_prompts, reference):
    prefill, decode = executor.run_job(disaggregated_worker, kwargs=dict(
        model="smollm", prompts=chat_prompts, max_tokens=10, engine_kwargs=PAIR_ARGS,
        connector="CorruptingConnector", connector_module_path="tests.engine.kv_faults",
        producer_extra={"corrupt": ["req-1"], "drop": ["req-2"]}, transfer_timeout_s=3.0))
    assert decode["outputs"] == reference
    assert decode["connector_stats"]["loaded_requests"] == len(chat_prompts) - 2
    for rank in (prefill, decode):
        assert rank["free_blocks"] == rank["num_blocks"] - 1
