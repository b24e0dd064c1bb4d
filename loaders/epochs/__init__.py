"""The epochs of a dataset and of a mix: each reader's `plans.interface.Plan` and the `Planner` that
makes it. A plan never opens a unit: the reader (`reading.iterator`) opens them and hands a first
epoch's plan the counts it asks for (`Plan.uncounted`, `Plan.counted`)."""
