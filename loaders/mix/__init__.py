"""A mix of sources as one epoch: each source opened on its own (`sources`), how many samples each
gives (`counts`), which position reads which source's sample in O(shards + sources) (`order`), the
units opened per source (`readers`), and the mix behind the loader's one plan interface (`plan`)."""
