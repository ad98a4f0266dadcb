"""Interactive views for the notebooks (ipywidgets + matplotlib). Every view also renders as plain text and a static
figure, so a notebook read without a kernel still shows the state."""
from minillm.course.widgets.block_table import BlockTableWidget, describe_kv_cache, plot_block_pool
from minillm.course.widgets.scheduler_stepper import (
           SchedulerStepper,
           format_trace,
           plot_queues,
           plot_schedule,
           trace_step,
)

__all__ = ["BlockTableWidget", "SchedulerStepper", "describe_kv_cache", "format_trace", "plot_block_pool",
           "plot_queues", "plot_schedule", "trace_step"]
