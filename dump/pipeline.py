"""Stage 1 end to end: conversations -> (regenerated answers) -> tokens -> vLLM capture -> store.

Work comes in rounds of `batch_size` conversations of this rank (a regeneration round decodes them
together), and each round's samples are captured in engine calls of at most
`capture.max_batch_tokens` tokens (`token_batches`; a longer sample goes alone), so the captured
states held at once follow that budget, not the round nor the data set. A shard closes wherever
the next sample would take it past store.shard_bytes, inside a call too (at Kimi's width a call of
65,536 tokens holds 3.75 GiB of states, 14 shards of 256 MiB). Resuming is exact: rounds are cut
from the rank's whole stream of conversations (done ones included) and calls from a round's whole
list of samples, so a resumed run decodes and captures every unfinished sample in the same company
as an uninterrupted run would (batched numerics depend on it); only calls with a sample not yet in
the store run again, whole, and add only those samples.
"""
from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any, TypeVar

import torch
from omegaconf import OmegaConf
from tqdm import tqdm
from transformers import PreTrainedTokenizerBase

from config.groups import StoreConf, VerifierConf
from config.stages import DumpJob
from data.conversations import Conversation, ReadStats
from data.heldout_set import DumpHeldout, HeldoutSet, dump_conversations, dump_heldout
from data.split import held_out_by
from data.rejection import Rejection
from data.template import SampleRejected, TokenizedSample, tokenize_conversation
from dump.capture import CapturedSample, HiddenStateCapture, capture_spec, start_capture_engine
from dump.engine import decode_dtype, make_llm, sampling_engine_kwargs, shutdown_llm, vllm_on_cpu
from dump.regenerate import regenerate, with_sampled_copies
from infra import failpoint, resolve
from model.verifier_handle import Verifier
from store import StoreWriter
from data.packing import pack_next_fit


T = TypeVar("T")


@dataclass
class Rejections:
    """The records of the samples this run rejected, by sample id, in the order they came."""

    records: dict[str, Rejection] = field(default_factory=dict)

    def note(self, rejection: Rejection) -> None:
        self.records[rejection.sample] = rejection

    def summary(self) -> dict[str, Any]:
        """The summary's account: how many, each record as the manifest keeps it (its kind, the
        file:line of the record it came from, and the reason), and how many of each kind."""
        kinds = Counter(r.kind.value for r in self.records.values())
        return {"samples_rejected": len(self.records),
                "rejected": {sample: r.to_json() for sample, r in self.records.items()},
                "rejected_by_kind": dict(kinds.most_common())}


def batched(items: Iterable[T], size: int) -> Iterator[list[T]]:
    it = iter(items)
    while batch := list(islice(it, size)):
        yield batch


def token_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Indices of consecutive items grouped into batches of at most max_tokens tokens, in order;
    an item longer than max_tokens is a batch of its own: the next-fit grouping the trainer packs
    rows with (data/packing.py pack_next_fit)."""
    if max_tokens < 1:
        raise ValueError(f"capture.max_batch_tokens must be positive, got {max_tokens}")
    return pack_next_fit(lengths, max_tokens)


def open_writer(output_dir: str | Path, verifier: VerifierConf, store: StoreConf, record: dict[str, Any],
                rank: int | None = None, world_size: int | None = None,
                heldout: Callable[[str], bool] | None = None) -> StoreWriter:
    """The store at output_dir of `verifier`'s hidden states (conf/verifier, conf/store nodes).

    record: plain values store.json keeps under `dump` (the run's resolved config). A store whose
    final side is the verifier's top-k (store=compact) gets the verifier's lm_head, in float32 on
    the GPU where there is one, to compute it. heldout: the dump's held-out samples (data/heldout_set.py
    DumpHeldout), written to shards of their own; store.max_bytes bounds the shards on disk."""
    handle = Verifier.from_conf(verifier)
    # The ids and convention as configured: the store records what its config said.
    return StoreWriter(resolve(output_dir), handle.identity,
                       list(verifier.aux_layer_ids), store, record,
                       aux_convention=verifier.aux_convention,
                       aux_capture=verifier.aux_capture,
                       rank=rank, world_size=world_size, target_head=target_head_for(store, handle),
                       heldout=heldout, max_bytes=store.max_bytes, poll_s=store.poll_s)


def target_head_for(store: StoreConf, verifier: Verifier) -> torch.Tensor | None:
    """The verifier's lm_head [V, H], float32 on the GPU where there is one, for storage settings
    that keep its top-k next tokens (final: topk); None for the others."""
    if store.final != "topk":
        return None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    head = verifier.lm_head().to(device, torch.float32)
    verifier.release_tensors()            # the writer holds its copy; the handle keeps no other
    return head


def write_batch(writer: StoreWriter, capture: HiddenStateCapture, samples: list[TokenizedSample],
                rejections: Rejections | None = None, done: AbstractSet[str] = frozenset()) -> int:
    """Capture one batch of tokenized samples in one engine call and add those not `done` to the
    store; returns the tokens added.

    The samples the store refuses (non-finite states) are noted in `rejections`, if given."""
    captured: list[CapturedSample | None] = []
    if samples:
        captured.extend(capture.capture([s.input_ids for s in samples]))
    tokens = 0
    for i, sample in enumerate(samples):
        states, captured[i] = captured[i], None  # the writer keeps its own encoding: let go of ours
        if sample.id in done:
            continue
        tokens += len(sample.input_ids)
        added = writer.add(sample.id, sample.input_ids, sample.loss_mask, states.aux, states.final,
                           sample.origin)
        if not added and rejections is not None:
            rejections.note(writer.stats.rejected[sample.id])
    writer.commit_if_full()            # a sample larger than a shard alone
    return tokens


def conversations_of(cfg: DumpJob, stats: ReadStats | None = None) -> Iterator[Conversation]:
    """What the dump writes, in order: the data's conversations and the trainer's held-out set
    (data/heldout_set.py)."""
    return dump_conversations(cfg.data, cfg.split, trainer_rule(cfg), heldout_set_of(cfg), stats)


def heldout_set_of(cfg: DumpJob) -> HeldoutSet:
    """conf/dump.yaml heldout_set; no conversations to read on for where nothing is held out."""
    wanted = cfg.heldout_set.conversations if cfg.heldout_split.heldout_fraction > 0 else 0
    return HeldoutSet(wanted, cfg.heldout_set.max_tokens, cfg.heldout_set.answer_tokens)


def trainer_rule(cfg: DumpJob) -> Callable[[str], bool]:
    """The trainer's held-out rule (conf/heldout_split) on sample ids."""
    return held_out_by(cfg.heldout_split.heldout_fraction, cfg.heldout_split.heldout_seed, cfg.data.format)


