"""The repository stands on its own files: nothing tracked refers to a document that lives outside it."""
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Names of documents that are not in the repository (the course's brief and its notes), and paths that climb out of
# it. ("learner-questions.md", not "learner-questions": a heading's anchor, "The-learner-questions-·-…", is fine.)
OUTSIDE = ("COURSE.md", "STYLE.md", "learner-questions.md", "../shared")


def _tracked_hits(words: tuple[str, ...]) -> list[str]:
    done = subprocess.run(["git", "grep", "-n", "-I", "-F", *(a for w in words for a in ("-e", w)), "--", "."],
                          cwd=ROOT, capture_output=True, text=True)
    if done.returncode not in (0, 1):  # 1: no match
        pytest.skip(f"not a git checkout: {done.stderr.strip()}")
    this = Path(__file__).relative_to(ROOT).as_posix()
    return [line for line in done.stdout.splitlines() if not line.startswith(this + ":")]


def test_no_tracked_file_refers_to_files_outside_the_repository():
    hits = _tracked_hits(OUTSIDE)
    assert not hits, ("these lines refer to files outside the repository; point to the repository's own docs or "
                      "state the rule where it applies:\n" + "\n".join(hits))


def test_the_check_finds_a_reference(tmp_path):
    """The grep reports what it should: run it on a scratch repository holding one such line."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "a.py").write_text("x = 1  # see ../shared/notes\n")
    subprocess.run(["git", "-C", str(tmp_path), "add", "a.py"], check=True)
    done = subprocess.run(["git", "grep", "-n", "-I", "-F", "-e", "../shared", "--", "."], cwd=tmp_path,
                          capture_output=True, text=True)
    assert done.returncode == 0 and "a.py:1:" in done.stdout
