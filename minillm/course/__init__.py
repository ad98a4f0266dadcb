"""The course's tooling: what the notebooks use to look at the engine, not the engine itself.

Nothing under ``minillm/`` outside this package imports it (but the CLI's ``bench`` command, lazily), so the rest
of the tree reads as the engine's diagram (``minillm/__init__.py`` gives its reading order). What lives here:

    widgets/          interactive views of the block table, the scheduler's queues, the engine map, source listings
    exercises/        the exercise builder, the checks, the tripwire, the capstone, nbgrader, the challenges
    analysis/         FLOP and byte counts, dependency graphs of a computation
    benchmarks/       minillm against its peers in one run (``python -m minillm bench``)
    fake_runner.py    a model runner without a model: a scheduler simulated in milliseconds (chapter 4)
    simple_runner.py  a real-model runner, one request at a time: the schedule's cost on SmolLM2 (chapter 4)

vLLM counterpart: none; vLLM's own tooling lives outside its package (``benchmarks/``, ``tests/``).
"""
