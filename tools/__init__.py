"""Scripts for people working on gsync, not benchmarks: the GPU check and the multi-process stress run."""
