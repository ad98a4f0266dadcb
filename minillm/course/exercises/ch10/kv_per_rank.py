"""Exercise 10.3's check: the KV heads each tensor-parallel rank holds, and how many KV blocks its own budget holds.

The learner writes two functions:

- ``kv_heads_of_rank(num_kv_heads, tp_size, rank) -> list[int]``: the global indices of the KV heads rank ``rank``
  holds and caches. The reference is what :class:`~minillm.model.parallel_layers.QKVParallelLinear` computes
  (:func:`reference_kv_heads` builds one on a layer of ``head_dim`` 1 and reads its ``kv_heads``): split when
  ``tp_size <= num_kv_heads``, ``num_kv_heads / tp_size`` consecutive heads each; else one head replicated on
  ``tp_size / num_kv_heads`` neighbouring ranks, rank ``r`` holding head ``r // num_kv_head_replicas``.
- ``num_blocks_per_rank(config, block_size, dtype_bytes, tp_size, budget_bytes) -> int``: how many KV blocks one
  rank's cache holds within its own budget. The reference is the engine's own sizing,
  ``EngineArgs(kv_cache_memory_bytes=budget_bytes, ...).resolved_num_gpu_blocks(config, ...)``
  (:func:`reference_num_blocks`).

:func:`check_kv_per_rank` runs both under the tripwire (exercise 10.3: the package's ``num_kv_heads_per_rank``,
``QKVParallelLinear``, ``shard_summary`` and ``EngineArgs.resolved_num_gpu_blocks`` raise while the learner's code
runs) on every valid split of five KV-head counts and on three configs (a Llama-3-8B-shaped one, SmolLM2-135M, the
tiny Llama) at every tensor-parallel size they split over, fp32 and bf16, two block sizes and budgets on, just
below and off a block boundary. The usual mistakes are named: a rank with no KV head (the heads split although ranks
outnumber them), heads dealt out round-robin (``rank % num_kv_heads``), the whole model's heads on every rank, a
strided split; a budget divided by ``tp_size``, K without V, all KV heads in a rank's block, rounding up, a fraction of
a replicated head, a block of one token, no ``dtype_bytes``; a float or a tensor where an int (a list of ints) is due.

vLLM: ``vllm/config/model.py:ModelConfig.get_num_kv_heads`` (the heads per rank, at least 1),
``vllm/model_executor/layers/linear.py:QKVParallelLinear`` (``num_kv_head_replicas``; its ``weight_loader`` picks
``tp_rank // num_kv_head_replicas``) and ``vllm/v1/worker/gpu_worker.py:Worker.determine_available_memory`` (each
rank's own bytes, ``kv_cache_memory_bytes`` "per GPU").
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from minillm.config import LlamaConfig
from minillm.course.exercises.ch10.tiny import TINY_CONFIG
from minillm.engine.arg_utils import EngineArgs
from minillm.model.llama_tp import check_tensor_parallel_config
from minillm.model.parallel_layers import QKVParallelLinear

KvHeadsOfRank = Callable[[int, int, int], Any]
NumBlocksPerRank = Callable[[LlamaConfig, int, int, int, int], Any]

SMOLLM2_CONFIG = LlamaConfig()  # LlamaConfig's defaults are SmolLM2-135M-Instruct's
LLAMA3_8B_SHAPE = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                              num_attention_heads=32, num_key_value_heads=8, head_dim=128)
# The 8B shape first: at 32 ranks its KV heads are replicated 4 times, where the usual mistakes give numbers that
# differ from each other, so the first wrong case a message shows tells them apart.
CONFIGS: dict[str, LlamaConfig] = {"a Llama-3-8B-shaped config": LLAMA3_8B_SHAPE, "SmolLM2-135M": SMOLLM2_CONFIG,
                                   "the tiny Llama": TINY_CONFIG}
DTYPES = {4: torch.float32, 2: torch.bfloat16}
BLOCK_SIZES = (16, 32)
KV_HEAD_COUNTS = (1, 2, 3, 4, 8)
TP_SIZES = (1, 2, 3, 4, 6, 8, 9, 12, 16, 32)


def valid_split(num_kv_heads: int, tp_size: int) -> bool:
    """Whether ``tp_size`` ranks can share ``num_kv_heads`` KV heads: an equal split, or an equal replication."""
    return num_kv_heads % tp_size == 0 if tp_size <= num_kv_heads else tp_size % num_kv_heads == 0


def tp_sizes_of(config: LlamaConfig) -> list[int]:
    """The sizes of :data:`TP_SIZES` the whole model splits over, as the engine requires
    (:func:`~minillm.model.llama_tp.check_tensor_parallel_config`: the heads, and the MLP's features). SmolLM2:
    1 and 3; its heads would split over 9 ranks, but not its 1,536 MLP features."""
    sizes = []
    for tp in TP_SIZES:
        try:
            check_tensor_parallel_config(config, tp)
        except ValueError:
            continue
        sizes.append(tp)
    return sizes


def reference_kv_heads(num_kv_heads: int, tp_size: int, rank: int) -> list[int]:
    """``QKVParallelLinear(...).kv_heads`` of rank ``rank``: the layer built on zero weights of ``head_dim`` 1 and
    hidden size 1, with ``lcm(num_kv_heads, tp_size)`` query heads (the fewest that split over both)."""
    num_heads = math.lcm(num_kv_heads, tp_size)
    q, kv = torch.zeros(num_heads, 1), torch.zeros(num_kv_heads, 1)
    return list(QKVParallelLinear(q, kv, kv, num_heads, num_kv_heads, 1, rank, tp_size).kv_heads)


def reference_num_blocks(config: LlamaConfig, block_size: int, dtype_bytes: int, tp_size: int,
                         budget_bytes: int) -> int:
    """The engine's own count: ``EngineArgs(kv_cache_memory_bytes=budget_bytes, ...).resolved_num_gpu_blocks``."""
    dtype = DTYPES[dtype_bytes]
    args = EngineArgs(kv_cache_memory_bytes=budget_bytes, block_size=block_size, tensor_parallel_size=tp_size,
                      dtype=dtype, device="cpu")  # tensor parallelism runs on the CPU here (gloo)
    return args.resolved_num_gpu_blocks(config, config.max_position_embeddings, dtype)


def head_cases() -> list[tuple[int, int, int]]:
    """Every ``(num_kv_heads, tp_size, rank)`` of every valid split of :data:`KV_HEAD_COUNTS` over :data:`TP_SIZES`."""
    return [(nkv, tp, r) for nkv in KV_HEAD_COUNTS for tp in TP_SIZES if valid_split(nkv, tp) for r in range(tp)]


def _bytes_per_block_of_one_head(config: LlamaConfig, block_size: int, dtype_bytes: int) -> int:
    return block_size * 2 * config.num_hidden_layers * config.head_dim * dtype_bytes


def block_cases() -> list[tuple[str, int, int, int, int]]:
    """``(config name, block_size, dtype_bytes, tp_size, budget_bytes)``: every config at every tensor-parallel size
    it splits over (the largest first: replicated heads tell the mistakes apart best), fp32 and bf16, two block sizes,
    and four budgets: 37 blocks exactly, one byte less (36 blocks: rounding up gives 37), one byte less than a block (0
    blocks), and 100 MB + 12,345 bytes (off any boundary)."""
    cases = []
    for name, config in CONFIGS.items():
        for tp in sorted(tp_sizes_of(config), reverse=True):
            heads = len(reference_kv_heads(config.num_key_value_heads, tp, 0))
            for dtype_bytes in DTYPES:
                for block_size in BLOCK_SIZES:
                    block = _bytes_per_block_of_one_head(config, block_size, dtype_bytes) * heads
                    for budget in (100_012_345, 37 * block, 37 * block - 1, block - 1):
                        cases.append((name, block_size, dtype_bytes, tp, budget))
    return cases


# -- the learner's answers, read and explained -------------------------------------------------------------------
def _type_problem_heads(got: Any) -> str | None:
    if isinstance(got, list) and all(isinstance(h, int) and not isinstance(h, bool) for h in got):
        return None
    if isinstance(got, torch.Tensor):
        return (f"returns a {type(got).__name__} ({got!r}): return a list of Python ints, the heads' global indices "
                f"(.tolist() turns a tensor into one)")
    if isinstance(got, list):
        bad = next(h for h in got if not (isinstance(h, int) and not isinstance(h, bool)))
        return (f"returns {got!r}, whose element {bad!r} is a {type(bad).__name__}: return a list of Python ints "
                f"(int(h))")
    return f"returns a {type(got).__name__} ({got!r}): return a list of Python ints, e.g. list(range(start, end))"


def _explain_heads(nkv: int, tp: int, rank: int, got: list[int], want: list[int]) -> str:
    call = f"kv_heads_of_rank(num_kv_heads={nkv}, tp_size={tp}, rank={rank}) returns {got}, expected {want}"
    replicas = tp // nkv
    if tp > nkv:
        rule = (f"ranks outnumber KV heads ({tp} > {nkv}), so the heads are not split but replicated: each is held "
                f"by tp_size // num_kv_heads = {replicas} ranks, and every rank holds one, rank r holding head "
                f"r // {replicas}")
        if not got:
            return (f"{call}: rank {rank} gets no KV head (num_kv_heads // tp_size is 0 here), but its query heads "
                    f"must read one: {rule}")
        if any(h < 0 or h >= nkv for h in got):
            return f"{call}: the model has only KV heads 0..{nkv - 1}, so {got} splits what cannot be split: {rule}"
        if got == [rank % nkv]:
            return (f"{call}: that is rank % num_kv_heads, the heads dealt out round-robin. Neighbouring ranks must "
                    f"share a head: rank r holds query heads that read KV head r // num_kv_head_replicas "
                    f"(r // {replicas} here; vLLM's QKVParallelLinear.weight_loader takes shard tp_rank // "
                    f"num_kv_head_replicas), so with rank % num_kv_heads rank {rank}'s query heads would read a KV "
                    f"head it does not hold")
        if got == list(range(nkv)) and nkv > 1:
            return (f"{call}: every KV head on every rank is the tp_size=1 answer; {rule}")
        return f"{call} (QKVParallelLinear's kv_heads for that rank): {rule}"
    per = nkv // tp
    rule = ("with at least as many KV heads as ranks the heads are split: each rank holds num_kv_heads // tp_size = "
            + (f"{per} consecutive heads, rank r heads r * {per} .. r * {per} + {per - 1}" if per > 1 else
               "1 head, rank r head r"))
    if got == list(range(nkv)) and tp > 1:
        return f"{call}: every KV head on every rank is the tp_size=1 answer; {rule}"
    if sorted(got) == list(range(rank, nkv, tp)) and nkv // tp > 1:
        return (f"{call}: that is a strided split (heads rank, rank + tp_size, ...). A rank's query heads are "
                f"consecutive, and query head h reads KV head h // (num_heads // num_kv_heads), so the KV heads they "
                f"read are consecutive too; {rule}")
    if not got:
        return f"{call}: rank {rank} gets no KV head; {rule}"
    return f"{call} (QKVParallelLinear's kv_heads for that rank): {rule}"


def _type_problem_blocks(got: Any) -> str | None:
    if isinstance(got, int) and not isinstance(got, bool):
        return None
    if isinstance(got, float):
        return (f"returns a float ({got!r}): a number of blocks is an int; a `/` somewhere makes a float, use `//` "
                f"(whole blocks only)")
    if isinstance(got, torch.Tensor):
        return f"returns a {type(got).__name__} ({got!r}): a number of blocks is a Python int (int(...) or .item())"
    return f"returns a {type(got).__name__} ({got!r}): a number of blocks is a Python int"


def _slips(config: LlamaConfig, block_size: int, dtype_bytes: int, tp: int, budget: int) -> dict[str, int]:
    """What each usual mistake gives for one case (the key says, in words, what the answer then does)."""
    nkv = config.num_key_value_heads
    one_head = _bytes_per_block_of_one_head(config, block_size, dtype_bytes)
    heads = len(reference_kv_heads(nkv, tp, 0))
    block = one_head * heads
    return {
        "divides the budget by tp_size": budget // tp // block,
        "counts only K (or only V) in a block": budget // (block // 2),
        "counts all KV heads in a rank's block": budget // (one_head * nkv),
        "rounds up": -(-budget // block),
        "counts a fraction of a KV head per rank": budget * tp // (one_head * nkv),
        "sizes a block of one token": budget // (block // block_size),
        "leaves out dtype_bytes": budget // (block // dtype_bytes),
    }


def _why(slip: str, config_name: str, config: LlamaConfig, tp: int) -> str:
    nkv = config.num_key_value_heads
    heads = len(reference_kv_heads(nkv, tp, 0))
    return {
        "divides the budget by tp_size": (
            "The budget is already one rank's own: each GPU has its own memory (vLLM's gpu_memory_utilization and "
            "kv_cache_memory_bytes are per GPU), and every rank allocates the same number of blocks. Tensor "
            "parallelism gives more blocks because each rank caches fewer heads, not because it has fewer bytes"),
        "counts only K (or only V) in a block": "Every layer caches both K and V, hence the factor 2",
        "counts all KV heads in a rank's block": (
            f"That is the tp_size=1 answer at every tp_size: a rank caches only the KV heads it holds, {heads} of "
            f"{config_name}'s {nkv} at tp_size={tp} (len(kv_heads_of_rank(...)))"),
        "rounds up": ("A part of a block holds nothing: the count is budget_bytes // bytes_per_block (rounded down), "
                      "never more blocks than the bytes hold"),
        "counts a fraction of a KV head per rank": (
            f"When ranks outnumber KV heads, num_kv_heads / tp_size ({nkv}/{tp} here) is less than one head, but "
            f"each rank still caches one whole (replicated) head"),
        "sizes a block of one token": "A block holds block_size tokens, each with its K and V in every layer",
        "leaves out dtype_bytes": "The budget is in bytes, and each element of K and V takes dtype_bytes of them",
    }[slip]


def _case_text(name: str, block_size: int, dtype_bytes: int, tp: int, budget: int) -> str:
    config = CONFIGS[name]
    return (f"num_blocks_per_rank({name} ({config.num_hidden_layers} layers, {config.num_key_value_heads} KV heads "
            f"of {config.head_dim}), block_size={block_size}, dtype_bytes={dtype_bytes}, tp_size={tp}, "
            f"budget_bytes={budget:,})")


def _check_heads(mine: KvHeadsOfRank) -> dict[str, int]:
    counts = {"splits": 0, "replicated splits": 0, "ranks": 0}
    seen: set[tuple[int, int]] = set()
    for nkv, tp, rank in head_cases():
        try:
            got = mine(nkv, tp, rank)
        except (NotImplementedError, AssertionError):
            raise
        except Exception as e:  # a crash is a wrong answer: say for which split
            raise AssertionError(f"kv_heads_of_rank(num_kv_heads={nkv}, tp_size={tp}, rank={rank}) raised "
                                 f"{type(e).__name__}: {e}" + (
                                     f". Ranks outnumber KV heads here: each head is replicated on {tp // nkv} ranks"
                                     if tp > nkv and isinstance(e, (ZeroDivisionError, IndexError)) else "")) from e
        problem = _type_problem_heads(got)
        if problem:
            raise AssertionError(f"kv_heads_of_rank(num_kv_heads={nkv}, tp_size={tp}, rank={rank}) {problem}")
        want = reference_kv_heads(nkv, tp, rank)  # once the learner's answer is in
        if got != want:
            raise AssertionError(_explain_heads(nkv, tp, rank, got, want) + ".")
        counts["ranks"] += 1
        if (nkv, tp) not in seen:
            seen.add((nkv, tp))
            counts["splits"] += 1
            counts["replicated splits"] += tp > nkv
    return counts


def _check_blocks(mine: NumBlocksPerRank) -> dict[str, int]:
    answers: list[tuple[tuple[str, int, int, int, int], int]] = []
    for case in block_cases():
        name, block_size, dtype_bytes, tp, budget = case
        config = CONFIGS[name]
        try:
            got = mine(config, block_size, dtype_bytes, tp, budget)
        except (NotImplementedError, AssertionError):
            raise
        except ZeroDivisionError as e:
            nkv = config.num_key_value_heads
            more = (f": ranks outnumber KV heads here ({tp} > {nkv}), so num_kv_heads // tp_size is 0, but each rank "
                    f"still caches one whole (replicated) head" if tp > nkv else "")
            raise AssertionError(f"{_case_text(*case)} raised ZeroDivisionError: {e}{more}") from e
        except Exception as e:  # a crash is a wrong answer: say for which case
            raise AssertionError(f"{_case_text(*case)} raised {type(e).__name__}: {e}") from e
        problem = _type_problem_blocks(got)
        if problem:
            raise AssertionError(f"{_case_text(*case)} {problem}")
        answers.append((case, got))
    # The references only once every answer is in: none of their results exists while the learner's code runs.
    results = [(case, got, reference_num_blocks(CONFIGS[case[0]], *case[1:])) for case, got in answers]
    wrong = [(case, got) for case, got, want in results if got != want]
    if wrong:
        _explain_blocks(results, *wrong[0])
    return {"block cases": len(results), "configs": len(CONFIGS),
            "tensor-parallel sizes": sum(len(tp_sizes_of(c)) for c in CONFIGS.values()),
            "budgets off a block boundary": sum(want != _slips(CONFIGS[c[0]], *c[1:])["rounds up"]
                                                for c, _, want in results)}


def _explain_blocks(results: list[tuple[tuple[str, int, int, int, int], int, int]],
                    case: tuple[str, int, int, int, int], got: int) -> None:
    """Raise the ``AssertionError`` for the first wrong ``case``: the mistake whose numbers the answer gives on every
    case (the cases are chosen so that the mistakes' numbers all differ somewhere), else one that explains this case,
    else the arithmetic."""
    name, block_size, dtype_bytes, tp, budget = case
    config = CONFIGS[name]
    want = reference_num_blocks(config, block_size, dtype_bytes, tp, budget)
    head = f"{_case_text(*case)} returns {got:,}, expected {want:,}"
    slips_of = {c: _slips(CONFIGS[c[0]], *c[1:]) for c, _, _ in results}
    everywhere = [s for s in slips_of[case] if all(slips_of[c][s] == g for c, g, _ in results)]
    here = [s for s, v in slips_of[case].items() if v == got]
    if everywhere or here:
        slip = (everywhere or here)[0]
        why = _why(slip, name, config, tp)
        what = f"it {slip}" if everywhere else f"it seems to {_infinitive(slip)}"
        raise AssertionError(f"{head}: {what}. {why}.")
    heads = len(reference_kv_heads(config.num_key_value_heads, tp, 0))
    block = _bytes_per_block_of_one_head(config, block_size, dtype_bytes) * heads
    raise AssertionError(f"{head}: a rank holds {heads} KV head(s) here, so one block takes block_size x 2 (K and V) "
                         f"x layers x {heads} x head_dim x dtype_bytes = {block:,} bytes, and the budget holds "
                         f"budget_bytes // {block:,} whole blocks.")


def _infinitive(slip: str) -> str:
    """"divides the budget" -> "divide the budget" (after "it seems to")."""
    verb, _, rest = slip.partition(" ")
    base = {"divides": "divide", "counts": "count", "rounds": "round", "sizes": "size", "leaves": "leave"}[verb]
    return f"{base} {rest}".strip()


def check_kv_per_rank(kv_heads_of_rank: KvHeadsOfRank, num_blocks_per_rank: NumBlocksPerRank,
                      verbose: bool = True) -> dict[str, int]:
    """Exercise 10.3's check: ``kv_heads_of_rank`` against ``QKVParallelLinear``'s ``kv_heads`` for every rank of
    every valid split, then ``num_blocks_per_rank`` against ``EngineArgs.resolved_num_gpu_blocks`` on every case of
    :func:`block_cases`; both under the tripwire (the references run outside it).

    Raises:
        AssertionError: at the first difference (for the blocks: after all cases, naming the mistake that gives the
            answer's numbers), or on a wrong type or a crash.

    Returns:
        splits, replicated splits, ranks, block cases, configs, tensor-parallel sizes, budgets off a block boundary;
        printed when ``verbose``, with SmolLM2's and the tiny Llama's heads and blocks per rank in 64 MiB.
    """
    from minillm.course.exercises.tripwire import guard

    heads_of, blocks_of = guard("10.3", kv_heads_of_rank), guard("10.3", num_blocks_per_rank)
    counts = _check_heads(heads_of)
    counts.update(_check_blocks(blocks_of))
    if verbose:
        print(f"Your kv_heads_of_rank agrees with QKVParallelLinear for all {counts['ranks']} ranks of "
              f"{counts['splits']} splits ({counts['replicated splits']} with the KV heads replicated), and your "
              f"num_blocks_per_rank with EngineArgs.resolved_num_gpu_blocks on {counts['block cases']} cases "
              f"({counts['configs']} configs at {counts['tensor-parallel sizes']} tensor-parallel sizes in all, fp32 "
              f"and bf16, block sizes {BLOCK_SIZES[0]} and {BLOCK_SIZES[1]}, "
              f"{counts['budgets off a block boundary']} budgets off a block boundary).")
        budget = 64 * 1024 ** 2
        print(f"In fp32, block_size 16, {budget // 1024 ** 2} MiB per rank:")
        for name in ("SmolLM2-135M", "the tiny Llama"):
            config = CONFIGS[name]
            for tp in tp_sizes_of(config):
                heads = [heads_of(config.num_key_value_heads, tp, r) for r in range(tp)]
                blocks = blocks_of(config, 16, 4, tp, budget)
                print(f"  {name} on {tp} rank(s): KV heads by rank {heads}, {blocks:,} blocks per rank "
                      f"({16 * blocks:,} tokens)")
    return counts
