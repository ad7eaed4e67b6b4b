"""Stage 1: run the verifier through vLLM and dump its hidden states into Zarr shards."""
