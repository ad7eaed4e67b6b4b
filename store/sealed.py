"""Sealed JSON: files that survive a crash at any moment and show any damage, and the fsync of
folders that makes a rename durable. The store's store.json and manifests and the trainer's
checkpoint markers (train/checkpoints.py) are all written so.

A sealed file is compact JSON (no newline in it) followed by one line `sha256:<hex of the JSON>`:

    {"format_version":3,...}\\nsha256:9f86d0...\\n

so one damaged byte either breaks that last line or the body it hashes. These bytes are the store's
on-disk format since format 2: they must not change.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import uuid
from pathlib import Path
from typing import Any

from infra import failpoint

_SHA256_LINE = re.compile(rb"\nsha256:([0-9a-f]{64})\n\Z")


class SealError(ValueError):
    """Bytes that are not an intact sealed JSON file (see the two kinds below)."""


class NotSealedError(SealError):
    """No sha256 line ends the bytes: written by something else (an older format), or damaged
    where the line is."""


class SealMismatchError(SealError):
    """The bytes end with a sha256 line their body does not match: changed after the write."""


def sealed_json(value: Any) -> bytes:
    """The bytes of `value` as a sealed JSON file."""
    body = json.dumps(value, separators=(",", ":")).encode()
    return body + b"\nsha256:" + hashlib.sha256(body).hexdigest().encode() + b"\n"


def unseal_json(data: bytes) -> Any:
    """The value of a sealed JSON file's bytes, its sha256 checked (NotSealedError,
    SealMismatchError)."""
    line = _SHA256_LINE.search(data)
    if line is None:
        raise NotSealedError("the bytes do not end with a sha256 line")
    body = data[:line.start()]
    if hashlib.sha256(body).hexdigest().encode() != line.group(1):
        raise SealMismatchError("the contents do not match the sha256 on the last line")
    return json.loads(body)


def write_sealed_json(path: Path, value: Any) -> None:
    """`value` sealed into `path`, on disk (fsync'd); a partial file is removed on failure."""
    try:
        with open(path, "wb") as f:
            f.write(sealed_json(value))
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(OSError):  # a full disk still allows an unlink; a read-only one not
            path.unlink(missing_ok=True)
        raise


def replace_sealed_json(path: Path, value: Any, before_rename: str = "store.json.before_rename",
                        after_rename: str | None = "store.json.after_rename") -> None:
    """Write a tmp file beside `path` (named `.<name>.<uuid>.tmp`), fsync, rename it over `path`,
    fsync the folder: a reader sees the old file or the new one, never a mix. `before_rename` and
    `after_rename` name the failpoints around the rename (infra.failpoint)."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    write_sealed_json(tmp, value)
    try:
        failpoint(before_rename)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    if after_rename is not None:
        failpoint(after_rename)


def fsync_dir(path: Path) -> None:
    """A folder's entries on disk: what makes a rename or a new file in it survive a power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Every file and folder under root on disk, so a rename after it commits complete data."""
    for folder, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(folder, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(Path(folder))
