"""Evaluation of an exported draft (`python -m evaluation`, `make eval`): the accept length measured
by vLLM (speculative) and simulated on the verifier's dumped states (simulate, accept), reported
as a table and plot (report); run drives the five steps."""
