"""`python -m dump inspect <store>`: a store's counts, its rejected samples (by kind, and the first
few with the record each came from), storage mode and encodings, sizes (per
array too: bytes on disk, per token, share), compression and the result of reading every chunk and
checking every metadata file (`inspect_store`), and that report as lines for a terminal
(`format_inspect`). A store that cannot even be opened (no store.json, a damaged one, a
damaged manifest) is a report with one problem, never a traceback."""
from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from data.rejection import Rejection
from store.durable import StoreCorruptError, _all_manifests
from store.format import CORRUPT_PREFIX, SHARDS_DIR, TMP_PREFIX
from store.identity import StoreMismatchError
from store.progress import completion, waiting_ranks
from store.reader import _MAX_NAMED, ShardCorruptError, StoreReader
from store.settings import describe, encodings


def inspect_store(path: str | Path, verify: bool = True) -> dict[str, Any]:
    """Counts, sizes and (unless verify=False) the result of reading every chunk and metadata
    file and checking its checksum; `format_inspect` prints it. Any problem is in "problems"."""
    try:
        reader = StoreReader(path)
    except (StoreCorruptError, StoreMismatchError, OSError) as error:
        return {"path": str(path), "unreadable": True, "problems": [f"cannot open the store: {error}"]}
    return _report(reader, verify)


def _report(reader: StoreReader, verify: bool) -> dict[str, Any]:
    entries = reader.shards()
    tokens = sum(sum(e.num_tokens) for e in entries)
    disk = _bytes_by_array(reader)
    logical = _logical_bytes(reader)
    on_disk = sum(disk.values())
    hidden, n_aux = reader.hidden_size, len(reader.aux_layer_ids)
    reference = (n_aux + 1) * hidden * 2  # bf16 aux + final, uncompressed: 4*H*2 for 3 aux layers
    problems = reader.verify() if verify else None
    rejected = [r for m in _all_manifests(reader.path) for r in m.rejected.values()]
    return {
        "path": str(reader.path),
        "format_version": reader.meta["format_version"],
        "verifier": reader.identity.get("name"),
        "hidden_size": hidden,
        "aux_layer_ids": reader.aux_layer_ids,
        "aux_convention": reader.aux_convention,
        "aux_capture": reader.aux_capture,
        "mode": reader.mode,
        "encodings": encodings(reader.storage),
        "storage": describe(reader.storage),
        "compressor": reader.meta["storage"]["compressor"],
        "shards": len(entries),
        "samples": len(reader),
        "tokens": tokens,
        "rejected": {r.sample: r.to_json() for r in rejected},  # as the manifests keep them
        "rejected_by_kind": dict(Counter(r.kind.value for r in rejected).most_common()),
        "unfinished_shards": _hidden_shards(reader.path, TMP_PREFIX),
        "quarantined_shards": _hidden_shards(reader.path, CORRUPT_PREFIX),
        "bytes_on_disk": on_disk,
        "bytes_on_disk_by_array": disk,
        "arrays": _array_figures(disk, tokens, on_disk),
        "bytes_per_token": on_disk / tokens if tokens else None,
        "logical_bytes_per_token": logical / tokens if tokens else None,
        "reference_bytes_per_token": reference,
        "compression_ratio": logical / on_disk if on_disk else None,
        "ratio_to_reference": reference * tokens / on_disk if on_disk else None,
        "heldout_shards": sum(e.heldout for e in entries),
        "retired": _retired(reader),
        "progress": _progress(reader.path),
        "problems": None if problems is None else [str(p) for p in problems],
    }


def _retired(reader: StoreReader) -> dict[str, Any]:
    """What a following trainer retired (store/progress.py): the store's history."""
    retired = reader.retired.values()
    return {"shards": len(retired), "samples": sum(len(e.sample_ids) for e in retired),
            "tokens": sum(sum(e.num_tokens) for e in retired), "bytes": sum(e.nbytes for e in retired),
            "names": sorted(e.name for e in retired)}


def _progress(path: Path) -> dict[str, Any]:
    done = completion(path)
    return {"ranks_done": sorted(done.done), "world_size": done.world_size, "complete": done.complete,
            "ranks_waiting_for_room": sorted(waiting_ranks(path))}


def _hidden_shards(path: Path, prefix: str) -> list[str]:
    return sorted(p.name for p in (path / SHARDS_DIR).glob(f"{prefix}*"))


def _bytes_by_array(reader: StoreReader) -> dict[str, int]:
    """Bytes on disk of each array's data files over all committed shards; every zarr.json is
    counted under 'metadata'."""
    sizes: Counter[str] = Counter()
    for entry in reader.shards():
        folder = reader.path / SHARDS_DIR / entry.name
        for file in folder.rglob("*"):
            if file.is_file():
                key = "metadata" if file.name == "zarr.json" else file.relative_to(folder).parts[0]
                sizes[key] += file.stat().st_size
    return dict(sizes)


