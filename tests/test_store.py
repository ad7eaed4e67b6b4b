"""The shard contract (store/) on real Zarr stores on disk, with small random data."""
from __future__ import annotations

import json
import struct
import zlib
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from config import compose_config
from store import (
    AUX,
    MANIFEST_DIR,
    SHARDS_DIR,
    STORE_META,
    ShardCorruptError,
    StoreCorruptError,
    StoreMismatchError,
    StoreReader,
    StoreWriter,
    decode_fp8,
    dist_env,
    encode_bf16,
    encode_fp8,
    format_inspect,
    inspect_store,
    rank_of,
    read_store_meta,
    target_rows,
    verifier_identity,
)
from data.records import Origin
from data.rejection import Rejection, RejectionKind
from store.durable import _manifest_path, _read_manifest, _write_manifest
from store.sealed import replace_sealed_json, unseal_json

H, N_AUX, VOCAB = 32, 3, 1000
AUX_IDS = [2, 4, 5]
IDENTITY = {"name": "test-verifier", "config_sha256": "c" * 64, "tokenizer_sha256": "t" * 64,
            "hidden_size": H, "vocab_size": VOCAB, "num_hidden_layers": 8}
SAMPLE_BYTES = 12 * (N_AUX * H * 2 + H * 2 + 5)  # a sample of 12 tokens, bf16 aux and final


def storage(name: str = "lossless", **overrides: Any) -> dict[str, Any]:
    """The shipped conf/store/<name>.yaml, with small chunks and shards for small data."""
    cfg = OmegaConf.to_container(compose_config("dump", [f"store={name}"]).store)
    assert isinstance(cfg, dict)
    cfg.update({"target_chunk_bytes": 2048, "shard_bytes": 4 * SAMPLE_BYTES, **overrides})
    return cfg


def make_sample(sample_id: str) -> dict[str, torch.Tensor]:
    """A sample determined by its id (so two runs write identical data), 3-22 tokens."""
    gen = torch.Generator().manual_seed(zlib.crc32(sample_id.encode()))
    t = 3 + int(torch.randint(0, 20, (1,), generator=gen))
    aux = torch.randn(t, N_AUX, H, generator=gen) * torch.logspace(-2, 2, N_AUX)[None, :, None]
    aux[0, 0, 0] = 300.0  # an outlier channel, as real hidden states have
    return {"input_ids": torch.randint(0, VOCAB, (t,), generator=gen),
            "loss_mask": torch.rand(t, generator=gen) > 0.5,
            "aux": aux, "final": torch.randn(t, H, generator=gen)}


def open_writer(path: Path, storage_cfg: dict[str, Any] | None = None, rank: int = 0,
                world_size: int = 1, identity: dict[str, Any] = IDENTITY,
                aux_ids: list[int] = AUX_IDS, aux_capture: str = "residual_stream") -> StoreWriter:
    return StoreWriter(path, identity, aux_ids, storage_cfg or storage(), {"data": "test"},
                       aux_convention="vllm", aux_capture=aux_capture, rank=rank,
                       world_size=world_size)


def write_store(path: Path, ids: list[str], storage_cfg: dict[str, Any] | None = None,
                rank: int = 0, world_size: int = 1) -> StoreWriter:
    with open_writer(path, storage_cfg, rank, world_size) as writer:
        for sample_id in ids:
            if sample_id not in writer.done_sample_ids() and writer.owns(sample_id):
                writer.add(sample_id, **make_sample(sample_id))
                writer.commit_if_full()
    return writer


def read_all(path: Path) -> dict[str, Any]:
    reader = StoreReader(path)
    ids = [ref.sample_id for ref in reader.samples()]
    assert len(ids) == len(set(ids)), "a sample is stored twice"
    return {ref.sample_id: reader.read_sample(ref) for ref in reader.samples()}


def data_files(shard: Path) -> dict[str, list[str]]:
    """Files other than zarr.json under each array of a shard group."""
    return {a.name: [str(p.relative_to(a)) for p in a.rglob("*")
                     if p.is_file() and p.name != "zarr.json"]
            for a in shard.iterdir() if a.is_dir()}


IDS = [f"s{i:03d}" for i in range(24)]


