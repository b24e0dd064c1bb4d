"""How many samples each shard holds, counted once per cluster.

`cluster.ClusterIndex` is the cluster's index on the shared tier; the indexes
others wrote beside the shards (`sidecars`: wids, open_clip, img2dataset, DALI)
and the index files datacache writes (`indexfiles`) are read first; for shards
nobody indexed, `tarscan` scans their headers (`tarindex` is the tar reading
itself), the nodes dividing the work.
"""
