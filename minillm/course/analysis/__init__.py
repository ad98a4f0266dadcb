"""Tools to look at an inference computation from outside: FLOP and byte counts, dependency graphs."""
from minillm.course.analysis.dependency import (
                                         ancestors,
                                         dependencies,
                                         plot_dependency_graph,
                                         schedule_steps,
                                         validate_schedule,
)
from minillm.course.analysis.flops import (
                                         attention_pairs,
                                         kv_bytes_read,
                                         layer_flops,
                                         lm_head_flops,
                                         measure_flops,
                                         prefill_flops,
)

__all__ = ["ancestors", "attention_pairs", "dependencies", "kv_bytes_read", "layer_flops", "lm_head_flops",
           "measure_flops", "plot_dependency_graph", "prefill_flops", "schedule_steps", "validate_schedule"]
