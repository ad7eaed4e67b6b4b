"""Stage 2: train the EAGLE-3 MLA draft with DeepSpeed on the dumped shards."""
import model  # noqa: F401  (sets the offline/cache environment before transformers loads)
