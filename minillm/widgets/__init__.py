"""Interactive views for the notebooks (ipywidgets + matplotlib). Every view also renders as plain text and a static
figure, so a notebook read without a kernel still shows the state."""
from minillm.widgets.block_table import BlockTableWidget, describe_kv_cache, plot_block_pool

__all__ = ["BlockTableWidget", "describe_kv_cache", "plot_block_pool"]
