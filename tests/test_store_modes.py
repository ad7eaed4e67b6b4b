"""The storage encodings of the store (conf/store presets: lossless, fp32, fp8, fp4, compact) on
real Zarr stores on disk: each round-trips within its stated bound, final_rows loss keeps exactly
the target rows, and stores of other settings, newer formats and unknown encodings are refused
(older formats: tests/test_store.py)."""
from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from store import (
    FINAL_OFFSETS,
    SHARDS_DIR,
    STORE_META,
    TARGET_LOGPROBS,
    Sample,
    ShardCorruptError,
    StoreMismatchError,
    StoreReader,
    StoreWriter,
    decode_fp4,
    encode_fp4,
    format_inspect,
    inspect_store,
    read_store_meta,
    storage_settings,
    target_rows,
)
from store.sealed import write_sealed_json
from tests.test_store import AUX_IDS, IDENTITY, IDS, N_AUX, VOCAB, H, _flip_byte_in_chunk, make_sample, storage

# The verifier's lm_head for the top-k presets: logits of a few units, as a trained head gives.
HEAD = torch.randn(VOCAB, H, generator=torch.Generator().manual_seed(7)) / H**0.5 * 4


def open_writer(path: Path, storage_cfg: dict[str, Any], identity: dict[str, Any] = IDENTITY,
                head: torch.Tensor | None = HEAD) -> StoreWriter:
    return StoreWriter(path, identity, AUX_IDS, storage_cfg, {"data": "test"}, aux_convention="vllm",
                       aux_capture="residual_stream", rank=0, world_size=1, target_head=head)


def write(path: Path, storage_cfg: dict[str, Any], samples: dict[str, dict[str, torch.Tensor]],
          **kwargs: Any) -> StoreWriter:
    with open_writer(path, storage_cfg, **kwargs) as writer:
        for sample_id, sample in samples.items():
            assert writer.add(sample_id, **sample)
            writer.commit_if_full()
    return writer


def reference_logprobs(final: torch.Tensor, head: torch.Tensor = HEAD) -> torch.Tensor:
    return torch.log_softmax(final.float() @ head.float().T, dim=-1)


