"""What a store was written with, and who may add to it: the verifier's identity, the aux capture
mode, store.json, and the check that refuses a writer of other settings (`StoreMismatchError`;
whether a trainer's draft and verifier fit a store is model/compatibility.py's check)."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from config.choices import AuxCapture, names
from config.groups import StoreConf
from store.durable import StoreCorruptError, _read_checked_json
from store.format import (AUX_ENCODINGS, FINAL_ENCODINGS, FORMAT_VERSION, STORE_META, _plain,
                          logical_dtypes)
from store.settings import encodings, storage_from_record, storage_record
from store.sealed import fsync_dir, write_sealed_json

logger = logging.getLogger(__name__)

# What the hidden state of an aux id is (config/choices.py AuxCapture); a store records it.
AUX_CAPTURES = names(AuxCapture)

# config.json keys that change with the tool that saved the checkpoint, not with the model.
_VOLATILE_CONFIG_KEYS = ("transformers_version", "_name_or_path")
# Files that define how text becomes token ids (Kimi ships tiktoken.model and Python code).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tiktoken.model", "vocab.json",
                    "merges.txt", "tokenizer_config.json", "special_tokens_map.json",
                    "chat_template.jinja")


class StoreMismatchError(ValueError):
    """The store was written with another verifier, aux layers, storage settings or format, or
    records a format or encoding this code cannot read."""


def verifier_identity(checkpoint: str | Path, name: str) -> dict[str, Any]:
    """What makes hidden states comparable: hashes of the config and tokenizer, and the shapes.
    (Reads the folder on every call; model/verifier_handle.py's Verifier.identity reads it once.)"""
    folder = Path(checkpoint)
    return identity_of(folder, json.loads((folder / "config.json").read_text()), name)


def identity_of(folder: Path, config: Mapping[str, Any], name: str) -> dict[str, Any]:
    """verifier_identity of the folder whose config.json is `config` (already read)."""
    text = config.get("text_config", config)  # multimodal checkpoints nest the language model
    return {
        "name": name,
        "config_sha256": _sha256_json({k: v for k, v in config.items()
                                       if k not in _VOLATILE_CONFIG_KEYS}),
        "tokenizer_sha256": _tokenizer_sha256(Path(folder)),
        "hidden_size": int(text["hidden_size"]),
        "vocab_size": int(text["vocab_size"]),
        "num_hidden_layers": int(text["num_hidden_layers"]),
    }


def _sha256_json(value: Any) -> str:
    # Canonical JSON: the same config saved with other indentation or key order hashes the same.
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def _tokenizer_sha256(folder: Path) -> str:
    files = [folder / n for n in _TOKENIZER_FILES] + sorted(folder.glob("tokenization_*.py"))
    present = [f for f in files if f.is_file()]
    if not present:
        raise FileNotFoundError(f"no tokenizer files ({', '.join(_TOKENIZER_FILES)}) in {folder}")
    digest = hashlib.sha256()
    for path in present:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def check_aux_capture(aux_capture: str) -> str:
    """The capture mode, refused unless one of AUX_CAPTURES."""
    if aux_capture not in AUX_CAPTURES:
        raise ValueError(f"aux capture {aux_capture!r}: use one of {AUX_CAPTURES}")
    return str(aux_capture)


def aux_capture_of(meta: Mapping[str, Any]) -> str:
    """The capture mode a store.json (or a shard's attributes) records (KeyError where none)."""
    return str(meta["aux_capture"])


def _store_meta(identity: Mapping[str, Any], aux_layer_ids: Sequence[int], aux_convention: str,
                aux_capture: str, storage: StoreConf, dump_cfg: Any) -> dict[str, Any]:
    return {
        "format_version": FORMAT_VERSION,
        "verifier": dict(_plain(identity)),
        "aux_layer_ids": [int(i) for i in _plain(aux_layer_ids)],
        "aux_convention": str(aux_convention),
        "aux_capture": check_aux_capture(aux_capture),
        "storage": storage_record(storage),
        "dtypes": logical_dtypes(storage),
        "checksum": "crc32c",
        "dump": _plain(dump_cfg) if dump_cfg is not None else {},
    }


def _compatibility(meta: Mapping[str, Any]) -> dict[str, Any]:
    """The fields two writers of one store must agree on (names may differ, hashes may not)."""
    verifier = meta["verifier"]
    keys = ("config_sha256", "tokenizer_sha256", "hidden_size", "vocab_size", "num_hidden_layers")
    return {
        "format_version": meta["format_version"],
        **{f"verifier.{k}": verifier.get(k) for k in keys},
        "aux_layer_ids": list(meta["aux_layer_ids"]),
        "aux_convention": meta["aux_convention"],
        "aux_capture": aux_capture_of(meta),
        "storage.mode": meta["storage"]["mode"],
        **{f"storage.{k}": v for k, v in encodings(storage_of(meta)).items()},
    }


def storage_of(meta: Mapping[str, Any]) -> StoreConf:
    """The storage settings a store.json (or a shard's attributes) records."""
    return storage_from_record(meta["storage"])


def _mismatches(found: Mapping[str, Any], wanted: Mapping[str, Any]) -> list[str]:
    have, want = _compatibility(found), _compatibility(wanted)
    # A parameter one side's encodings do not use (fp4_block of a bf16 store) is named as None.
    return [f"{key}: store has {have.get(key)!r}, this run has {want.get(key)!r}"
            for key in {**have, **want} if have.get(key) != want.get(key)]


def _create_or_check_meta(path: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """store.json: created by the first rank (hard link: atomic, never overwrites), else checked."""
    target = path / STORE_META
    if not target.exists():
        tmp = path / f".{STORE_META}.{uuid.uuid4().hex}.tmp"
        write_sealed_json(tmp, meta)
        try:
            os.link(tmp, target)
            fsync_dir(path)
        except FileExistsError:
            pass  # another rank was first; its store.json is checked below
        finally:
            tmp.unlink()
    existing = read_store_meta(path)  # of this code's format version: it refuses others
    problems = _mismatches(existing, meta)
    if problems:
        raise StoreMismatchError(f"cannot write to store {path}: it was written with other "
                                 f"settings ({'; '.join(problems)}); use a new store folder")
    if existing["verifier"].get("name") != meta["verifier"].get("name"):
        logger.warning("store %s: verifier named %r there, %r here (same hashes)", path,
                       existing["verifier"].get("name"), meta["verifier"].get("name"))
    return existing


# What to do about a damaged store.json.
_META_ADVICE = ("the store's settings cannot be trusted: restore it from a copy (each shard's "
                "zarr.json records the same settings among its attributes)")


def read_store_meta(path: str | Path) -> dict[str, Any]:
    """store.json of a store, its checksum and format version checked (StoreCorruptError names a
    damaged one; StoreMismatchError a store of another format version, or of encodings this code
    does not know)."""
    target = Path(path) / STORE_META
    if not target.is_file():
        raise FileNotFoundError(f"{path} is not a hidden-state store: {STORE_META} is missing")
    try:
        meta = _read_checked_json(target, _META_ADVICE)
    except StoreCorruptError:
        if _unsealed_version(target) == 1:  # format 1 sealed nothing: refused as that, not as damage
            raise StoreMismatchError(_older_format(path, 1)) from None
        raise
    version = meta.get("format_version")
    if isinstance(version, int) and version < FORMAT_VERSION:
        raise StoreMismatchError(_older_format(path, version))
    if version != FORMAT_VERSION:
        raise StoreMismatchError(f"store {path} has format version {version!r}; this code reads "
                                 f"version {FORMAT_VERSION}: upgrade it to read this store")
    try:
        storage_of(meta)
    except (ValueError, TypeError, KeyError) as error:
        raise StoreMismatchError(
            f"store {path} records storage settings this code cannot read ({error}); this code "
            f"reads aux encodings {', '.join(AUX_ENCODINGS)} and final encodings "
            f"{', '.join(FINAL_ENCODINGS)}: upgrade it to read this store") from error
    return meta


def _older_format(path: str | Path, version: int) -> str:
    return (f"store {path} has format version {version}: it was written by an older version of the "
            f"dump, whose stores are not read any more (this code reads version {FORMAT_VERSION}); "
            "dump again into a new store folder")


def _unsealed_version(file: Path) -> Any:
    """The format_version a JSON file without a sha256 line says it has, or None."""
    try:
        value = json.loads(file.read_bytes())
    except ValueError:
        return None
    return value.get("format_version") if isinstance(value, dict) else None
