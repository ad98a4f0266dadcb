"""Start-up as vLLM v0.33.0's: the executor builds each worker from ``(Worker, kwargs)``, each loads its own model or
tensor-parallel shard, reports its KV cache spec and bytes, and the engine core sizes the cache from the smallest
report (``get_kv_cache_configs``) before every worker allocates it (``initialize_from_config``).

Checked: the reports and the minimum (real ranks of a worker class whose budget depends on the rank), the same block
counts as ``EngineArgs.resolved_num_gpu_blocks``, vLLM-style errors with the numbers when a rank's budget holds fewer
than 2 blocks, a rank's shard read slice by slice (equal to the shard cut from the full model, its bytes only), and an
engine core that never holds the whole model with ``tensor_parallel_size > 1`` (no loader runs in its process, its
live tensor bytes do not grow by the model's, it keeps no reference to a model object, the temporary checkpoint is
gone once the ranks are up).
"""
from __future__ import annotations

import gc
import os
import warnings
import weakref

import pytest
import torch

from minillm.core.kv_cache_utils import get_kv_cache_configs
from minillm.engine.arg_utils import EngineArgs
from minillm.engine.core import EngineCore
from minillm.engine.llm_engine import LLMEngine
from minillm.executor.multiproc_executor import MultiprocExecutor
from minillm.kv_cache_interface import FullAttentionSpec
from minillm.loaders.sharded_loader import (
    StateDictSource,
    TemporaryCheckpoint,
    load_shard_weights,
    load_tensor_parallel_model,
    save_checkpoint,
)
from minillm.model.llama_tp import TensorParallelLlamaForCausalLM, shard_summary
from minillm.sampling_params import SamplingParams
from minillm.worker.worker import Worker
from tests.engine_helpers import TINY, single_thread, tiny_model  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")

F32 = torch.float32


def spec(num_kv_heads: int, layers: int = 2, block_size: int = 4) -> dict[str, FullAttentionSpec]:
    return {f"model.layers.{i}.self_attn": FullAttentionSpec(block_size, num_kv_heads, 16, F32)
            for i in range(layers)}


def param_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def generate(eng: LLMEngine) -> list[int]:
    eng.add_request("a", list(range(1, 20)), SamplingParams(temperature=0.0, max_tokens=8))
    tokens: list[int] = []
    while eng.has_unfinished_requests():
        for out in eng.step():
            tokens = list(out.outputs[0].token_ids)
    return tokens


# -- the core's arithmetic ---------------------------------------------------------------------------------------
def test_the_core_takes_the_smallest_count_over_the_reports():
    # Rank 1 caches 2 KV heads in the same bytes: half the blocks; every rank gets its count.
    one_block = spec(1)["model.layers.0.self_attn"].page_size_bytes * 2  # 2 layers: 2 * 4 * 1 * 16 * 4 * 2 = 1024
    assert one_block == 1024
    configs = get_kv_cache_configs([spec(1), spec(2)], [100 * 1024, 100 * 1024])
    assert [c.num_blocks for c in configs] == [50, 50]
    assert [c.bytes_per_block for c in configs] == [1024, 2048]
    # The same spec and less memory on one rank: its count.
    assert [c.num_blocks for c in get_kv_cache_configs([spec(1)] * 3, [10_000, 7_000, 9_999])] == [6, 6, 6]
    # num_gpu_blocks wins over the bytes, as vLLM's num_gpu_blocks_override.
    assert [c.num_blocks for c in get_kv_cache_configs([spec(1)] * 2, [10_000, 1], 40)] == [40, 40]


def test_a_rank_with_room_for_fewer_than_two_blocks_is_refused_with_its_numbers():
    with pytest.raises(ValueError, match=r"No available memory for the cache blocks: worker rank 1 can give its KV "
                                         r"cache 1,500 bytes, and one block of its cache \(2 layers\) takes 1,024 "
                                         r"bytes; it needs at least 2 blocks \(2,048 bytes"):
        get_kv_cache_configs([spec(1), spec(1)], [100_000, 1_500])
    with pytest.raises(ValueError, match="one KV cache spec and one memory report per worker"):
        get_kv_cache_configs([spec(1)], [1, 2])
    # Through the engine: each worker's own budget (in this process).
    with pytest.raises(ValueError, match=r"worker rank 0 can give its KV cache 3,000 bytes, and one block of its "
                                         r"cache \(2 layers\) takes 2,048 bytes"):
        EngineCore(tiny_model(), EngineArgs(block_size=4, kv_cache_memory_bytes=3000, max_model_len=8))