def dump_heldout_of(cfg: DumpJob) -> DumpHeldout:
    """Which samples the dump holds out (written to held-out shards): the trainer's rule, and the
    conversations read past max_samples for the held-out set. It reads the input through, so that
    under on_error=raise a bad record (malformed, or a duplicate id) fails the dump before an engine
    starts rather than hours into it."""
    return dump_heldout(cfg.data, cfg.split, trainer_rule(cfg), heldout_set_of(cfg))


def tokenize_batch(writer: StoreWriter, tokenizer: PreTrainedTokenizerBase, batch: list[Conversation],
                   cfg: DumpJob, rejections: Rejections, done: AbstractSet[str] = frozenset(),
                   heldout: Callable[[str], bool] | None = None) -> list[TokenizedSample]:
    """The batch's samples under cfg.max_len and cfg.over_long, the held-out ones (`heldout`) cut to
    cfg.heldout_set.max_tokens; the others are rejected (those `done` were, by the run that
    recorded them)."""
    samples: list[TokenizedSample] = []
    for conv in batch:
        held = heldout is not None and heldout(conv.id)
        max_len = min(cfg.max_len, cfg.heldout_set.max_tokens) if held else cfg.max_len
        try:
            samples.append(tokenize_conversation(tokenizer, conv, max_len, "truncate" if held else cfg.over_long))
        except SampleRejected as err:
            if conv.id in done:
                continue
            # Recorded in the store, so a resumed run skips it and forms the same batches.
            writer.reject(err.rejection)
            rejections.note(err.rejection)
    return samples


def capture_round(writer: StoreWriter, capture: HiddenStateCapture, samples: list[TokenizedSample],
                  max_batch_tokens: int, rejections: Rejections, done: AbstractSet[str]) -> Iterator[int]:
    """Capture one round's samples in engine calls of at most max_batch_tokens tokens; yields the
    tokens each call added. Calls whose samples are all `done` are skipped; the others run whole."""
    for call in token_batches([len(s.input_ids) for s in samples], max_batch_tokens):
        batch = [samples[i] for i in call]
        if all(s.id in done for s in batch):
            continue
        yield write_batch(writer, capture, batch, rejections, done)
        failpoint("dump.batch.done")


def samples_of_round(batch: list[Conversation], cfg: DumpJob, heldout: Callable[[str], bool]) -> list[Conversation]:
    """The samples a round of `batch` writes: its conversations, and their sampled copies where
    the verifier regenerates them (dump/regenerate.py)."""
    return with_sampled_copies(batch, cfg.regenerate, heldout) if cfg.regenerate.enabled else batch


