"""Draft model, MLA attention, checkpoint export, the draft's model card and verifier definitions."""
