"""A store's storage settings: one type, config.groups.StoreConf, for conf/store/*.yaml and for the
"storage" block store.json (and each shard's attributes) records.

`storage_settings` makes the typed, checked settings of a config node (or of a plain mapping of
its keys); `storage_from_record` those a store recorded; `storage_record` is the block a writer
records: every key of StoreConf but those of a running dump (max_bytes, poll_s, which a resumed
dump may change), the compressor with its own keys only. The rest says what the settings mean:
what decides the bytes (`encodings`), one line for people (`describe`), the writer's buffer per
token (`raw_bytes_per_token`). Which arrays a shard holds is store/format.py's (`shard_arrays`).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

from config.choices import AuxEncoding, FinalEncoding, FinalRows
from config.groups import CompressorConf, StoreConf
from store.format import AUX_ENCODINGS, FINAL_ENCODINGS, FINAL_ROWS, MODES, _compressor_codec, _plain

# Record keys in store.json's order (a store written before this module recorded the same).
_RECORDED = ("mode", "aux", "final", "final_rows", "compressor", "target_chunk_bytes", "shard_bytes",
             "topk", "fp4_block")


def storage_settings(node: StoreConf | Mapping[str, Any]) -> StoreConf:
    """The settings of a conf/store node (cfg.store), a plain mapping of its keys or a StoreConf, checked
    (ValueError says what is wrong), the compressor's codec built once so that a bad one fails
    now, not at the first shard."""
    values = asdict(node) if isinstance(node, StoreConf) else _plain(node)
    missing = [k for k in ("mode", "aux", "final", "final_rows") if k not in values]
    if missing:
        raise ValueError(f"storage settings lack {', '.join(missing)}: conf/store/*.yaml sets "
                         "them (mode is the preset's label, aux/final/final_rows the encodings)")
    settings = _typed(values, max_bytes=values.get("max_bytes"), poll_s=float(values.get("poll_s", 2.0)))
    _compressor_codec(settings.compressor)
    if settings.target_chunk_bytes < 1 or settings.shard_bytes < 1:
        raise ValueError("target_chunk_bytes and shard_bytes must be positive")
    return settings


def storage_from_record(block: Mapping[str, Any]) -> StoreConf:
    """The settings a store.json (or a shard's attributes) records. ValueError names an encoding
    this code does not know."""
    values = {"mode": block.get("mode"), "aux": block.get("aux"), "final": block.get("final"),
              "final_rows": block.get("final_rows"), "topk": block.get("topk", 32),
              "fp4_block": block.get("fp4_block", 32), "compressor": block.get("compressor") or {"name": "none"},
              "target_chunk_bytes": block.get("target_chunk_bytes", 1), "shard_bytes": block.get("shard_bytes", 1)}
    return _typed(values, max_bytes=None, poll_s=2.0)


def storage_record(settings: StoreConf) -> dict[str, Any]:
    """store.json's "storage" block: plain JSON, the compressor's own keys only."""
    compressor = {k: v for k, v in vars(settings.compressor).items() if v is not None}
    values = {k: getattr(settings, k) for k in _RECORDED} | {"compressor": compressor}
    return {k: (str(v) if k in ("mode", "aux", "final", "final_rows") else v) for k, v in values.items()}


def _typed(values: Mapping[str, Any], *, max_bytes: int | None, poll_s: float) -> StoreConf:
    """StoreConf of plain values, each choice checked first (so a message shows the plain name)."""
    mode = values["mode"]
    if not isinstance(mode, str) or not mode:
        raise ValueError(f"storage mode {mode!r}: a preset's name, such as {MODES}")
    choices = {"aux": ("aux encoding", AUX_ENCODINGS), "final": ("final encoding", FINAL_ENCODINGS),
               "final_rows": ("final_rows", FINAL_ROWS)}
    for key, (what, known) in choices.items():
        if values[key] not in known:
            raise ValueError(f"storage {what} {values[key]!r} is not one of {', '.join(known)}")
    # The codec's own keys only (conf/store's schema has every codec's, unset ones None).
    compressor = {k: v for k, v in dict(values["compressor"]).items() if v is not None}
    settings = StoreConf(mode=mode, aux=AuxEncoding(values["aux"]), final=FinalEncoding(values["final"]),
                         final_rows=FinalRows(values["final_rows"]), topk=int(values["topk"]),
                         fp4_block=int(values["fp4_block"]), compressor=CompressorConf(**compressor),
                         target_chunk_bytes=int(values["target_chunk_bytes"]),
                         shard_bytes=int(values["shard_bytes"]), max_bytes=max_bytes, poll_s=poll_s)
    if settings.final == "topk" and settings.topk < 1:
        raise ValueError(f"storage topk {settings.topk}: k must be at least 1")
    if settings.aux == "fp4" and settings.fp4_block < 1:
        raise ValueError(f"storage fp4_block {settings.fp4_block}: must be positive")
    return settings


def encodings(settings: StoreConf) -> dict[str, Any]:
    """What decides the bytes of the hidden-state arrays: the encodings and the parameters they
    use (a store's writers must agree on these)."""
    found: dict[str, Any] = {"aux": str(settings.aux), "final": str(settings.final),
                             "final_rows": str(settings.final_rows)}
    if settings.aux == "fp4":
        found["fp4_block"] = settings.fp4_block
    if settings.final == "topk":
        found["topk"] = settings.topk
    return found


def describe(settings: StoreConf) -> str:
    """One line: the label and the encodings."""
    aux = f"aux {settings.aux}" + (f" (blocks of {settings.fp4_block})" if settings.aux == "fp4" else "")
    final = f"final {settings.final}" + (f" (k={settings.topk})" if settings.final == "topk" else "")
    return f"{settings.mode}: {aux}, {final}, final rows {settings.final_rows}"


def raw_bytes_per_token(settings: StoreConf, hidden_size: int, num_aux: int) -> float:
    """Bytes a writer buffers per token before compression (the arrays at their stored widths),
    the final side on every row: an upper bound where final_rows is loss."""
    per_value = {"fp32": 4.0, "bf16": 2.0, "fp8": 1.0, "fp4": 0.5}[settings.aux]
    scales = {"fp8": 4 / hidden_size, "fp4": 2 / settings.fp4_block}.get(settings.aux, 0.0)
    final = {"fp32": 4.0 * hidden_size, "bf16": 2.0 * hidden_size, "topk": (4 + 2) * settings.topk}[settings.final]
    return (4 + 1) + num_aux * hidden_size * (per_value + scales) + final   # + int32 id, bool mask
