"""Exercise tooling: build ``exercises/`` from ``solutions/`` and the helpers that check a learner's answers.

Conventions in a solution notebook (nbgrader's markers):

- an exercise cell starts with a comment ``# Exercise N.M: what to do`` and wraps the answer in
  ``### BEGIN SOLUTION`` / ``### END SOLUTION`` lines; the builder replaces each region with
  ``raise NotImplementedError("Exercise N.M: what to do")`` at the same indentation;
- the cell after it starts with ``# Check Exercise N.M`` and calls :func:`check_cases` (or asserts directly), so it
  fails with a message until the exercise is solved. It runs the learner's code through :func:`guard` (or
  ``check_cases(..., exercise="N.M")``), so an answer that calls the package's own implementation of the part fails
  (:mod:`minillm.course.exercises.tripwire`).
"""
from minillm.course.exercises.build import build_all, build_notebook
from minillm.course.exercises.check import check_cases
from minillm.course.exercises.tripwire import DelegationError, building, guard

__all__ = ["DelegationError", "build_all", "build_notebook", "building", "check_cases", "guard"]
