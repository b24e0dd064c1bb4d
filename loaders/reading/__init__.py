"""Reading an epoch's plan in one process: the iterator, the units it opens, and what it yields.

`iterator` walks a reader's plan (`EpochIterator`); `units` opens, verifies and closes the units
it reads (`mixed`: one source at a time); `shards` locates a unit's shards and verifies their bytes,
`mapping` maps them and keeps tar indexes; `prefetch` and `nextepoch` stage ahead; `batching` and
`rows` build samples and batches.
"""
