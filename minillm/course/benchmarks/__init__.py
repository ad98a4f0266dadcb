"""Benchmarks that measure minillm against its peers in the same run (``python -m minillm bench``)."""
