"""The epochs of a dataset and of a mix: each reader's `plans.interface.Plan`, its positions
with the readers that open its units (above `reading/`, which the plans' positions sit below)."""
