"""show_source: the lessons' way of putting the package's own code on the page."""
import inspect

import pytest

from minillm.core.sched.scheduler import Scheduler
from minillm.course.widgets.source_view import SourceListing, show_source
from minillm.worker.model_runner import BatchInputs, prepare_inputs


def test_method_is_dedented_and_located():
    listing = show_source(Scheduler.schedule)
    lines, first = inspect.getsourcelines(Scheduler.schedule)
    assert listing.name == "Scheduler.schedule"
    assert listing.path == "minillm/core/sched/scheduler.py"
    assert listing.first_line == first and listing.last_line == first + len(lines) - 1
    assert listing.lines[0].startswith("def schedule(self)")          # the class's indentation is gone
    assert listing.line_of("self._schedule_running(step)") > listing.first_line
    assert "self._schedule_waiting(step)" in listing


def test_line_of_names_the_missing_text():
    with pytest.raises(ValueError, match="no_such_call"):
        show_source(prepare_inputs).line_of("no_such_call()")


def test_plain_text_is_numbered_with_file_lines():
    listing = show_source(prepare_inputs)
    text = repr(listing)
    header, first, *_ = text.splitlines()
    assert header == f"prepare_inputs  (minillm/worker/model_runner.py, lines {listing.first_line}-{listing.last_line})"
    assert first.split(None, 1) == [str(listing.first_line), "def prepare_inputs(scheduler_output: SchedulerOutput, "
                                    "requests: dict[str, CachedRequestState], block_size: int,"]
    assert len(text.splitlines()) == len(listing.lines) + 1


def test_html_is_highlighted_with_line_numbers():
    listing = show_source(prepare_inputs)
    page = listing._repr_html_()
    assert "minillm/worker/model_runner.py" in page and "prepare_inputs" in page
    assert "style=" in page                      # inline styles: no stylesheet needed
    assert str(listing.first_line) in page and str(listing.last_line) in page


def test_property_and_bound_method():
    prop = show_source(BatchInputs.query_start_loc)
    assert prop.lines[0] == "@property" and "attn_metadata.query_start_loc" in prop
    sched_src = show_source(Scheduler.get_request_counts)
    assert isinstance(sched_src, SourceListing) and sched_src.name == "Scheduler.get_request_counts"


def test_builtin_has_no_source():
    with pytest.raises(TypeError):
        show_source(len)