def generation_engine(cfg: DumpJob, verifier: Verifier, llm):
    """The engine that decodes the answers: `llm` (the capture engine) where regenerate.dtype
    resolves to the engine's dtype, else a second engine on the verifier in that dtype."""
    dtype = decode_dtype(cfg.regenerate.dtype, cfg.engine.dtype, vllm_on_cpu())
    if dtype == cfg.engine.dtype:
        return llm
    engine = OmegaConf.merge(cfg.engine, {"dtype": dtype})
    # Greedy answers carry no random generator: their engine is left as vLLM sets it up.
    samples = cfg.regenerate.temperature > 0 or cfg.regenerate.sampled_share > 0
    sampling = sampling_engine_kwargs() if samples else {}
    return make_llm(verifier.path, engine, trust_remote_code=cfg.verifier.trust_remote_code,
                    max_model_len=cfg.max_len + 1, **sampling)


def run_dump(cfg: DumpJob, llm=None) -> dict[str, Any]:
    """Dump this rank's share of the configured data; resumes whatever an earlier run left.

    `llm`: an engine already running on the verifier (tests share one); else one is started
    from cfg.engine and shut down at the end. The input is read through first (which samples are
    held out), so under data.on_error=raise a bad record stops the dump before anything is started
    or written.
    """
    heldout, heldout_set = dump_heldout_of(cfg), heldout_set_of(cfg)
    verifier = Verifier.from_conf(cfg.verifier)
    tokenizer = verifier.tokenizer()
    writer = open_writer(cfg.output_dir, cfg.verifier, cfg.store, OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
                         cfg.rank, cfg.world_size, heldout)
    done = writer.done_sample_ids()
    read_stats = ReadStats()
    # Done conversations stay in the stream: rounds and calls are cut as an uninterrupted run cut them.
    owned = (c for c in conversations_of(cfg, read_stats) if writer.owns(c.id))

    spec = capture_spec(verifier)
    own_engine = llm is None
    decoder = None                       # the generation engine, started at the first round that decodes
    rejections = Rejections()
    tokens = 0
    start = time.time()
    bar = tqdm(desc=f"dump rank {writer.rank}", unit="sample", dynamic_ncols=True)
    try:
        # On an error the writer leaves the store as a crash would (committed shards kept, the
        # rest redone by a resumed run) and lets go of the rank's lock, so that a retry in this
        # process can open it again.
        with writer:
            if own_engine:
                llm = start_capture_engine(verifier.path, cfg.engine, spec, cfg.max_len,
                                           trust_remote_code=cfg.verifier.trust_remote_code)
            capture = HiddenStateCapture(llm, spec)
            for batch in batched(owned, cfg.batch_size):
                todo = sum(c.id not in done for c in batch)
                # A round is redone while any of its samples is missing, sampled copies included.
                if not any(c.id not in done for c in samples_of_round(batch, cfg, heldout)):
                    continue
                if cfg.regenerate.enabled:  # the whole round: the company its answers were decoded in
                    decoder = decoder or generation_engine(cfg, verifier, llm)
                    batch = regenerate(decoder, tokenizer, batch, cfg.regenerate,
                                       cfg.verifier.end_of_turn, cfg.max_len, heldout, heldout_set)
                samples = tokenize_batch(writer, tokenizer, batch, cfg, rejections, done, heldout)
                for added in capture_round(writer, capture, samples, cfg.capture.max_batch_tokens,
                                           rejections, done):
                    tokens += added
                    elapsed = time.time() - start
                    bar.set_postfix(tok_s=f"{tokens / elapsed:.0f}",
                                    B_tok=f"{writer.bytes_per_token():.0f}" if writer.stats.tokens else "-")
                bar.update(todo)
            writer.close(done=True)          # the rank's whole share: a following trainer may end
    finally:
        bar.close()
        if decoder is not None and decoder is not llm:
            shutdown_llm(decoder)
        if own_engine and llm is not None:
            shutdown_llm(llm)
    elapsed = time.time() - start
    summary = {
        "store": str(writer.path),
        "rank": writer.rank,
        "world_size": writer.world_size,
        "samples_written": writer.stats.samples,
        "tokens_written": writer.stats.tokens,
        "shards_written": writer.stats.shards,
        "samples_already_done": len(done),
        **rejections.summary(),
        **input_summary(read_stats),
        "wall_s": elapsed,
        "tokens_per_s": tokens / elapsed if elapsed else 0.0,
        "bytes_per_token": writer.bytes_per_token() if writer.stats.tokens else None,
        "waited_for_room_s": writer.stats.waited_s,
    }
    out = Path(writer.path) / "summaries" / f"rank-{writer.rank:05d}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def input_summary(stats: ReadStats) -> dict[str, Any]:
    """The summary's account of the input: what was read, what was skipped and why, and where
    (every rank reads the whole input, so each rank's summary tells the same)."""
    return {
        "reader": stats.summary(),
        "records_read": stats.read,
        "records_skipped": stats.skipped,
        "skipped_by_reason": dict(stats.reasons.most_common()),
        "skipped_records": [{"file": e.path.name, "line": e.line, "sample": e.sample_id,
                             "reason": e.reason, "detail": e.detail} for e in stats.errors],
    }
