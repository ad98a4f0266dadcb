"""elide_source: a listing of the package's code with the lines of an exercise's answer left out (chapter 3)."""
import pytest

from minillm.course.widgets.source_elide import ElidedListing, elide_source
from minillm.course.widgets.source_view import show_source


def _sample(x: int) -> int:
    """A docstring."""
    a = x + 1
    for i in range(3):
        a += i          # the answer, line 1
        a *= 2          # the answer, line 2
    return a


def test_cut_lines_are_replaced_by_one_comment_at_their_indent():
    full = show_source(_sample)
    shown = elide_source(_sample, ("a += i", "a *= 2", "exercise 9.9: the loop body"))
    assert isinstance(shown, ElidedListing)
    assert "a += i" not in shown and "a *= 2" not in shown
    assert "        # ... exercise 9.9: the loop body (2 lines) ..." in shown.source.splitlines()
    assert "for i in range(3):" in shown and "return a" in shown and '"""A docstring."""' in shown
    assert shown.hidden == ["        a += i          # the answer, line 1\n        a *= 2          # the answer, line 2"]
    assert len(shown.source.splitlines()) == len(full.lines) - 1


def test_repr_keeps_the_files_line_numbers():
    full = show_source(_sample)
    shown = elide_source(full, ("a += i", "a *= 2", "the loop body"))
    text = repr(shown).splitlines()
    first = full.line_of("a += i")
    assert text[0] == (f"_sample  ({full.path}, lines {full.first_line}-{full.last_line}; "
                       f"lines {first}-{first + 1} left out)")
    assert text[-1].split()[0] == str(full.last_line) and text[-1].endswith("return a")
    comment = next(line for line in text if "the loop body" in line)
    assert not comment.strip()[0].isdigit()          # the comment line has no number of its own
    assert any(line.split()[0] == str(first - 1) and "for i in range(3)" in line for line in text[1:])


def test_html_is_highlighted_and_hides_the_cut():
    html = elide_source(_sample, ("a += i", "a *= 2", "the loop body"))._repr_html_()
    assert "the loop body" in html and "left out" in html and "answer, line" not in html
    assert "<span" in html  # pygments' inline styles


def test_several_cuts_in_order_and_a_single_line_cut():
    shown = elide_source(_sample, ("a = x + 1", "a = x + 1", "start"), ("a *= 2", "a *= 2", "double"))
    assert [c[2] for c in shown.cuts] == ["start", "double"]
    assert "# ... start (1 line) ..." in shown.source and "# ... double (1 line) ..." in shown.source
    assert "a += i" in shown


@pytest.mark.parametrize("cuts", [(), (("not in the source", "return a", "x"),), (("a += i", "nowhere", "x"),),
                                  (("a *= 2", "a *= 2", "x"), ("a += i", "a += i", "y"))])  # the last: out of order
def test_a_marker_that_is_not_found_raises(cuts):
    with pytest.raises(ValueError):
        elide_source(_sample, *cuts)


def test_a_triton_kernel():
    from kernels.attention_stages import _contiguous_kernel, kv_row_offsets

    shown = elide_source(kv_row_offsets, ("blk = tl.load", "return blk", "the lookup"))
    assert shown.name == "kv_row_offsets" and "tl.load" not in shown and "def kv_row_offsets" in shown
    loop = elide_source(_contiguous_kernel, ("j = start", "m_i = m_new", "the tile loop"))
    assert "for start in range(0, kv_end, TILE_SIZE):" in loop and "tl.exp" not in loop and "tl.store" in loop
