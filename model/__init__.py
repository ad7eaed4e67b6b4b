"""Draft model, MLA attention, checkpoint export and verifier definitions."""
from model import runtime_env as _runtime_env  # noqa: F401  (sets the offline/cache environment first)
