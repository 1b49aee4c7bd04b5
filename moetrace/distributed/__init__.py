"""Tensor parallelism's collectives and sharding: what one rank of a group holds and says.

SPMD in the way vLLM does it: every rank holds a slice of the weights and runs
the same forward; rank 0 alone schedules, samples, and writes the trace.  This
package knows nothing of the engine: starting the group and the workers' step
loop are the engine's (``engine/launch.py``, ``engine/step_sync.py``).
docs/distributed.md tells the whole story.
"""
