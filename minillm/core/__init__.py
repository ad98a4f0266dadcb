"""The engine core's memory book-keeping: KV cache blocks, the block pool and the KV cache manager (chapter 2).

vLLM counterpart: ``vllm/v1/core/``.
"""
from minillm.core.block_pool import BlockPool
from minillm.core.kv_cache_manager import KVCacheManager
from minillm.core.kv_cache_utils import (
                                         NONE_HASH,
                                         BlockHash,
                                         FreeKVCacheBlockQueue,
                                         KVCacheBlock,
                                         PrefixCacheStats,
                                         hash_block_tokens,
                                         hash_request_tokens,
)

__all__ = ["NONE_HASH", "BlockHash", "BlockPool", "FreeKVCacheBlockQueue", "KVCacheBlock", "KVCacheManager",
           "PrefixCacheStats", "hash_block_tokens", "hash_request_tokens"]