def test_lossless_round_trip_is_bit_exact(tmp_path: Path) -> None:
    """Aux states bit exact in bf16; the final state bit exact on the rows a loss reads (the
    preset keeps only those: final_rows loss), 0 on the others."""
    stats = write_store(tmp_path, IDS).stats
    assert stats.samples == len(IDS) and stats.shards > 1 and not stats.rejected
    reader = StoreReader(tmp_path)
    assert (reader.identity, reader.aux_layer_ids, reader.mode) == (IDENTITY, AUX_IDS, "lossless")
    assert (reader.aux_encoding, reader.final_encoding, reader.final_rows, reader.topk) == \
        ("bf16", "bf16", "loss", None)
    assert [ref.sample_id for ref in reader.samples()] == IDS  # one rank keeps its order
    for ref in reader.samples():
        sample, expected = reader.read_sample(ref), make_sample(ref.sample_id)
        assert ref.num_tokens == len(expected["input_ids"])
        assert torch.equal(sample.input_ids, expected["input_ids"])
        assert torch.equal(sample.loss_mask, expected["loss_mask"])
        assert sample.aux.dtype == sample.final.dtype == torch.bfloat16
        assert sample.target_ids is None and sample.target_logprobs is None
        np.testing.assert_array_equal(encode_bf16(sample.aux), encode_bf16(expected["aux"]))
        rows = target_rows(expected["loss_mask"])
        np.testing.assert_array_equal(encode_bf16(sample.final[rows]), encode_bf16(expected["final"][rows]))
        assert not sample.final[~rows].any()
    assert reader.verify() == []


def test_fp32_round_trip_is_exact_and_tokens_read_alone(tmp_path: Path) -> None:
    """fp32 mode: the states of a verifier computing in fp32 (kimi-tiny on CPU), unrounded, at
    every position (final_rows all)."""
    write_store(tmp_path, IDS[:6], storage("fp32"))
    reader = StoreReader(tmp_path)
    assert (reader.mode, reader.aux_encoding, reader.final_encoding, reader.final_rows) == \
        ("fp32", "fp32", "fp32", "all")
    for ref in reader.samples():
        sample, expected = reader.read_sample(ref, torch.float32), make_sample(ref.sample_id)
        assert torch.equal(sample.aux, expected["aux"]) and torch.equal(sample.final, expected["final"])
        ids, mask = reader.read_tokens(ref)
        assert torch.equal(ids, expected["input_ids"]) and torch.equal(mask, expected["loss_mask"])
    assert reader.verify() == []


def test_a_shard_closes_before_the_sample_that_would_overflow_it(tmp_path: Path) -> None:
    """A shard holds at most store.shard_bytes of buffered arrays (at Kimi's width one capture call
    holds many shards' worth), or one sample that alone is larger; the caller's commit_if_full
    commits a full buffer, close the rest, and a failure leaves the store as a crash would."""
    limit = int(storage()["shard_bytes"])
    with open_writer(tmp_path) as writer:
        for sample_id in IDS[:10]:  # more than two shards' worth
            writer.add(sample_id, **make_sample(sample_id))
        assert writer.stats.shards >= 2                      # committed while adding, no call asked
        assert not writer.commit_if_full()                   # none is full: each closed before overflowing
        assert writer.bytes_per_token() == writer.stats.bytes / writer.stats.tokens > 0
    shards = StoreReader(tmp_path).shards()
    assert [i for e in shards for i in e.sample_ids] == IDS[:10]
    for entry in shards:
        assert _buffered_bytes(entry.sample_ids) <= limit, entry.name
    committed = [e.sample_ids for e in shards]
    with pytest.raises(KeyError), open_writer(tmp_path) as writer:
        writer.add(IDS[10], **make_sample(IDS[10]))
        raise KeyError("the caller failed before its next shard boundary")
    assert [e.sample_ids for e in StoreReader(tmp_path).shards()] == committed  # as a crash
    assert IDS[10] not in open_writer(tmp_path).done_sample_ids()