def _array_figures(disk: Mapping[str, int], tokens: int, on_disk: int) -> dict[str, dict[str, Any]]:
    """Per array (its data files over all shards, zarr.json files not counted): bytes on disk,
    per token of the store, and share of the store's bytes on disk."""
    return {name: {"bytes": nbytes, "bytes_per_token": nbytes / tokens if tokens else 0.0,
                   "share": nbytes / on_disk if on_disk else 0.0}
            for name, nbytes in sorted(disk.items()) if name != "metadata"}


def _logical_bytes(reader: StoreReader) -> int:
    """Uncompressed bytes of the arrays in their storage dtypes, metadata-only reads."""
    total = 0
    for entry in reader.shards():
        try:
            total += sum(a.nbytes for a in reader._shard(entry.name).arrays.values())
        except ShardCorruptError:
            continue  # counted among the problems
    return total


def format_inspect(report: Mapping[str, Any]) -> str:
    """The report of `inspect_store` as lines for a terminal."""
    def per_token(key: str) -> str:
        value = report[key]
        return "n/a" if value is None else f"{value:,.1f} bytes"

    if report.get("unreadable"):
        return "\n".join([f"store         {report['path']}", "PROBLEMS      1:",
                          *[f"  {p}" for p in report["problems"]]])
    lines = [
        f"store         {report['path']} (format {report['format_version']})",
        f"verifier      {report['verifier']}: H={report['hidden_size']}, aux layers "
        f"{report['aux_layer_ids']} ({report['aux_convention']} convention, "
        f"{report['aux_capture']} capture)",
        f"storage       {report['storage']}; compressor {report['compressor']}",
        f"contents      {report['shards']:,} shards, {report['samples']:,} samples, "
        f"{report['tokens']:,} tokens, {len(report['rejected']):,} rejected{_by_kind(report)}",
        f"on disk       {report['bytes_on_disk']:,} bytes = {per_token('bytes_per_token')}/token",
        f"uncompressed  {per_token('logical_bytes_per_token')}/token in the storage dtypes: "
        f"compression ratio {_ratio(report['compression_ratio'])}",
        f"reference     {report['reference_bytes_per_token']:,} bytes/token ((n_aux+1)*H*2: bf16 aux "
        f"+ final, uncompressed); reference / on disk = {_ratio(report['ratio_to_reference'])}",
    ]
    lines.append(f"  {'array':16} {'bytes on disk':>16} {'bytes/token':>12} {'share':>6}")
    metadata = report["bytes_on_disk_by_array"].get("metadata", 0)
    figures = {**report["arrays"], "metadata": {
        "bytes": metadata, "bytes_per_token": metadata / report["tokens"] if report["tokens"] else 0,
        "share": metadata / report["bytes_on_disk"] if report["bytes_on_disk"] else 0}}
    for array, figure in figures.items():
        lines.append(f"  {array:16} {figure['bytes']:>16,} {figure['bytes_per_token']:12,.1f} "
                     f"{figure['share']:6.1%}")
    for sample_id, record in list(report["rejected"].items())[:_MAX_NAMED]:
        rejection = Rejection.from_json(sample_id, record)
        where = f" at {rejection.where}" if rejection.where else ""
        lines.append(f"rejected      {sample_id!r}{where}, {rejection.kind}: {rejection.reason}")
    if report["heldout_shards"]:
        lines.append(f"held out      {report['heldout_shards']:,} of the shards hold only the trainer's "
                     "held-out samples (never retired)")
    retired = report["retired"]
    if retired["shards"]:
        lines.append(f"retired       {retired['shards']:,} shards, {retired['samples']:,} samples, "
                     f"{retired['tokens']:,} tokens, {retired['bytes']:,} bytes: trained on by a following "
                     "trainer and deleted (their manifest entries are kept in manifest/retired.json)")
    progress = report["progress"]
    if progress["world_size"] is not None:
        lines.append(f"dump          ranks {progress['ranks_done']} of {progress['world_size']} done"
                     + ("" if progress["complete"] else " (still being written)"))
    if progress["ranks_waiting_for_room"]:
        lines.append(f"waiting       ranks {progress['ranks_waiting_for_room']} wait for room under store.max_bytes")
    if report["unfinished_shards"]:
        lines.append(f"unfinished    {len(report['unfinished_shards'])} shards being written or "
                     f"left by a crash (removed when their rank resumes)")
    if report["quarantined_shards"]:
        lines.append(f"quarantined   {', '.join(report['quarantined_shards'])} (failed verification "
                     "when adopted after a crash; their samples were written again)")
    return "\n".join(lines + _checksum_lines(report))


def _checksum_lines(report: Mapping[str, Any]) -> list[str]:
    if report["problems"] is None:
        return ["checksums     not verified"]
    if report["problems"]:
        return [f"PROBLEMS      {len(report['problems'])}:", *[f"  {p}" for p in report["problems"]]]
    return ["checksums     every chunk, shard index and metadata file verified: OK"]


def _by_kind(report: Mapping[str, Any]) -> str:
    """' (over-long: 2, non-finite hidden states: 1)'; '' with no rejections."""
    counts = report["rejected_by_kind"]
    return " (" + ", ".join(f"{kind}: {n}" for kind, n in counts.items()) + ")" if counts else ""


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"
