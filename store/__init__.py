"""THE shard contract between the stages: writer, reader, manifest, checksums, format version.

Stage 1 writes with `StoreWriter`; stage 2 reads with `StoreReader` only. Callers import from
this package (`from store import StoreWriter, StoreReader`); its modules, one concern each:

    format    the folder layout, array names and codecs: the format is described there
    settings  the storage settings (config.groups.StoreConf): checked from conf/store, read from
              and recorded in store.json
    encoding  the hidden-state encodings (bf16 byte planes, fp8, fp4, top-k targets), their
              error bounds, and the target rows a loss reads
    identity  the verifier identity and aux capture a store records; StoreMismatchError
    sealed    fsync'd, sha256-ended (sealed) JSON and folder fsync; the trainer's checkpoint
              markers are written with it too
    durable   reading sealed files, per-rank manifests and locks: what makes a crash at any
              moment safe and any damage seen (StoreCorruptError)
    shard_buffer  the samples of a rank's next shard, encoded as the storage settings say
    writer    StoreWriter: one rank's samples, a shard at a time; resume after a crash;
              StoreWriteError when the disk refuses a write
    reader    StoreReader, its samples, and the verification of every chunk's and metadata
              file's checksum; ShardCorruptError
    progress  a store while it is written and consumed: the ranks' done and waiting markers, the
              bytes on disk store.max_bytes bounds, retired shards (retire_shards, SampleRetiredError)
    inspect   inspect_store / format_inspect: the report of `python -m dump inspect <store>`
"""
from store.durable import Manifest, ShardEntry, StoreCorruptError
from store.encoding import (FP4_MAX, FP8_MAX, decode_bf16, decode_bf16_planes, decode_fp4, decode_fp8,
                            encode_bf16, encode_bf16_planes, encode_fp4, encode_fp8, encode_topk, target_rows,
                            verifier_topk)
from store.format import (AUX, AUX_ENCODINGS, AUX_SCALE, CORRUPT_PREFIX, FINAL, FINAL_ENCODINGS, FINAL_OFFSETS,
                          FINAL_ROWS, FORMAT_VERSION, INPUT_IDS, LOSS_MASK, MANIFEST_DIR, MODES, OFFSETS,
                          SHARDS_DIR, STORE_META, TARGET_IDS, TARGET_LOGPROBS, TMP_PREFIX, shard_arrays,
                          shard_name)
from store.identity import (AUX_CAPTURES, StoreMismatchError, aux_capture_of, check_aux_capture, read_store_meta,
                            storage_of, verifier_identity)
from store.inspect import format_inspect, inspect_store
from store.settings import storage_from_record, storage_record, storage_settings
from store.progress import SampleRetiredError, completion, read_retired, retire_shards, shards_bytes
from store.reader import Problem, Sample, SampleRef, ShardCorruptError, StoreReader
from store.writer import StoreWriteError, StoreWriter, WriterStats, dist_env, rank_of

__all__ = [
    "AUX", "AUX_CAPTURES", "AUX_ENCODINGS", "AUX_SCALE", "CORRUPT_PREFIX", "FINAL", "FINAL_ENCODINGS",
    "FINAL_OFFSETS", "FINAL_ROWS", "FORMAT_VERSION", "FP4_MAX", "FP8_MAX", "INPUT_IDS",
    "LOSS_MASK", "MANIFEST_DIR", "MODES", "OFFSETS", "SHARDS_DIR", "STORE_META", "TARGET_IDS",
    "TARGET_LOGPROBS", "TMP_PREFIX", "Manifest", "Problem", "Sample", "SampleRef", "SampleRetiredError",
    "ShardCorruptError", "completion", "read_retired", "retire_shards", "shards_bytes",
    "ShardEntry", "StoreCorruptError", "StoreMismatchError", "StoreReader",
    "StoreWriteError", "StoreWriter", "WriterStats", "aux_capture_of", "check_aux_capture", "decode_bf16",
    "decode_bf16_planes", "decode_fp4", "decode_fp8", "dist_env", "encode_bf16", "encode_bf16_planes", "encode_fp4", "encode_fp8", "encode_topk", "verifier_topk",
    "format_inspect", "inspect_store", "rank_of", "read_store_meta", "shard_arrays", "shard_name", "storage_from_record", "storage_of",
    "storage_record", "storage_settings",
    "target_rows", "verifier_identity",
]
