"""gsync's benchmark suite: ``python bench/run.py [--quick]`` (see bench/README.md).

Benchmarks print and save numbers; they never assert timings.
"""
