"""The checks of chapter 10's exercises (``solutions/10_engine_core.ipynb``), and the tiny model they run on.

- :func:`check_update_states` (exercise 10.1, Model Runner V2's slots): the learner's ``update_states(req_states,
  block_tables, requests_info, scheduler_output)`` replays the plans of real engine runs beside the package's
  ``ModelRunner.finish_requests`` / ``add_requests`` / ``update_requests``; after every step the slots (who holds
  which, the free list, tokens, lengths, drafts, block-table rows), what the runner remembers of each request and
  the step's ``idx_mapping`` must be equal (:mod:`minillm.course.exercises.ch10.slots`).
- :func:`check_placeholder_scheduler` (exercise 10.2, the placeholder accounting): an ``EngineCore`` with async
  scheduling runs the learner's ``Scheduler`` subclass in lockstep with one running the package's
  ``AsyncScheduler``; every schedule and every update must leave the same ``num_output_placeholders``, and the
  tokens must be the synchronous engine's (:mod:`minillm.course.exercises.ch10.placeholders`).
- :func:`check_kv_per_rank` (exercise 10.3, the per-rank KV cache): the learner's ``kv_heads_of_rank`` against
  ``QKVParallelLinear``'s ``kv_heads`` for every rank of every valid split, and ``num_blocks_per_rank`` against
  ``EngineArgs.resolved_num_gpu_blocks`` on three configs at every tensor-parallel size they allow
  (:mod:`minillm.course.exercises.ch10.kv_per_rank`).
- :func:`check_pos_seq_lens_kernel` (exercise 10.4, an input kernel in Triton): the learner's
  ``my_pos_seq_lens_kernel``, launched in Triton's interpreter, traced on chapter 10's picture and compared with
  ``prepare_pos_seq_lens_ref`` on random batches (:mod:`minillm.course.exercises.ch10.input_kernel`).

All four run the learner's code through :func:`~minillm.course.exercises.tripwire.guard`, so an answer that calls the
package's own implementation of the part fails with a :class:`~minillm.course.exercises.tripwire.DelegationError`;
the references run outside it. Each raises ``AssertionError`` at the first difference, saying what differs and, for
the usual mistakes, why.

vLLM has no such checks; the parts they check are
``vllm/v1/worker/gpu/model_runner.py:GPUModelRunner.finish_requests``, ``add_requests`` and ``update_requests``,
``vllm/v1/core/sched/async_scheduler.py:AsyncScheduler._update_after_schedule`` (with the placeholder term of
``vllm/v1/core/sched/scheduler.py:Scheduler._update_request_with_output``), and for 10.3
``vllm/config/model.py:ModelConfig.get_num_kv_heads``, ``vllm/model_executor/layers/linear.py:QKVParallelLinear`` and
``vllm/v1/worker/gpu_worker.py:Worker.determine_available_memory``.
"""
from minillm.course.exercises.ch10.input_kernel import check_pos_seq_lens_kernel
from minillm.course.exercises.ch10.kv_per_rank import check_kv_per_rank
from minillm.course.exercises.ch10.persistent_batch import record_plans
from minillm.course.exercises.ch10.placeholders import check_placeholder_scheduler
from minillm.course.exercises.ch10.slots import check_update_states
from minillm.course.exercises.ch10.tiny import TINY_CONFIG, tiny_llama

__all__ = ["TINY_CONFIG", "check_kv_per_rank", "check_placeholder_scheduler", "check_pos_seq_lens_kernel",
           "check_update_states", "record_plans",
           "tiny_llama"]
