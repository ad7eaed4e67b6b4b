"""Stage 1: run the verifier through vLLM and dump its hidden states into Zarr shards."""
import model  # noqa: F401  (sets the offline/cache environment before vLLM or transformers load)
