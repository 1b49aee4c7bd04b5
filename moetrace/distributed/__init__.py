"""Running one recording over several devices (tensor parallelism) or machines (shards).

SPMD in the way vLLM does it: every rank holds a slice of the weights and runs
the same forward; rank 0 alone schedules, samples, and writes the trace.
docs/distributed.md tells the whole story.
"""