def _buffered_bytes(sample_ids: list[str]) -> int:
    """What the writer buffers of these samples (their encoded arrays)."""
    from store.settings import storage_settings
    from store.shard_buffer import encode_sample

    settings = storage_settings(storage())
    total = 0
    for i in sample_ids:
        sample = {k: torch.as_tensor(v) for k, v in make_sample(i).items()}
        arrays = encode_sample(settings, None, sample["input_ids"], sample["loss_mask"], sample["aux"], sample["final"])
        total += sum(a.nbytes for a in arrays.values())
    return total


def test_fp8_keeps_three_mantissa_bits_per_value(tmp_path: Path) -> None:
    """|x - fp8(x)| <= |x|/16 + scale * 2**-10, scale = amax of the token's row / 448."""
    write_store(tmp_path, IDS[:8], storage("fp8"))
    reader = StoreReader(tmp_path)
    assert reader.mode == "fp8"
    for ref in reader.samples():
        sample, expected = reader.read_sample(ref, torch.float32), make_sample(ref.sample_id)
        x = expected["aux"]
        scale = x.abs().amax(-1, keepdim=True) / 448
        assert ((sample.aux - x).abs() <= x.abs() / 16 + scale * 2**-10 + 1e-6 * x.abs()).all()
        # The final hidden state defines the target: lossless (bf16) in fp8 mode too.
        rows = target_rows(expected["loss_mask"])
        np.testing.assert_array_equal(encode_bf16(sample.final[rows]), encode_bf16(expected["final"][rows]))
    assert reader.verify() == []


def test_fp8_edge_rows() -> None:
    rows = torch.tensor([[0.0, 0.0, 0.0], [1e-30, -2e-30, 0.0], [448.0, -1e4, 3.0]])
    codes, scale = encode_fp8(rows)
    decoded = decode_fp8(codes, scale)
    assert torch.isfinite(decoded).all()
    assert torch.equal(decoded[0], rows[0])
    assert decoded[2, 1] == -1e4  # the row's amax is represented exactly