@pytest.mark.parametrize("args", [
    dict(block_size=4, kv_cache_memory_bytes=1 << 20, max_model_len=64),
    dict(block_size=16, max_model_len=512),                    # the default budget (512 MiB)
    dict(block_size=4, num_gpu_blocks=40, max_model_len=64),   # an explicit count
])
def test_one_worker_reports_its_budget_and_the_count_is_engine_args(args):
    engine_args = EngineArgs(**args)
    core = EngineCore(tiny_model(), engine_args)
    try:
        want = engine_args.resolved_num_gpu_blocks(TINY, core.max_model_len, F32)
        assert core.num_gpu_blocks == want == core.scheduler.kv_cache_manager.block_pool.num_blocks
        budget = args.get("kv_cache_memory_bytes", 512 * 2 ** 20)
        assert core.available_kv_cache_memory == [budget]
        assert core.model_runner is not None and core.model_runner.kv_caches[0][0].shape[0] == want
    finally:
        core.shutdown()


def test_a_worker_starts_in_vllms_order():
    worker = Worker(tiny_model(), block_size=4, max_model_len=64, kv_cache_memory_bytes=1 << 20)
    with pytest.raises(RuntimeError, match="load_model"):
        worker.get_kv_cache_spec()
    with pytest.raises(RuntimeError, match="initialize_from_config"):
        _ = worker.model_runner
    worker.init_device()
    worker.load_model()
    specs = worker.get_kv_cache_spec()
    assert list(specs) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert specs["model.layers.0.self_attn"] == FullAttentionSpec(4, TINY.num_key_value_heads, TINY.head_dim, F32)
    assert worker.determine_available_memory() == 1 << 20
    worker.initialize_from_config(get_kv_cache_configs([specs], [1 << 20]))
    assert worker.describe()["kv_cache_shape"] == ((1 << 20) // 2048, 4, 2, 16)
    with pytest.raises(TypeError, match="initialize_from_config, not from num_blocks"):
        Worker(tiny_model(), block_size=4, num_blocks=40)


# -- a rank's shard, read from the checkpoint ----------------------------------------------------------------
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_a_rank_reads_only_its_shard(tmp_path, tp):
    model = tiny_model()
    save_checkpoint(model, tmp_path)
    full = param_bytes(model)
    norms = (2 * TINY.num_hidden_layers + 1) * TINY.hidden_size * 4  # replicated on every rank
    total_read = 0
    for rank in range(tp):
        shard, read = load_tensor_parallel_model(tmp_path, tp_rank=rank, tp_size=tp)
        total_read += read
        want = TensorParallelLlamaForCausalLM(model, tp_rank=rank, tp_size=tp)
        got_state, want_state = shard.state_dict(), want.state_dict()
        assert got_state.keys() == want_state.keys()
        assert all(torch.equal(got_state[k], want_state[k]) for k in want_state)
        assert shard.lm_head.weight is shard.model.embed_tokens.weight  # still tied
        assert shard.param_bytes() == shard_summary(TINY, tp)[rank].param_bytes
        emb = shard.model.embed_tokens
        padding = (emb.num_embeddings_per_partition - (emb.end - emb.start)) * TINY.hidden_size * 4
        assert read == shard.param_bytes() - padding  # its slices only (its vocabulary padding is zeros)
    if tp <= TINY.num_key_value_heads:  # no KV head replicated: the ranks read the model once, the norms tp times
        assert total_read == full + (tp - 1) * norms
    # bf16 from an fp32 checkpoint: as the full model cast, then cut.
    shard, _ = load_tensor_parallel_model(tmp_path, tp_rank=1, tp_size=2, dtype=torch.bfloat16)
    want = TensorParallelLlamaForCausalLM(model.to(torch.bfloat16), tp_rank=1, tp_size=2)
    assert all(torch.equal(a, b) for a, b in zip(shard.state_dict().values(), want.state_dict().values(), strict=True))


def test_a_state_dict_source_gives_the_same_shard():
    model = tiny_model()
    shard = TensorParallelLlamaForCausalLM(tiny_model(seed=1), tp_rank=1, tp_size=2)  # other weights, same shapes
    with torch.no_grad():
        load_shard_weights(shard, StateDictSource(dict(model.state_dict())))
    want = TensorParallelLlamaForCausalLM(model, tp_rank=1, tp_size=2)
    assert all(torch.equal(a, b) for a, b in zip(shard.state_dict().values(), want.state_dict().values(), strict=True))


def test_one_worker_loads_a_checkpoint_path_itself(tmp_path):
    save_checkpoint(tiny_model(), tmp_path)
    args = dict(block_size=4, num_gpu_blocks=40, max_model_len=64)
    from_object = LLMEngine(tiny_model(), None, EngineArgs(**args))
    from_path = LLMEngine(None, None, EngineArgs(model=str(tmp_path), **args))
    try:
        assert from_path.model_config == TINY
        assert generate(from_path) == generate(from_object)
    finally:
        from_object.shutdown()
        from_path.shutdown()


# -- real ranks ------------------------------------------------------------------------------------------------
class RankBudgetWorker(Worker):
    """Rank ``r`` reports ``(r + 1) * 64 KiB`` less than its budget (module-level: the ranks import it by name)."""

    def determine_available_memory(self) -> int:
        return super().determine_available_memory() - (self.rank + 1) * 65536


@pytest.mark.slow
def test_real_ranks_report_and_allocate_the_smallest_count():
    budget = 1 << 20
    with MultiprocExecutor(2, RankBudgetWorker, dict(model=tiny_model(), block_size=4, max_model_len=64,
                                                     kv_cache_memory_bytes=budget)) as ex:
        specs, available = ex.get_kv_cache_specs(), ex.determine_available_memory()
        assert available == [budget - 65536, budget - 2 * 65536]
        one_block = 2 * 4 * 1 * 16 * 4 * 2  # K and V, block 4, one KV head per rank, head_dim 16, fp32, 2 layers
        assert [sum(s.page_size_bytes for s in sp.values()) for sp in specs] == [one_block, one_block]
        assert [i["kv_cache_shape"] for i in ex.worker_info] == [None, None]  # loaded, no cache yet
        configs = get_kv_cache_configs(specs, available)
        ex.initialize_from_config(configs)
        assert [i["kv_cache_shape"][0] for i in ex.worker_info] == [available[1] // one_block] * 2


def _live_tensor_bytes() -> int:
    """Bytes of every tensor storage alive in this process (each storage counted once)."""
    seen: dict[int, int] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance() on some deprecated torch objects warns
        for obj in gc.get_objects():
            try:
                if isinstance(obj, torch.Tensor) and not obj.is_meta:
                    storage = obj.untyped_storage()
                    seen[storage.data_ptr()] = storage.nbytes()
            except Exception:  # noqa: BLE001, S112 - some objects fail isinstance, some tensors have no storage
                continue
    return sum(seen.values())


def _refuse(*args, **kwargs):
    raise AssertionError("the engine core's process must not load weights with tensor_parallel_size > 1")


@pytest.mark.slow
def test_the_core_never_holds_the_whole_model_with_tensor_parallelism(tmp_path, monkeypatch):
    model = tiny_model()
    save_checkpoint(model, tmp_path)
    full = param_bytes(model)
    del model
    gc.collect()
    # No loader may run in this process (the ranks are spawned: they do not see the patches).
    import safetensors.torch

    import minillm.loaders.load
    import minillm.loaders.sharded_loader

    monkeypatch.setattr(minillm.loaders.load, "load_model", _refuse)
    monkeypatch.setattr(minillm.loaders.sharded_loader, "open_checkpoint", _refuse)
    monkeypatch.setattr(safetensors.torch, "load_file", _refuse)
    before = _live_tensor_bytes()
    core = EngineCore(None, EngineArgs(model=str(tmp_path), tensor_parallel_size=2, block_size=4,
                                       kv_cache_memory_bytes=1 << 20, max_model_len=64))
    try:
        grew = _live_tensor_bytes() - before
        info = core.model_executor.worker_info
        ranks = [i["param_bytes"] for i in info]
        read = [i["checkpoint_bytes_read"] for i in info]
        print(f"full model {full} B; core process grew by {grew} B of tensors; ranks hold {ranks} B, "
              f"read {read} B of the checkpoint")
        assert grew < full // 10, (grew, full)
        assert ranks == [s.param_bytes for s in shard_summary(TINY, 2)]
        assert all(r < full * 0.51 for r in read)
        assert core.available_kv_cache_memory == [1 << 20, 1 << 20]
        assert core.num_gpu_blocks == (1 << 20) // (2 * 4 * 1 * 16 * 4 * 2)  # one KV head per rank
        probe = tiny_model()  # the measure sees a model when there is one
        assert _live_tensor_bytes() - before >= full
        del probe
    finally:
        core.shutdown()


@pytest.mark.slow
def test_a_model_object_reaches_the_ranks_as_a_temporary_checkpoint(monkeypatch):
    import minillm.engine.core

    made: list[str] = []

    class Recorded(TemporaryCheckpoint):
        def __init__(self, model):
            super().__init__(model)
            made.append(self.path)

    monkeypatch.setattr(minillm.engine.core, "TemporaryCheckpoint", Recorded)
    model = tiny_model()
    alive = weakref.ref(model)
    one = LLMEngine(tiny_model(), None, EngineArgs(block_size=4, num_gpu_blocks=40, max_model_len=64))
    want = generate(one)
    one.shutdown()
    eng = LLMEngine(model, None, EngineArgs(tensor_parallel_size=2, block_size=4, num_gpu_blocks=40,
                                            max_model_len=64))
    try:
        del model
        gc.collect()
        assert alive() is None, "the engine core keeps no reference to the model object"
        assert len(made) == 1 and not os.path.exists(made[0]), "written once, removed once the ranks loaded"
        assert generate(eng) == want
    finally:
        eng.shutdown()
