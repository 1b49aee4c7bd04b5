"""Routing analysis over traces: streamed passes, one small module per question.

``load`` turns a trace (or a subset of it) into a stream of ``RowBlock``s; every
other module is an accumulator that folds blocks into counts and turns counts
into figures, so a trace larger than memory is read once, chunk by chunk.
"""