def test_chunks_sized_from_h_and_one_file_per_array(tmp_path: Path) -> None:
    write_store(tmp_path, IDS[:6], storage(shard_bytes=1 << 30))  # one shard holds all
    shard = next((tmp_path / SHARDS_DIR).iterdir())
    files = data_files(shard)
    assert set(files) == {"input_ids", "loss_mask", "aux_hidden", "final_hidden", "sample_offsets",
                          "final_offsets"}
    assert all(len(f) == 1 for f in files.values()), files  # the sharding codec: one file
    reader = StoreReader(tmp_path)
    arrays = reader._shard(shard.name).arrays
    # bf16 byte planes: one plane of one byte per value in a chunk, 21 tokens per 2 KiB chunk
    assert arrays[AUX].chunks == (2048 // (N_AUX * H), 1, N_AUX, H)
    final = arrays["final_hidden"]   # target rows only: fewer than one chunk's worth here
    assert final.chunks == (min(final.shape[0], 2048 // H), 1, H)
    tokens = sum(ref.num_tokens for ref in reader.samples())
    assert arrays[AUX].nchunks == 2 * -(-tokens // arrays[AUX].chunks[0]) > 2


def test_non_finite_samples_are_rejected_and_named(tmp_path: Path) -> None:
    nan_aux, inf_final = make_sample("nan"), make_sample("inf")
    nan_aux["aux"][1, 2, 3] = float("nan")
    inf_final["final"][0, 0] = float("inf")
    with open_writer(tmp_path) as writer:
        assert writer.add("nan", **nan_aux) is False
        assert writer.add("inf", **inf_final) is False
        assert writer.add("ok", **make_sample("ok")) is True
        # the caller's own rejections
        writer.reject(Rejection(RejectionKind.NO_ASSISTANT_TURN, "template", "no assistant turn"))
    assert set(writer.stats.rejected) == {"nan", "inf", "template"}
    assert "aux" in writer.stats.rejected["nan"].reason and "final" in writer.stats.rejected["inf"].reason
    assert writer.stats.rejected["nan"].kind == writer.stats.rejected["inf"].kind == RejectionKind.NON_FINITE
    assert set(read_all(tmp_path)) == {"ok"}
    report = inspect_store(tmp_path)
    assert set(report["rejected"]) == {"nan", "inf", "template"} and report["samples"] == 1
    assert "'nan'" in format_inspect(report)
    assert {"nan", "inf", "template", "ok"} <= open_writer(tmp_path).done_sample_ids()  # not retried


def test_rejection_records_round_trip_through_a_store(tmp_path: Path) -> None:
    """What the writer records is what the manifest keeps, what a resumed writer reads back and
    keeps through its next manifest write, and what inspect counts by kind."""
    nan = make_sample("nan")
    nan["aux"][0, 0, 0] = float("nan")
    empty = {k: v[:0] for k, v in make_sample("empty").items()}
    template = Rejection(RejectionKind.CHAT_TEMPLATE, "tool", "chat template failed: unknown role: tool",
                         Origin("chats.jsonl", 7))
    with open_writer(tmp_path) as writer:
        assert writer.add("nan", **nan, origin=Origin("chats.jsonl", 3)) is False
        assert writer.add("empty", **empty) is False
        writer.reject(template)
        writer.add("ok", **make_sample("ok"))
    expected = {"nan": Rejection(RejectionKind.NON_FINITE, "nan", "aux hidden states have 1 non-finite values "
                                 "(NaN/Inf)", Origin("chats.jsonl", 3)),
                "empty": Rejection(RejectionKind.NO_TOKENS, "empty", "no tokens"),
                "tool": template}
    assert writer.stats.rejected == expected
    raw = unseal_json(_manifest_path(tmp_path, 0).read_bytes())
    assert raw["rejected"]["tool"] == {"kind": "chat template", "file": "chats.jsonl", "line": 7,
                                       "reason": "chat template failed: unknown role: tool"}
    assert raw["rejected"]["empty"] == {"kind": "no tokens", "file": None, "line": None, "reason": "no tokens"}
    assert _read_manifest(_manifest_path(tmp_path, 0)).rejected == expected
    with open_writer(tmp_path) as resumed:  # a resumed run skips them, and rewrites the manifest
        assert set(expected) <= resumed.done_sample_ids()
        resumed.add("ok-2", **make_sample("ok-2"))
    assert _read_manifest(_manifest_path(tmp_path, 0)).rejected == expected
    report = inspect_store(tmp_path)
    assert report["rejected"] == {sample: r.to_json() for sample, r in expected.items()}
    assert report["rejected_by_kind"] == {"non-finite hidden states": 1, "no tokens": 1, "chat template": 1}
    text = format_inspect(report)
    assert "3 rejected (non-finite hidden states: 1, no tokens: 1, chat template: 1)" in text
    assert "rejected      'tool' at chats.jsonl:7, chat template: chat template failed" in text


def _refused_on_open(store: Path, error: type[Exception], refusal: str) -> dict:
    """The reader and a resuming writer refuse the store with this message; inspect's report of it."""
    with pytest.raises(error, match=refusal):
        StoreReader(store)
    with pytest.raises(error, match=refusal):
        open_writer(store)
    return inspect_store(store)


def test_a_manifest_of_reason_sentences_is_refused_naming_the_sample(tmp_path: Path) -> None:
    """Manifests written before rejections were records kept a sentence per sample; this code
    refuses one as damaged, naming the sample, and rebuilds it once moved away."""
    write_store(tmp_path, IDS[:4])
    file = _manifest_path(tmp_path, 0)
    raw = unseal_json(file.read_bytes())
    raw["rejected"] = {"a": "chats.jsonl:4 (sample a): 300 tokens > max_len 256"}
    replace_sealed_json(file, raw)  # as an earlier version wrote it: checked, the reason a sentence
    refusal = (f"{file} is damaged: .*rejection of sample 'a' is not a {{kind, file, line, reason}} record: "
               "got str 'chats.jsonl:4 .*written by an older version of the dump.* move it away and rerun")
    assert _refused_on_open(tmp_path, StoreCorruptError, refusal)["unreadable"]
    file.rename(tmp_path / "old-manifest.json")  # as its message says
    write_store(tmp_path, IDS[:5])
    assert set(read_all(tmp_path)) == set(IDS[:5]) and StoreReader(tmp_path).verify() == []


def test_a_rejection_of_a_kind_outside_the_set_is_a_damaged_manifest(tmp_path: Path) -> None:
    write_store(tmp_path, IDS[:2])
    file = _manifest_path(tmp_path, 0)
    raw = unseal_json(file.read_bytes())
    raw["rejected"] = {"x": {"kind": "cosmic ray", "file": None, "line": None, "reason": "?"}}
    replace_sealed_json(file, raw)
    with pytest.raises(StoreCorruptError, match="rank-00000.json is damaged: .*cosmic ray"):
        StoreReader(tmp_path)
    with pytest.raises(ValueError):
        Rejection("cosmic ray", "x", "?")  # type: ignore[arg-type]


def test_resume_with_other_settings_is_refused(tmp_path: Path) -> None:
    write_store(tmp_path, IDS[:2])
    other = {**IDENTITY, "config_sha256": "d" * 64}
    with pytest.raises(StoreMismatchError, match="config_sha256: store has 'c{64}', this run has 'd{64}'"):
        open_writer(tmp_path, identity=other)
    with pytest.raises(StoreMismatchError, match=r"aux_layer_ids: store has \[2, 4, 5\], this run has \[1, 3, 4\]"):
        open_writer(tmp_path, aux_ids=[1, 3, 4])
    with pytest.raises(StoreMismatchError, match="storage.mode: store has 'lossless', this run has "
                       "'fp8'; storage.aux: store has 'bf16', this run has 'fp8'"):
        open_writer(tmp_path, storage("fp8"))
    open_writer(tmp_path, identity={**IDENTITY, "name": "renamed"})  # same hashes: fine


def test_aux_capture_is_recorded_shown_and_must_match_on_resume(tmp_path: Path) -> None:
    with open_writer(tmp_path, aux_capture="prefix_only") as writer:
        writer.add(IDS[0], **make_sample(IDS[0]))
    assert read_store_meta(tmp_path)["aux_capture"] == "prefix_only"
    assert StoreReader(tmp_path).aux_capture == "prefix_only"
    report = inspect_store(tmp_path)
    assert report["aux_capture"] == "prefix_only" and report["problems"] == []
    assert "prefix_only capture" in format_inspect(report)
    with pytest.raises(StoreMismatchError,
                       match="aux_capture: store has 'prefix_only', this run has 'attn_res_stream'"):
        open_writer(tmp_path, aux_capture="attn_res_stream")
    with pytest.raises(ValueError, match="aux capture 'post_norm'"):
        open_writer(tmp_path / "other", aux_capture="post_norm")


@pytest.mark.parametrize("version", [1, 2])
def test_a_store_of_an_older_format_is_refused_naming_its_version(tmp_path: Path, version: int) -> None:
    """Formats 1 (no sha256 line anywhere) and 2 (sealed, one storage mode) are not read any more:
    the reader, a resuming writer and inspect refuse the store by its version, never as damage."""
    write_store(tmp_path, IDS[:4])
    meta = {**read_store_meta(tmp_path), "format_version": version}
    if version == 1:
        (tmp_path / STORE_META).write_text(json.dumps(meta))
    else:
        replace_sealed_json(tmp_path / STORE_META, meta)
    refusal = (f"store {tmp_path} has format version {version}: it was written by an older version of the "
               "dump, whose stores are not read any more .*dump again into a new store folder")
    report = _refused_on_open(tmp_path, StoreMismatchError, refusal)
    assert report["unreadable"] and "older version of the dump" in report["problems"][0]


def test_a_checked_json_file_without_its_sha256_line_is_damaged(tmp_path: Path) -> None:
    write_store(tmp_path, IDS[:6])
    manifest = tmp_path / MANIFEST_DIR / "rank-00000.json"
    for file in (tmp_path / STORE_META, manifest):
        original = file.read_bytes()
        body = original[:original.rindex(b"\nsha256:")]
        file.write_bytes(body)  # valid JSON, version 3, no sha256 line
        with pytest.raises(StoreCorruptError, match=f"{file.name} is damaged: it does not end with"):
            StoreReader(tmp_path)
        report = inspect_store(tmp_path)
        assert report["unreadable"] and file.name in report["problems"][0]
        file.write_bytes(original)
    assert StoreReader(tmp_path).verify() == []


def test_a_damaged_manifest_stops_the_writer_and_is_rebuilt_once_moved_away(tmp_path: Path) -> None:
    write_store(tmp_path, IDS[:12])
    manifest = tmp_path / MANIFEST_DIR / "rank-00000.json"
    before = _read_manifest(manifest)
    data = bytearray(manifest.read_bytes())
    data[40] ^= 0x08
    manifest.write_bytes(bytes(data))
    with pytest.raises(StoreCorruptError, match=f"{manifest} is damaged: .* move it away and rerun"):
        open_writer(tmp_path)
    manifest.rename(tmp_path / "damaged-manifest.json")  # as its message says
    writer = write_store(tmp_path, IDS)
    assert writer.stats.adopted == [s.name for s in before.shards]
    assert _read_manifest(manifest).shards[:len(before.shards)] == before.shards  # hashes too
    assert set(read_all(tmp_path)) == set(IDS) and StoreReader(tmp_path).verify() == []


def test_two_ranks_write_disjoint_shards_of_one_store(tmp_path: Path) -> None:
    writers = [open_writer(tmp_path, rank=r, world_size=2) for r in (0, 1)]
    for sample_id in IDS:  # interleaved, as two processes would
        for writer in writers:
            if writer.owns(sample_id):
                writer.add(sample_id, **make_sample(sample_id))
                writer.commit_if_full()
    with pytest.raises(ValueError, match="belongs to rank"):
        other = next(f"x{i}" for i in range(100) if rank_of(f"x{i}", 2) == 1)
        writers[0].add(other, **make_sample(other))
    for writer in writers:
        writer.close()
    assert {rank_of(s, 2) for s in IDS} == {0, 1}
    reader = StoreReader(tmp_path)
    by_rank = {r: {s for e in reader.shards() if e.name.startswith(f"r{r:05d}") for s in e.sample_ids}
               for r in (0, 1)}
    assert by_rank[0] == {s for s in IDS if rank_of(s, 2) == 0}
    assert by_rank[1] == {s for s in IDS if rank_of(s, 2) == 1}
    assert set(read_all(tmp_path)) == set(IDS)
    assert reader.verify() == []


def test_a_rank_has_one_writer_at_a_time(tmp_path: Path) -> None:
    first = open_writer(tmp_path)
    with pytest.raises(RuntimeError, match="rank 0 of store .* is being written by another process"):
        open_writer(tmp_path)
    open_writer(tmp_path, rank=1, world_size=2).close()  # another rank is free to write
    first.close()
    open_writer(tmp_path).close()  # and so is rank 0 once its writer is closed


def test_dist_env_reads_torchrun_then_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(key, raising=False)
    assert dist_env() == (0, 1)
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert dist_env() == (3, 4)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert dist_env() == (1, 2)
    assert dist_env(rank=0, world_size=None) == (0, 2)  # the config wins where set
    with pytest.raises(ValueError, match="not in"):
        dist_env(rank=2, world_size=2)


def test_verifier_identity_hashes_config_and_tokenizer(tmp_path: Path) -> None:
    config = {"hidden_size": 256, "vocab_size": 8192, "num_hidden_layers": 8, "model_type": "x"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "tokenizer.json").write_text('{"model": 1}')
    first = verifier_identity(tmp_path, "v")
    assert (first["hidden_size"], first["vocab_size"], first["num_hidden_layers"]) == (256, 8192, 8)
    reordered = {"transformers_version": "9.9", **dict(reversed(list(config.items())))}
    (tmp_path / "config.json").write_text(json.dumps(reordered, indent=4))
    assert verifier_identity(tmp_path, "v") == first  # same model, saved differently
    (tmp_path / "tokenizer.json").write_text('{"model": 2}')
    assert verifier_identity(tmp_path, "v")["tokenizer_sha256"] != first["tokenizer_sha256"]


def test_crash_between_rename_and_manifest_and_mid_shard(tmp_path: Path) -> None:
    """The two crash windows, made by hand: a committed shard its manifest does not list yet,
    and a half-written .tmp shard."""
    write_store(tmp_path, IDS[:12])
    manifest = _read_manifest(tmp_path / "manifest/rank-00000.json")
    orphan = asdict(manifest.shards.pop())  # as if killed between the rename and the manifest
    _write_manifest(tmp_path, manifest)
    half = tmp_path / SHARDS_DIR / ".tmp-r00000-000099.zarr"
    (half / "aux_hidden").mkdir(parents=True)
    (half / "aux_hidden/zarr.json").write_text('{"zarr_fo')
    assert set(read_all(tmp_path)) == set(IDS[:12])  # the reader sees committed shards only
    writer = open_writer(tmp_path)
    assert writer.stats.adopted == [orphan["name"]]
    assert writer.stats.removed_tmp == [half.name] and not half.exists()
    assert set(orphan["sample_ids"]) <= writer.done_sample_ids()
    writer.close()
    adopted = next(s for s in _read_manifest(tmp_path / "manifest/rank-00000.json").shards
                   if s.name == orphan["name"])
    assert adopted.metadata_sha256 == orphan["metadata_sha256"]  # hashed as at its commit
    write_store(tmp_path, IDS)
    assert set(read_all(tmp_path)) == set(IDS)


def _flip_byte_in_chunk(array_file: Path, n_chunks: int, chunk: int) -> None:
    """Flip a byte in the middle of one chunk, found through the shard index at the end of the
    file: per chunk, offset and length as uint64 little-endian, then the index's crc32c."""
    data = bytearray(array_file.read_bytes())
    index_at = len(data) - 4 - 16 * n_chunks
    offset, length = struct.unpack_from("<QQ", data, index_at + 16 * chunk)
    data[offset + length // 2] ^= 0xFF
    array_file.write_bytes(bytes(data))


def test_flipped_byte_is_named_by_verify_inspect_and_reader(tmp_path: Path) -> None:
    write_store(tmp_path, IDS[:6], storage(shard_bytes=1 << 30))
    reader = StoreReader(tmp_path)
    shard_name = reader.shards()[0].name
    shard = reader._shard(shard_name)
    rows = shard.arrays[AUX].chunks[0]
    # Chunks in C order over (row block, plane): chunk 2 is the high plane of the second row block.
    _flip_byte_in_chunk(tmp_path / SHARDS_DIR / shard_name / "aux_hidden/c/0/0/0/0",
                        shard.arrays[AUX].nchunks, chunk=2)
    hit = shard.samples_in(rows, 2 * rows)
    assert hit and len(hit) < len(IDS[:6])

    problems = StoreReader(tmp_path).verify()
    assert len(problems) == 1
    problem = problems[0]
    assert (problem.shard, problem.array, list(problem.sample_ids)) == (shard_name, AUX, hit)
    assert "checksum" in problem.message

    report = inspect_store(tmp_path)
    assert report["problems"] == [str(problem)]
    text = format_inspect(report)
    assert "PROBLEMS" in text and shard_name in text and repr(hit[0]) in text

    fresh = StoreReader(tmp_path)
    refs = {ref.sample_id: ref for ref in fresh.samples()}
    with pytest.raises(ShardCorruptError, match=f"shard {shard_name}, array aux_hidden"):
        fresh.read_sample(refs[hit[0]])
    untouched = [s for s in IDS[:6] if s not in hit and refs[s].num_tokens]
    fresh.read_sample(refs[untouched[0]])


def test_inspect_reports_sizes(tmp_path: Path) -> None:
    write_store(tmp_path, IDS[:8], storage(final_rows="all"))  # every row: (n_aux + 1) * H * 2 B/token
    report = inspect_store(tmp_path)
    assert report["samples"] == 8 and report["problems"] == []
    assert report["reference_bytes_per_token"] == 4 * H * 2
    assert report["logical_bytes_per_token"] == pytest.approx(4 * H * 2 + 5, abs=2)
    assert report["bytes_per_token"] > 0 and "verified: OK" in format_inspect(report)
    arrays = report["arrays"]
    assert set(arrays) == {"input_ids", "loss_mask", "aux_hidden", "final_hidden", "sample_offsets"}
    assert sum(a["bytes"] for a in arrays.values()) + report["bytes_on_disk_by_array"]["metadata"] \
        == report["bytes_on_disk"]
    assert arrays["aux_hidden"]["bytes_per_token"] == arrays["aux_hidden"]["bytes"] / report["tokens"]
