"""One training run: store -> packed rows -> DeepSpeed steps -> evaluation -> exported draft.

    fit(cfg, run_dir) -> summary dict (also written to <run dir>/summary.json)

The run folder (Hydra's output dir; rank 0's, shared with every rank) is a RunFolder: its layout
(metrics, checkpoints, draft config, vocabulary, export, summary) is train/run_folder.py's.

What the run cannot finish is refused before the first step (`prepare`: a store of another draft,
a store with no training sample, batch settings below 1). A store with no held-out sample trains
and exports without the held-out evaluation (train/batches.py check_split_sizes says why). The
final evaluation runs after the export, so nothing it meets can leave a trained run without its
draft. Every `*_every` setting of 0 means "at the end only".
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from config.stages import TrainJob
from infra import failpoint, process_memory_bytes, resolve
from model.batch import Batch
from model.card import write_card
from model.checkpoint import draft_config_for_run, draft_config_json, export_draft, init_from_draft
from model.draft import DraftConfig, build_draft
from model.verifier_init import init_from_verifier_layer
from model.compatibility import check_compatible
from model.verifier_handle import Verifier
from model.vocab import build_draft_vocab, count_tokens
from store import STORE_META
from train.batches import (PackedRows, StoreSplit, check_split_sizes, iterate_token_masks,
                           make_loader, rank_rows, store_keeps_topk)
from train.checkpoints import load_checkpoint
from train.deepspeed_setup import initialize, precision_of, zero_stage
from train.distributed import all_reduce_sum, broadcast_object, check_finite, init_distributed, on_rank0
from train.export import draft_from_state, gathered_draft_state, training_facts
from train.follow import (FollowSchedule, Segment, check_follow_split, follow_summary, residence,
                          wait_for_store, whole_store)
from train.heldout import HeldoutResult, evaluate
from train.metrics import RunLog, step_metrics
from train.objective import Eagle3Objective, ObjectiveConfig, StepStats
from train.run_folder import RunFolder
from train.sequence_parallel import SequenceParallel, init_sequence_parallel

logger = logging.getLogger(__name__)


@dataclass
class RunSetup:
    """What the loop needs, built in an order that refuses a bad store before any compute."""

    draft_cfg: DraftConfig
    split: StoreSplit
    verifier: Verifier          # read once per process: model/verifier_handle.py
    d2t: torch.Tensor | None
    total_steps: int | None     # None: following a dump (train.follow), the length is not known yet
    rows_per_step: int
    topk: bool = False          # the store keeps top-k targets, not final states: no verifier head


def _objective_config(cfg: TrainJob, steps: int | None = None) -> ObjectiveConfig:
    loss = cfg.train.loss
    return ObjectiveConfig(steps=int(steps or cfg.train.ttt.steps), decay=cfg.train.ttt.decay,
                           chunk_bytes=loss.chunk_bytes, target_topk=loss.target_topk,
                           target_cache_bytes=loss.target_cache_bytes,
                           acceptance=loss.acceptance, acceptance_weight=loss.acceptance_weight,
                           recompute=cfg.train.recompute, aux_noise=cfg.train.aux_noise)


def _pruned_vocab(cfg: DraftConfig, split: StoreSplit, run_dir: Path, verifier: Verifier) -> torch.Tensor:
    """d2t of the draft vocabulary: the most frequent loss-masked tokens of the training split.

    Rank 0 counts and writes <run dir>/vocab.safetensors; a resumed run reads it back."""
    path = RunFolder(run_dir).vocab
    if dist.get_rank() == 0 and not path.exists():
        counts = torch.zeros(cfg.vocab_size, dtype=torch.long)
        for ids, mask in iterate_token_masks(split.reader, split.train):
            counts += count_tokens(ids, mask, cfg.vocab_size)
        d2t, _ = build_draft_vocab(counts, cfg.draft_vocab_size, always_include=verifier.eos_token_ids)
        save_file({"d2t": d2t}, str(path))
    dist.barrier()
    return load_file(str(path))["d2t"]


def _due(every: int | None, done: int, total: int | None) -> bool:
    """Whether a periodic action (log, checkpoint) runs after step `done`: every `every` steps and
    at the last one; every 0 or null: at the last one only."""
    return done == total or (bool(every) and done % int(every) == 0)


def prepare(cfg: TrainJob, run_dir: Path, world_size: int) -> RunSetup:
    verifier = Verifier.from_conf(cfg.verifier)
    # With train.init_from the draft takes the folder's switches where cfg.draft leaves them null
    # (also when resuming: the run was built so).
    init_from = cfg.train.init_from
    draft_cfg = draft_config_for_run(cfg.draft, verifier, resolve(init_from) if init_from else None)
    t = cfg.train
    if t.follow:
        wait_for_store(resolve(cfg.store_dir), t.follow_poll_s, lambda path: (path / STORE_META).exists())
    split = StoreSplit.open(resolve(cfg.store_dir), cfg.eval.heldout_fraction, cfg.eval.heldout_seed)
    split = split.with_train_fraction(t.train_fraction)
    # Before any compute: the store, the draft and the verifier folder, every disagreement at once.
    check_compatible(verifier=verifier, draft=draft_cfg, store=split.reader, aux_capture=cfg.draft.aux_capture)
    rows_per_step = t.micro_batch * t.grad_accum * world_size
    if t.follow:
        _check_follow(cfg, split, draft_cfg)
        total = t.steps
    else:
        sizes = split.sizes(t.max_len, cfg.seed, rows_per_step, world_size)
        for warning in check_split_sizes(sizes, cfg.eval.heldout_fraction, t.max_len):
            if dist.get_rank() == 0:
                logger.warning("%s", warning)
        total = t.steps if t.steps is not None else math.ceil(t.epochs * sizes.epoch_rows / rows_per_step)
    d2t = _pruned_vocab(draft_cfg, split, run_dir, verifier) if draft_cfg.pruned else None
    if dist.get_rank() == 0:
        RunFolder(run_dir).draft_config.write_text(json.dumps(draft_config_json(draft_cfg), indent=2) + "\n")
    return RunSetup(draft_cfg, split, verifier, d2t, total, rows_per_step, store_keeps_topk(split.reader))


def _check_follow(cfg: TrainJob, split: StoreSplit, draft_cfg: DraftConfig) -> None:
    """What a run that follows a dump cannot do, refused before compute."""
    problems = []
    if draft_cfg.pruned:
        problems.append(f"draft.draft_vocab_size={draft_cfg.draft_vocab_size} counts the tokens of the whole "
                        "training split, which a followed store does not hold yet (use the full vocabulary, or "
                        "train.init_from a draft with its vocabulary)")
    if cfg.train.train_fraction != 1:
        problems.append(f"train.train_fraction={cfg.train.train_fraction} picks from the whole training split")
    try:
        residence(cfg.train.epochs)
    except ValueError as bad:
        problems.append(str(bad))
    if problems:
        raise ValueError("cannot train with train.follow=true: " + "; ".join(problems))
    check_follow_split(split.reader, (cfg.eval.heldout_fraction, cfg.eval.heldout_seed))


def build_objective(setup: RunSetup, cfg: TrainJob, resuming: bool = False) -> Eagle3Objective:
    torch.manual_seed(cfg.seed)                          # same initial draft on every rank
    # The verifier's [V, H] tensors in the trained dtype, mapped from its files where they are
    # stored so (model/verifier_weights.py): the ranks of one machine share them, and a frozen
    # full-vocabulary lm_head is the draft's and the targets' at once (no fp32 copy of either).
    head = setup.verifier.head(torch.bfloat16 if precision_of(cfg.train.precision) == "bf16" else torch.float32)
    draft = build_draft(setup.draft_cfg, head=head, d2t=setup.d2t)
    init_from = cfg.train.init_from
    if init_from and resuming:
        logger.info("train.init_from=%s ignored: the run resumes from its own checkpoint", init_from)
    elif init_from:
        init_from_draft(draft, resolve(init_from))            # refuses a folder that is another draft
        logger.info("draft initialised from %s", resolve(init_from))
    elif cfg.train.init_from_verifier is not None and not resuming:
        init_from_verifier_layer(draft, setup.verifier.path, cfg.train.init_from_verifier)
        logger.info("draft layer initialised from verifier layer %d", cfg.train.init_from_verifier)
    # [V, H]: the draft's own lm_head where it is the verifier's; a top-k store's loss reads none.
    shared = draft.lm_head.weight is head.lm_head
    target_head = None if setup.topk else (draft.lm_head.weight if shared else head.lm_head)
    setup.verifier.release_tensors()                          # the draft and the objective hold them
    return Eagle3Objective(draft, target_head, _objective_config(cfg))


def train_step(engine, batches: Iterator[Batch], grad_accum: int, steps: int,
               step: int, last_checkpoint: Path | None,
               sequence: SequenceParallel) -> tuple[torch.Tensor, float, float]:
    """One optimizer step over grad_accum micro-batches: (stats [4, K] summed over ranks,
    mean micro-batch loss over the data-parallel ranks, tokens of all ranks). Stops on a
    non-finite loss. Under sequence parallelism a rank's loss and tokens are its slice's share."""
    device = engine.device
    stats = StepStats.zeros(steps, device)
    sums = torch.zeros(2, dtype=torch.float64, device=device)          # loss, tokens
    scale = sequence.backward_scale(engine)
    for _ in range(grad_accum):
        batch = next(batches).to(device)
        out = engine(batch)
        check_finite(out.loss.detach(), step, last_checkpoint)
        engine.backward(out.loss * scale)
        engine.step()                                                   # optimizer only on the last
        stats += out.stats.stacked().to(device)
        sums += torch.stack((out.loss.detach().double(), sequence.tokens(batch).double()))
    all_reduce_sum(stats)
    all_reduce_sum(sums)
    return stats, sums[0].item() / (grad_accum * sequence.data_world), sums[1].item()


def run_evaluation(engine, setup: RunSetup, cfg: TrainJob, sequence: SequenceParallel) -> HeldoutResult:
    """The held-out metrics; the ranks of a sequence-parallel group evaluate the same rows."""
    plan = setup.split.eval_rows(sequence.data_rank, sequence.data_world)
    rows = PackedRows(setup.split.path, setup.split.heldout, [[i] for i, _ in plan], cfg.train.max_len,
                      cfg.train.loss.last_turn_only)
    loader = make_loader(rows, 1, cfg.train.num_workers, cfg.train.prefetch_factor,
                         cfg.train.pad_multiple * sequence.size, sequence.slicer)
    return evaluate(engine, loader, plan, len(setup.split.heldout), cfg.eval.ttt_steps)


def evaluate_and_log(engine, setup: RunSetup, cfg: TrainJob, rank: int, sequence: SequenceParallel,
                     log: RunLog, step: int, bar: tqdm) -> dict[str, float]:
    """The held-out evaluation after `step`, written to the run log (each sample's sums too) and
    the progress bar."""
    result = run_evaluation(engine, setup, cfg, sequence)
    heldout = result.metrics
    log.write("heldout", step, heldout)
    log.write_samples(step, [ref.sample_id for ref in setup.split.heldout], result.per_sample)
    if rank == 0:
        accs = ", ".join(f"{heldout[f'acc_{k}']:.3f}" for k in range(cfg.eval.ttt_steps))
        bar.write(f"step {step}: held-out accept length {heldout['accept_length']:.3f} (top-1 {accs})")
    return heldout


def export_run(engine, setup: RunSetup, run: RunFolder, dtype: torch.dtype) -> str | None:
    """The run's draft folder through model.checkpoint.export_draft (rank 0; a collective under ZeRO-3)."""
    state = gathered_draft_state(engine)
    out = None
    if dist.get_rank() == 0:
        draft = draft_from_state(setup.draft_cfg, state, setup.d2t)
        out = str(export_draft(draft, run.export_dir, dtype, verifier=setup.verifier))
    dist.barrier()
    return out


def follow_schedule(cfg: TrainJob, run: RunFolder, setup: RunSetup, rank: int) -> FollowSchedule:
    t = cfg.train
    return FollowSchedule(setup.split.path, run.follow, window=t.follow_window, poll_s=t.follow_poll_s,
                          epochs=t.epochs, max_len=t.max_len, seed=cfg.seed, rows_per_step=setup.rows_per_step,
                          heldout=(cfg.eval.heldout_fraction, cfg.eval.heldout_seed), rank=rank)


class WholeStore:
    """The segments of a run on a finished store: one, evaluated as it trains."""

    evaluates_while_training = True

    def __init__(self, setup: RunSetup, cfg: TrainJob) -> None:
        self.setup, self.cfg = setup, cfg

    def segments(self, start: int) -> Iterator[Segment]:
        return whole_store(self.setup.split.train, self.setup.split.train_stream(self.cfg.train.max_len, self.cfg.seed),
                           self.setup.total_steps)

    def segment_done(self, trainer: Trainer, segment: Segment) -> None:
        pass

    def final_setup(self, trainer: Trainer) -> tuple[RunSetup, int | None]:
        return self.setup, self.setup.total_steps

    def summary(self) -> dict[str, Any] | None:
        return None


class FollowedStore(WholeStore):
    """The windows of a store a dump still writes (train/follow.py): each ends with a durable
    checkpoint, after which the shards it finished retire; the held-out set grows with the store,
    so it is evaluated once, at the end, on the whole store's."""

    evaluates_while_training = False

    def __init__(self, setup: RunSetup, cfg: TrainJob, schedule: FollowSchedule, start: int) -> None:
        super().__init__(setup, cfg)
        self.schedule = schedule
        schedule.retire_through(start)        # a run killed between its checkpoint and the retirement

    def segments(self, start: int) -> Iterator[Segment]:
        return self.schedule.segments(start)

    def segment_done(self, trainer: Trainer, segment: Segment) -> None:
        if trainer.saved != segment.end:      # the window's shards go only once a checkpoint is past them
            trainer.checkpoint(segment.end)
        failpoint("train.window.checkpointed")
        self.schedule.retire_through(segment.end)

    def final_setup(self, trainer: Trainer) -> tuple[RunSetup, int | None]:
        split = StoreSplit.open(self.setup.split.path, self.cfg.eval.heldout_fraction, self.cfg.eval.heldout_seed)
        return dataclasses.replace(self.setup, split=split), trainer.done

    def summary(self) -> dict[str, Any] | None:
        return follow_summary(self.schedule)


@dataclass
class Trainer:
    """A run's engine and what its steps so far left (the step reached, the newest checkpoint,
    the counters of the summary)."""

    cfg: TrainJob
    run: RunFolder
    setup: RunSetup
    engine: Any
    sequence: SequenceParallel
    rank: int
    log: RunLog
    bar: tqdm
    start: int
    last_ckpt: Path | None
    total: int | None               # None while following: only the dump knows
    done: int = 0
    saved: int = 0
    loss: float = math.nan
    tokens: float = 0.0
    seconds: float = 0.0
    heldout: dict[str, float] = dataclasses.field(default_factory=dict)

    def train_segment(self, segment: Segment, evaluating: bool) -> None:
        t = self.cfg.train
        first = max(self.start, segment.first_step)
        plan = rank_rows(segment.stream, first - segment.first_step, segment.steps, t.micro_batch, t.grad_accum,
                         self.sequence.data_rank, self.sequence.data_world)
        rows = PackedRows(self.setup.split.path, segment.refs, [r for _, r in plan], t.max_len, t.loss.last_turn_only)
        batches = iter(make_loader(rows, t.micro_batch, t.num_workers, t.prefetch_factor,
                                   t.pad_multiple * self.sequence.size, self.sequence.slicer))
        for step in range(first, segment.end):
            record = self.step(batches, step)
            record["epoch"] = plan[(self.done - first) * t.grad_accum * t.micro_batch - 1][0]
            record["segment"] = segment.index
            if _due(t.log_every, self.done, self.total):
                self.log.write("train", self.done, record)
            self.bar.update(1)
            failpoint("train.step.done")
            self.bar.set_postfix(loss=f"{self.loss:.3f}", acc0=f"{record['acc_0']:.3f}",
                                 tok_s=f"{record['tokens_per_s']:.0f}")
            if _due(t.checkpoint_every, self.done, self.total):
                self.checkpoint(self.done)
            if evaluating and self.done < self.total and _due(self.cfg.eval.every, self.done, self.total):
                self.evaluate(self.done)

    def step(self, batches: Iterator[Batch], step: int) -> dict[str, Any]:
        """One optimizer step; its record for the run log."""
        lr = self.engine.get_lr()[0]                                    # the lr this step applies
        began = time.perf_counter()
        stats, self.loss, tokens = train_step(self.engine, batches, self.cfg.train.grad_accum,
                                              self.cfg.train.ttt.steps, step, self.last_ckpt, self.sequence)
        elapsed = time.perf_counter() - began
        self.tokens, self.seconds, self.done = self.tokens + tokens, self.seconds + elapsed, step + 1
        grad_norm = self.engine.get_global_grad_norm()
        return {"loss": self.loss, **step_metrics(stats), "lr": lr,
                "grad_norm": None if grad_norm is None else float(grad_norm),
                "tokens": tokens, "tokens_per_s": tokens / elapsed,
                # This process's resident memory now and at its peak (DataLoader workers apart).
                "rss_bytes": process_memory_bytes("VmRSS"), "peak_rss_bytes": process_memory_bytes("VmHWM")}

    def checkpoint(self, step: int) -> None:
        self.last_ckpt = self.run.save_checkpoint(self.engine, step, self.cfg.train.keep_checkpoints,
                                                  {"loss": self.loss}, self.setup.verifier.path)
        self.saved = step

    def evaluate(self, step: int) -> None:
        self.heldout = evaluate_and_log(self.engine, self.setup, self.cfg, self.rank, self.sequence, self.log,
                                        step, self.bar)


def start_trainer(cfg: TrainJob, run_dir: Path) -> Trainer:
    """The run's folder, setup and engine, resumed from its checkpoint where there is one."""
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    rank, _ = init_distributed()
    # Before any compute: a size the ranks or the heads do not split by is refused here.
    sequence = init_sequence_parallel(cfg.train.sequence_parallel, cfg.draft.num_attention_heads,
                                      max(cfg.train.ttt.steps, cfg.eval.ttt_steps))
    run = RunFolder(Path(broadcast_object(str(Path(run_dir).resolve()))))    # rank 0's folder for all
    run.root.mkdir(parents=True, exist_ok=True)
    setup = prepare(cfg, run.root, sequence.data_world)
    resume_from = on_rank0(lambda: run.resolve_resume(cfg.train.resume))
    objective = build_objective(setup, cfg, resuming=resume_from is not None)
    objective.split_rows(sequence)
    engine = initialize(objective, cfg, setup.total_steps, sequence.mpu())
    sequence.backward_scale(engine)                   # refuses a ZeRO setting it cannot reduce right
    start = load_checkpoint(engine, resume_from) if resume_from else 0
    if resume_from:
        logger.info("resumed from %s at step %d", resume_from, start)
    log = RunLog(run.metrics, run.tensorboard, rank == 0, start, run.heldout_samples)
    bar = tqdm(total=setup.total_steps, initial=start, desc="train", unit="step", dynamic_ncols=True,
               disable=rank != 0)
    return Trainer(cfg, run, setup, engine, sequence, rank, log, bar, start, resume_from, setup.total_steps,
                   done=start, saved=start)


def fit(cfg: TrainJob, run_dir: Path) -> dict[str, Any]:
    """Train (or resume) one run into run_dir; returns the summary."""
    trainer = start_trainer(cfg, run_dir)
    setup, resumed_from = trainer.setup, trainer.last_ckpt
    source = (FollowedStore(setup, cfg, follow_schedule(cfg, trainer.run, setup, trainer.rank), trainer.start)
              if cfg.train.follow else WholeStore(setup, cfg))
    try:
        # None held out: skipped (prepare warned).
        evaluating = bool(setup.split.heldout) and source.evaluates_while_training
        for segment in source.segments(trainer.start):
            trainer.train_segment(segment, evaluating)
            source.segment_done(trainer, segment)
        trainer.setup, trainer.total = source.final_setup(trainer)
        # The final evaluation (also of a resumed run that had already finished) after the export:
        # whatever it meets, the trained draft is on disk.
        exported = (export_run(trainer.engine, trainer.setup, trainer.run, getattr(torch, cfg.train.export_dtype))
                    if cfg.train.export else None)
        if trainer.setup.split.heldout:
            trainer.evaluate(max(trainer.start, trainer.total))
    finally:
        trainer.bar.close()
        trainer.log.close()
    summary = {"run_dir": str(trainer.run.root), "rank": trainer.rank, "world_size": dist.get_world_size(),
               "sequence_parallel": trainer.sequence.size, "steps": trainer.total, "follow": source.summary(),
               "resumed_from": str(resumed_from) if resumed_from else None, "zero_stage": zero_stage(trainer.engine),
               "precision": precision_of(cfg.train.precision),
               "peak_lr": trainer.engine.lr_scheduler.base_lrs[0],   # train.lr, or its peak_lr for the run's length
               "train_tokens_per_s": trainer.tokens / trainer.seconds if trainer.seconds else None,
               "heldout": trainer.heldout, "exported": exported,
               "last_checkpoint": str(trainer.last_ckpt) if trainer.last_ckpt else None,
               "config": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)}
    if trainer.rank == 0:
        trainer.run.write_summary(summary)
        if exported:
            training_facts(cfg, summary).write(Path(exported))
            write_card(Path(exported), cfg.verifier.name, cfg.verifier.path, cfg.verifier.serving_tp,
                       cfg.verifier.serving_pp)
    trainer.engine.destroy()
    return summary