def fp4_bound(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """max(scale, |x|) / 4 per element, scale = amax of its block / 6 rounded up to a bf16 (at most
    2**-7 above), plus float32 rounding."""
    amax = x.reshape(*x.shape[:-1], -1, block).abs().amax(-1, keepdim=True)
    scale = (amax / 6 * (1 + 2**-7)).expand(*amax.shape[:-1], block).reshape(x.shape)
    return torch.maximum(scale, x.abs()) / 4 * (1 + 1e-6)


def check_aux(encoding: str, got: torch.Tensor, x: torch.Tensor) -> None:
    """The aux states read back as float32 within the bound of their encoding."""
    if encoding == "fp32":
        assert torch.equal(got, x)
    elif encoding == "bf16":
        assert torch.equal(got, x.bfloat16().float())
    elif encoding == "fp8":
        scale = x.abs().amax(-1, keepdim=True) / 448
        assert ((got - x).abs() <= x.abs() / 16 + scale * 2**-10 + 1e-6 * x.abs()).all()
    else:
        assert ((got - x).abs() <= fp4_bound(x)).all()


def check_final(reader: StoreReader, sample: Sample, expected: dict[str, torch.Tensor]) -> None:
    """The final side: the target rows (every row with final_rows all) exact to their encoding,
    the others 0, -1 or -inf."""
    rows = target_rows(expected["loss_mask"]) if reader.final_rows == "loss" else \
        torch.ones(len(expected["loss_mask"]), dtype=torch.bool)
    if reader.final_encoding == "topk":
        assert sample.final is None and sample.target_ids.dtype == torch.int64
        assert sample.target_logprobs.dtype == torch.float32
        want = reference_logprobs(expected["final"][rows]).topk(reader.topk, dim=-1)
        assert torch.equal(sample.target_ids[rows], want.indices)
        got = sample.target_logprobs[rows]
        assert (got[:, :-1] >= got[:, 1:]).all()  # descending
        assert ((got - want.values).abs() <= want.values.abs() * 2**-11 + 1e-5).all()  # float16
        assert (sample.target_ids[~rows] == -1).all()
        assert torch.isneginf(sample.target_logprobs[~rows]).all()
        return
    assert sample.target_ids is None and sample.target_logprobs is None
    stored = expected["final"][rows]
    want = stored if reader.final_encoding == "fp32" else stored.bfloat16().float()
    assert torch.equal(sample.final[rows], want)
    assert not sample.final[~rows].any()


PRESETS = {  # preset -> (mode, aux, final, final_rows) it must mean
    "lossless": ("lossless", "bf16", "bf16", "loss"),
    "fp32": ("fp32", "fp32", "fp32", "all"),
    "fp8": ("fp8", "fp8", "bf16", "loss"),
    "fp4": ("fp4", "fp4", "bf16", "loss"),
    "compact": ("compact", "fp4", "topk", "loss"),
}


@pytest.mark.parametrize("preset", PRESETS)
def test_each_preset_round_trips_within_its_bound(tmp_path: Path, preset: str) -> None:
    samples = {sample_id: make_sample(sample_id) for sample_id in IDS[:10]}
    stats = write(tmp_path, storage(preset, shard_bytes=2048), samples).stats  # several shards, any preset
    assert stats.shards > 1 and stats.samples == 10
    reader = StoreReader(tmp_path)
    assert (reader.mode, reader.aux_encoding, reader.final_encoding, reader.final_rows) == PRESETS[preset]
    assert reader.topk == (32 if preset == "compact" else None)
    for ref in reader.samples():
        sample, expected = reader.read_sample(ref, torch.float32), samples[ref.sample_id]
        assert torch.equal(sample.input_ids, expected["input_ids"])
        assert torch.equal(sample.loss_mask, expected["loss_mask"])
        assert sample.aux.dtype == torch.float32 and sample.aux.shape == expected["aux"].shape
        check_aux(reader.aux_encoding, sample.aux, expected["aux"])
        check_final(reader, sample, expected)
        assert reader.read_sample(ref).aux.dtype == torch.bfloat16  # the default dtype
    assert reader.verify() == []


def edge_samples() -> dict[str, dict[str, torch.Tensor]]:
    """Loss masks a store must keep exactly: ending in an assistant token, without any, all
    assistant, only the first token, one token."""
    masks = {"ends-assistant": [0, 0, 1, 1, 0, 1], "no-assistant": [0, 0, 0, 0],
             "all-assistant": [1, 1, 1, 1, 1], "first-only": [1, 0, 0], "one-token": [1]}
    samples = {}
    for name, mask in masks.items():
        gen, t = torch.Generator().manual_seed(zlib.crc32(name.encode())), len(mask)
        samples[name] = {"input_ids": torch.randint(0, VOCAB, (t,), generator=gen),
                         "loss_mask": torch.tensor(mask).bool(),
                         "aux": torch.randn(t, N_AUX, H, generator=gen),
                         "final": torch.randn(t, H, generator=gen)}
    return samples


def test_target_rows_are_those_whose_next_token_is_in_the_loss() -> None:
    cases = {(0, 0, 1, 1, 0, 1): [0, 1, 1, 0, 1, 0], (0, 0, 0): [0, 0, 0], (1, 1, 1): [1, 1, 0],
             (1, 0, 0): [0, 0, 0], (1,): [0], (): []}
    for mask, rows in cases.items():
        assert target_rows(torch.tensor(mask, dtype=torch.bool)).tolist() == [bool(r) for r in rows]


@pytest.mark.parametrize("preset", ["lossless", "compact"])
def test_final_rows_loss_on_edge_masks(tmp_path: Path, preset: str) -> None:
    samples = edge_samples()
    write(tmp_path, storage(preset, shard_bytes=1 << 30), samples)
    reader = StoreReader(tmp_path)
    shard = reader._shard(reader.shards()[0].name)
    stored = np.diff(shard.arrays[FINAL_OFFSETS][...]).tolist()
    assert stored == [int(target_rows(s["loss_mask"]).sum()) for s in samples.values()] == [3, 0, 4, 0, 0]
    for ref in reader.samples():
        check_final(reader, reader.read_sample(ref, torch.float32), samples[ref.sample_id])
    assert reader.verify() == []


def test_a_shard_without_any_target_row_is_written_read_and_verified(tmp_path: Path) -> None:
    samples = {k: v for k, v in edge_samples().items() if k in ("no-assistant", "first-only", "one-token")}
    write(tmp_path, storage("compact"), samples)
    reader = StoreReader(tmp_path)
    for ref in reader.samples():
        sample = reader.read_sample(ref)
        assert (sample.target_ids == -1).all() and torch.isneginf(sample.target_logprobs).all()
    report = inspect_store(tmp_path)
    assert report["problems"] == [] and report["arrays"].get("target_ids", {"bytes": 0})["bytes"] == 0


def test_fp4_layout_and_rounding() -> None:
    """Codes are e2m1 bits (sign in bit 3), two per byte, even index in the low nibble; a block
    whose amax is 6 has scale 1 exactly; values round to the nearest grid point."""
    x = torch.tensor([[0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5, -6.0, 0.2, 0.3, 2.4, 5.1, -4.9, -0.1]])
    codes, scale = encode_fp4(x, block=16)
    assert codes.dtype == np.uint8 and codes.shape == (1, 8) and scale.dtype == np.uint16
    assert scale.tolist() == [[0x3F80]]  # bf16 1.0
    assert codes[0, :5].tolist() == [0x10, 0x32, 0x54, 0x76, 0xF9]
    assert decode_fp4(codes, scale, 16)[0, 10:].tolist() == [0.0, 0.5, 2.0, 6.0, -4.0, 0.0]
    zeros, zero_scale = encode_fp4(torch.zeros(2, 32))
    assert zero_scale.tolist() == [[0x3F80], [0x3F80]] and not zeros.any()  # all-zero block: scale 1
    with pytest.raises(ValueError, match="divisible by the block of 24"):
        encode_fp4(torch.zeros(1, 32), block=24)


def test_fp4_bound_holds_with_outliers_and_tiny_values(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, N_AUX, 256, generator=gen)
    x[:, :, 5] *= 1000  # one channel 1000x larger, as real hidden states have
    x[3, 1] = torch.randn(256, generator=gen) * 1e-30
    x[4, 2, :16] = 0.0
    codes, scale_bits = encode_fp4(x)
    decoded = decode_fp4(codes, scale_bits, 32)
    assert ((decoded - x).abs() <= fp4_bound(x)).all()
    scale = torch.from_numpy(scale_bits.astype(np.int32) << 16).view(torch.float32)
    amax = x.reshape(64, N_AUX, -1, 32).abs().amax(-1)
    assert (scale * 6 >= amax).all()  # rounded up: nothing is clamped
    assert (scale <= amax / 6 * (1 + 2**-7)).all()
    assert torch.equal(decode_fp4(codes, scale_bits, 32, torch.bfloat16), decoded.bfloat16())
    # The outlier costs precision in its own block only.
    assert torch.equal(decoded[..., 32:], decode_fp4(*encode_fp4(x[..., 32:]), 32))
    # Through a store (H=32: blocks of 8), read back as bf16.
    t, x = 64, x[..., :H]
    sample = {"input_ids": torch.arange(t), "loss_mask": torch.ones(t, dtype=torch.bool), "aux": x,
              "final": torch.randn(t, H, generator=gen)}
    write(tmp_path, storage("fp4", fp4_block=8), {"outliers": sample})
    got = StoreReader(tmp_path)[0].aux.float()
    assert ((got - x).abs() <= fp4_bound(x, 8) + x.abs() * 2**-8).all()  # + the bf16 rounding
    assert torch.equal(got[..., 8:], decode_fp4(*encode_fp4(x[..., 8:], 8), 8, torch.bfloat16).float())


def test_settings_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="storage aux encoding 'fp2' is not one of bf16, fp32, fp8, fp4"):
        storage_settings(storage(aux="fp2"))
    with pytest.raises(ValueError, match="storage final_rows 'some'"):
        storage_settings(storage(final_rows="some"))
    with pytest.raises(ValueError, match="storage settings lack aux, final, final_rows"):
        storage_settings({k: v for k, v in storage().items() if k not in ("aux", "final", "final_rows")})
    with pytest.raises(ValueError, match="pass StoreWriter the verifier's lm_head"):
        open_writer(tmp_path / "a", storage("compact"), head=None)
    with pytest.raises(ValueError, match=r"target_head has shape \(1000, 16\)"):
        open_writer(tmp_path / "b", storage("compact"), head=HEAD[:, :16])
    with pytest.raises(ValueError, match=r"fp4_block \(24\) to divide the hidden size 32"):
        open_writer(tmp_path / "c", storage("fp4", fp4_block=24))
    with pytest.raises(ValueError, match="topk 2000 is more than the vocabulary of 1000"):
        open_writer(tmp_path / "d", storage("compact", topk=2000))
    assert not any((tmp_path / name / STORE_META).exists() for name in "abcd")  # refused before writing
    open_writer(tmp_path / "e", storage("lossless"), head=None).close()  # no head needed


