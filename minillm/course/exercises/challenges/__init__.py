"""The references of the chapters' open challenges (one module per chapter, ``chNN.py``).

A challenge (``### Challenge N ★★★`` or ``★★``, optional, its stars as extra credit) asks for an extension vLLM v0.33.0
has and minillm's engine does not, specified by its behaviour. Its check cell imports the reference from here, inside
the check, and runs the learner's answer under :func:`minillm.course.exercises.tripwire.guard` with ``"CN"``: each
module's ``TARGETS`` lists what a delegating answer could call (the reference itself first), so calling it fails the
check.
"""
