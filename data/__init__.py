"""Conversations and their tokens, shared by the dump, the trainer's split and the evaluation:
readers of conversation files (conversations, records), the held-out split rules (split), the
chat template with its loss mask (template), and the record of a rejected sample (rejection)."""