def test_resume_with_another_mode_is_refused_naming_both(tmp_path: Path) -> None:
    write(tmp_path, storage("lossless"), {"s": make_sample("s")})
    with pytest.raises(StoreMismatchError) as refused:
        open_writer(tmp_path, storage("compact"))
    message = str(refused.value)
    for expected in ("storage.mode: store has 'lossless', this run has 'compact'",
                     "storage.aux: store has 'bf16', this run has 'fp4'",
                     "storage.final: store has 'bf16', this run has 'topk'",
                     "storage.topk: store has None, this run has 32"):
        assert expected in message, message
    with pytest.raises(StoreMismatchError, match="storage.final_rows: store has 'loss', this run has 'all'"):
        open_writer(tmp_path, storage("lossless", final_rows="all"))
    write(tmp_path / "fp4", storage("fp4"), {"s": make_sample("s")})
    with pytest.raises(StoreMismatchError, match="storage.fp4_block: store has 32, this run has 16"):
        open_writer(tmp_path / "fp4", storage("fp4", fp4_block=16))
    open_writer(tmp_path, storage("lossless", compressor={"name": "zstd", "level": 1})).close()  # bytes alike


def rewrite_store_json(path: Path, change: dict[str, Any]) -> None:
    meta = read_store_meta(path)
    for key, value in change.items():
        target, *rest = key.split(".")
        if rest:
            meta[target][rest[0]] = value
        else:
            meta[key] = value
    write_sealed_json(path / STORE_META, meta)  # with its sha256 line: not damage, a newer store


