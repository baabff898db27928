"""The bottom every other part of the core stands on: what a failure means, how a task group's outcome is read,
and what every rank shares about a step. It imports nothing of gsync's but the public errors and the threads."""
