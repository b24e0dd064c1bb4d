"""An epoch's plan: what each reader of it reads, handed the sample counts, never opening a shard.

`interface` is what the reader needs of a plan (`Plan`) and of a dataset's epochs (`Planner`);
`positions` and `indexed` say which unit and sample each of a reader's positions reads (`indexed`:
every count known), `cold` grows a first epoch's positions as counts arrive, `counts` holds the
dataset's unit counts (built, saved, loaded), `dataset` plans one dataset's epochs, and `mixed`
(with `mixsources`, `mixcounts`) a mix of sources as one epoch.
"""