@pytest.mark.parametrize("change, expected", [
    ({"format_version": 4}, "has format version 4; this code reads version 3: upgrade it"),
    ({"storage.aux": "fp2"}, "aux encoding 'fp2' is not one of bf16, fp32, fp8, fp4.*upgrade it"),
    ({"storage.final": "topk-entropy"}, "final encoding 'topk-entropy'.*upgrade it"),
])
def test_a_newer_format_or_unknown_encoding_is_refused_on_open(tmp_path: Path, change: dict[str, Any],
                                                               expected: str) -> None:
    write(tmp_path, storage("lossless"), {"s": make_sample("s")})
    rewrite_store_json(tmp_path, change)
    with pytest.raises(StoreMismatchError, match=f"store {tmp_path} .*{expected}"):
        StoreReader(tmp_path)
    with pytest.raises(StoreMismatchError, match=expected):
        open_writer(tmp_path, storage("lossless"))
    report = inspect_store(tmp_path)
    assert report["unreadable"] and str(tmp_path) in report["problems"][0]


def test_inspect_lists_the_mode_encodings_and_bytes_per_array(tmp_path: Path) -> None:
    write(tmp_path, storage("compact"), {s: make_sample(s) for s in IDS[:8]})
    report = inspect_store(tmp_path)
    assert report["problems"] == [] and report["mode"] == "compact"
    assert report["encodings"] == {"aux": "fp4", "final": "topk", "final_rows": "loss", "fp4_block": 32,
                                   "topk": 32}
    arrays = report["arrays"]
    assert set(arrays) == {"input_ids", "loss_mask", "aux_hidden", "aux_scale", "target_ids",
                           "target_logprobs", "sample_offsets", "final_offsets"}
    for figures in arrays.values():
        assert figures["bytes"] > 0
        assert figures["bytes_per_token"] == pytest.approx(figures["bytes"] / report["tokens"])
        assert figures["share"] == pytest.approx(figures["bytes"] / report["bytes_on_disk"])
    text = format_inspect(report)
    assert "compact: aux fp4 (blocks of 32), final topk (k=32), final rows loss" in text
    line = next(line for line in text.splitlines() if line.strip().startswith("target_logprobs"))
    assert f"{arrays['target_logprobs']['bytes']:,}" in line and "%" in line


