"""Conversations and their tokens, shared by the dump, the trainer's split and the evaluation:
readers of conversation files (conversations, records) and the chat template with its loss mask
(template)."""
