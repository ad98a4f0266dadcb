"""The scheduler (chapter 4): who runs this step and with how many tokens.

vLLM counterpart: ``vllm/v1/core/sched/``.
"""
from minillm.core.sched.output import (
                                       CachedRequestData,
                                       EngineCoreOutput,
                                       ModelRunnerOutput,
                                       NewRequestData,
                                       SchedulerOutput,
)
from minillm.core.sched.request_queue import (
                                       FCFSRequestQueue,
                                       PriorityRequestQueue,
                                       SchedulingPolicy,
                                       create_request_queue,
)
from minillm.core.sched.scheduler import Scheduler, StepState

__all__ = ["CachedRequestData", "EngineCoreOutput", "FCFSRequestQueue", "ModelRunnerOutput", "NewRequestData",
           "PriorityRequestQueue", "Scheduler", "SchedulerOutput", "SchedulingPolicy", "StepState",
           "create_request_queue"]
