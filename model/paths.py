"""Where things live: the repository root and paths given relative to it in configs."""
from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def resolve(path: str | Path) -> Path:
    """A config path: absolute as given, relative ones from the repository root (not Hydra's cwd)."""
    path = Path(path).expanduser()
    return path if path.is_absolute() else REPO_ROOT / path