def test_a_flipped_byte_in_the_top_k_is_named(tmp_path: Path) -> None:
    write(tmp_path, storage("compact", shard_bytes=1 << 30, target_chunk_bytes=256),
          {s: make_sample(s) for s in IDS[:8]})
    reader = StoreReader(tmp_path)
    name = reader.shards()[0].name
    array = reader._shard(name).arrays[TARGET_LOGPROBS]
    assert array.nchunks > 2
    _flip_byte_in_chunk(tmp_path / SHARDS_DIR / name / "target_logprobs/c/0/0", array.nchunks, chunk=1)
    problems = StoreReader(tmp_path).verify()
    assert len(problems) == 1 and problems[0].array == TARGET_LOGPROBS
    fresh = StoreReader(tmp_path)
    refs = {ref.sample_id: ref for ref in fresh.samples()}
    hit = problems[0].sample_ids
    with pytest.raises(ShardCorruptError, match=f"shard {name}, array target_logprobs"):
        fresh.read_sample(refs[hit[0]])
    for sample_id in set(refs) - set(hit):
        fresh.read_sample(refs[sample_id])  # the chunk's damage spoils only the samples it holds


def test_compact_store_is_under_a_quarter_of_bf16_at_kimi_width(tmp_path: Path) -> None:
    """At H=7168 and 3 aux layers, on random (incompressible) states: bytes on disk per token at
    most 0.25 x 4*H*2, the bf16 aux + final reference."""
    h, vocab = 7168, 512
    identity = {**IDENTITY, "hidden_size": h, "vocab_size": vocab}
    gen = torch.Generator().manual_seed(zlib.crc32(b"kimi"))
    samples = {}
    for i, t in enumerate((96, 160)):
        samples[f"k{i}"] = {"input_ids": torch.randint(0, vocab, (t,), generator=gen),
                            "loss_mask": torch.arange(t) >= t // 4,  # a prompt, then the answer
                            "aux": torch.randn(t, N_AUX, h, generator=gen),
                            "final": torch.randn(t, h, generator=gen)}
    head = torch.randn(vocab, h, generator=gen) / h**0.5
    write(tmp_path, storage("compact", target_chunk_bytes=1 << 20, shard_bytes=1 << 30), samples,
          identity=identity, head=head)
    report = inspect_store(tmp_path)
    assert report["problems"] == [] and report["reference_bytes_per_token"] == 4 * h * 2
    assert report["bytes_per_token"] <= 0.25 * 4 * h * 2, report["arrays"]
    assert report["arrays"]["aux_hidden"]["bytes_per_token"] <= N_AUX * h / 2 * 1.01


def test_fp4_decodes_to_bf16_as_the_float32_path_rounded() -> None:
    """The bf16 shortcut (product formed in bf16) gives the bits of the float32 product cast."""
    x = torch.randn(64, 3, 256, generator=torch.Generator().manual_seed(5)) * 3
    x[..., :4] *= 500
    codes, scale_bits = encode_fp4(x)
    assert torch.equal(decode_fp4(codes, scale_bits, 32, torch.bfloat16),
                       decode_fp4(codes, scale_bits, 32, torch.float32).to(torch.bfloat16))
