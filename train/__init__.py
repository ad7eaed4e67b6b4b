"""Stage 2: train the EAGLE-3 MLA draft with DeepSpeed on the dumped shards."""
