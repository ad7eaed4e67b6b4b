"""A real store written without vLLM: ShareGPT train conversations through the shipped verifier
with transformers (fp32), the tensors `make dump` captures through vLLM (tests/test_dump.py
compares the two): the aux states (vLLM's convention: the state entering layer k) and the
post-norm final state. For benchmarks and tests that need real rows, not a dump's cost."""
from __future__ import annotations

from pathlib import Path

import torch

from config import compose_config


def write_reference_store(path: Path, samples: int, max_len: int) -> int:
    """The first `samples` conversations of the dump's default data (answers as written, cut at
    `max_len` tokens) through its default verifier into a store at `path`; returns how many."""
    from transformers import AutoTokenizer, DeepseekV3ForCausalLM

    from data.conversations import load_conversations
    from data.template import SampleRejected, tokenize_conversation
    from model.verifier import verifier_dir
    from store import StoreWriter, verifier_identity

    dump = compose_config("dump")
    vdir = verifier_dir(dump.verifier)
    tokenizer = AutoTokenizer.from_pretrained(vdir)
    verifier = DeepseekV3ForCausalLM.from_pretrained(vdir, dtype=torch.float32).eval()
    aux_ids = list(dump.verifier.aux_layer_ids)
    writer = StoreWriter(path, verifier_identity(vdir, dump.verifier.name), aux_ids, dump.store,
                         {"data": {"format": dump.data.format}}, aux_convention=dump.verifier.aux_convention,
                         aux_capture=dump.verifier.aux_capture, rank=0, world_size=1)
    written = 0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared machine's cores: OpenMP threads that lose theirs wait on each other
    with writer, torch.no_grad():
        # The file's order, not the default's code mix: the same samples whatever that mix becomes.
        for conv in load_conversations({**dump.data, "max_samples": None, "select": None}, "train"):
            try:
                sample = tokenize_conversation(tokenizer, conv, max_len, "truncate")
            except SampleRejected:
                continue
            ids = torch.from_numpy(sample.input_ids).long()
            states = verifier(ids[None], output_hidden_states=True).hidden_states
            aux = torch.stack([states[k][0] for k in aux_ids], dim=1)         # [T, n_aux, H]
            writer.add(sample.id, ids, torch.from_numpy(sample.loss_mask), aux, states[-1][0])
            written += 1
            if written == samples:
                break
    torch.set_num_threads(threads)
    return written
