"""Reading an epoch's plan in one process: the iterator, the units it opens, and what it yields.

`iterator` walks a reader's plan (`EpochIterator`, given frozen `ReadOptions`) and opens its units,
handing a first epoch's plan the counts it asks for; `units` leases, locates, maps, verifies and
closes them (`mixed`: one source at a time); `prefetch` asks for them ahead of use (this epoch's,
then the next's) as deep as its controller says; `batching` and `rows` build samples and batches.
"""
