"""The steps of a run as segments of the store: the whole store at once, or, following a dump that
is still writing it (train.follow), windows of its committed shards that retire once trained.

Segment. A run's optimizer steps are a sequence of segments; a segment is the training samples of
some shards, packed into rows epoch after epoch (train/batches.py RowStream: epoch e shuffled
with (seed, e)) and trained for ceil(epochs x rows of one epoch / rows per step) steps. Without
follow mode there is one segment, the whole store: the run train/batches.py describes.

Windows (train.follow). Rank 0 takes the store's committed training shards (manifest entries not
marked `heldout`; the dump writes held-out samples to shards of their own) in the order it first
sees them, sorted by name among those seen in one look, train.follow_window at a time. A window
is decided when it has that many new shards, or when the dump has marked every rank done, or when
a dump writer waits for room under store.max_bytes and the store is still over its bound (the
store is full: what it holds is what there is to train on, or nothing would ever free room).
Each decision is written to <run>/follow.json (sealed JSON, in the run folder every rank shares)
before it is used; the other ranks read it there, polling as rank 0 polls the store, so that no
rank waits inside a collective (whose timeout a slow dump would outlast). All ranks train the same
windows, and a resumed run the same ones again.

Epochs as residence. A shard stays for train.epochs windows (an integer in follow mode): the one
that brought it and the next epochs - 1. Window w trains one pass over every shard it holds, its
new shards and those of the epochs - 1 windows before it, shuffled together with seed
"<seed>/window-<w>". So each training sample is trained train.epochs times, as in a run on the
finished store, and its passes mix with the samples of 2 x epochs - 1 windows of shards, not of
its own window only: training a window's few samples epochs times in a row and moving on fits
each window in turn and forgets the earlier ones (bench/results/follow_designs.json compares the
two with a run on the finished store). Once the dump is done, windows
without new shards train what the last ones brought until every shard has had its passes. The
last step of a window may take rows of the pass's next shuffle (as the whole store's last step
does): at most rows-per-step - 1 rows repeated per window.
The disk then holds epochs windows of shards at once; under a tight store.max_bytes the dump's
writer waits and windows without new shards pass over what the store holds, fewer samples mixed.

Retirement. A shard retires after the last window that reads it: after that window's last step the
run saves a checkpoint (durable: its complete marker written), then rank 0 retires the shards whose
passes are all done (store/progress.py: recorded, then deleted). A resumed run starts at a
checkpoint at or after the last retirement, so it never needs a retired shard; a run resumed from
an older checkpoint by name is refused by the reader, naming the sample.

What follow mode changes: the row order (windows instead of the whole store's epochs), so the
weights equal those of another follow run with the same windows, not those of a dump-then-train
run; with several dump ranks, or a dump still writing, the windows depend on when shards were
committed (which rank 0 saw first), so two uninterrupted runs can differ, while a resumed run
repeats its own recorded windows. The lr: without train.steps the run's length is unknown while
the dump writes, and the lr stays at its peak after warmup; with train.steps the schedule decays
over it.
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from store import SampleRef, StoreReader
from store.progress import blocked_writers, completion, retire_shards
from store.sealed import replace_sealed_json, unseal_json
from train.batches import RowStream, held_out_rule

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Segment:
    """Steps [first_step, first_step + steps) of the run: the rows of `stream` over `refs`."""

    index: int
    first_step: int
    steps: int
    refs: list[SampleRef]
    stream: RowStream

    @property
    def end(self) -> int:
        return self.first_step + self.steps


def residence(epochs: float | None) -> int:
    """The windows a followed shard stays for: train.epochs, a whole number, at least 1 (null: 1)."""
    if epochs is None:
        return 1
    if epochs < 1 or epochs % 1:
        raise ValueError(f"train.epochs={epochs}: following a dump, a shard stays for train.epochs windows, "
                         "a whole number, at least 1 (null: 1)")
    return int(epochs)


def segment_steps(stream: RowStream, epochs: float, rows_per_step: int) -> int:
    return math.ceil(epochs * len(stream.epoch(0)) / rows_per_step)


@dataclass(frozen=True)
class WindowRecord:
    """One decided window as <run>/follow.json keeps it."""

    shards: list[str]            # the training shards it brought
    reads: list[str]             # the shards its pass trains on: its own and those of the windows before it
    first_step: int
    steps: int
    samples: int                 # training samples it reads

    @property
    def end(self) -> int:
        return self.first_step + self.steps


class FollowSchedule:
    """The windows of a followed store (module docstring); `segments(start)` yields them in order,
    waiting for the dump where the next one is not decided yet. Collective: every rank calls it."""

    def __init__(self, store: Path, record: Path, *, window: int, poll_s: float, epochs: float | None,
                 max_len: int, seed: int, rows_per_step: int, heldout: tuple[float, int], rank: int) -> None:
        if window < 1:
            raise ValueError(f"train.follow_window={window}: at least 1 shard per window")
        self.store, self.record, self.window, self.poll_s = store, record, window, poll_s
        self.epochs, self.max_len, self.seed, self.rows_per_step = residence(epochs), max_len, seed, rows_per_step
        self.heldout, self.rank = heldout, rank
        self.windows, _ = self._load()

    # -- the record --------------------------------------------------------------------------------
    def _load(self) -> tuple[list[WindowRecord], bool]:
        """The recorded windows, and whether they are all (the dump done, every shard in one)."""
        if not self.record.exists():
            return [], False
        raw = unseal_json(self.record.read_bytes())
        return [WindowRecord(**w) for w in raw["windows"]], raw["complete"]

    def _save(self, windows: list[WindowRecord], complete: bool) -> None:
        replace_sealed_json(self.record, {"store": str(self.store), "window": self.window, "complete": complete,
                                          "windows": [asdict(w) for w in windows]})

    def _await(self, w: int) -> WindowRecord | None:
        """Ranks other than 0: window w once rank 0 has recorded it; None when there is none."""
        while True:
            windows, complete = self._load() if self.record.exists() else ([], False)
            if len(windows) > w:
                return windows[w]
            if complete:
                return None
            time.sleep(self.poll_s)

    # -- segments ----------------------------------------------------------------------------------
    def segments(self, start: int) -> Iterator[Segment]:
        """The windows whose steps end after `start`, deciding new ones as the dump commits."""
        w = 0
        while True:
            if w == len(self.windows):
                if self.rank == 0:
                    decided = self._decide()
                    # Recorded before any rank trains on it.
                    self._save([*self.windows, *([decided] if decided else [])], complete=decided is None)
                else:
                    decided = self._await(w)
                if decided is None:
                    return
                self.windows.append(decided)
            record = self.windows[w]
            if record.end > start:
                yield self._segment(w, record)
            w += 1

    def retire_through(self, step: int) -> list[str]:
        """Rank 0: retire the shards whose last window (train.epochs - 1 after the one that brought
        them) ends at or before `step` (a checkpoint at `step` is durable). Returns the shards
        newly retired."""
        last = self.epochs - 1
        names = [s for i, r in enumerate(self.windows)
                 if i + last < len(self.windows) and self.windows[i + last].end <= step for s in r.shards]
        if self.rank != 0 or not names:
            return []
        new = retire_shards(self.store, names)
        if new:
            logger.info("retired %d shards of %s (%d samples)", len(new), self.store,
                        sum(len(e.sample_ids) for e in new))
        return [e.name for e in new]

    def _segment(self, w: int, record: WindowRecord) -> Segment:
        reader = StoreReader(self.store)
        gone = sorted(set(record.reads) & set(reader.retired))
        if gone:
            raise ValueError(f"window {w} (steps {record.first_step}-{record.first_step + record.steps}) reads "
                             f"shards {gone} of {self.store}, which were retired after a later checkpoint: resume "
                             "from the newest checkpoint (train.resume=auto), not an earlier one")
        refs = self._training_refs(reader, record.reads)
        stream = RowStream([r.num_tokens for r in refs], self.max_len, f"{self.seed}/window-{w}")
        return Segment(w, record.first_step, record.steps, refs, stream)

    def _training_refs(self, reader: StoreReader, shards: list[str]) -> list[SampleRef]:
        wanted, rule = set(shards), held_out_rule(reader, *self.heldout)
        return [r for r in reader.samples() if r.shard in wanted and not rule(r)]

    def _decide(self) -> WindowRecord | None:
        """Rank 0: the next window, waiting (polling the store) until it is decided; None when the
        dump is done and every training shard has had its train.epochs passes."""
        taken = {s for r in self.windows for s in r.shards}
        w = len(self.windows)
        carried = [s for r in self.windows[max(0, w - self.epochs + 1):] for s in r.shards]
        said = None
        while True:
            done = completion(self.store)          # read before the shards: a done rank has committed all
            reader = StoreReader(self.store)
            new = sorted(e.name for e in reader.shards() if not e.heldout and e.name not in taken)
            ready = len(new) >= self.window or ((new or carried) and (done.complete or blocked_writers(self.store)))
            if ready:
                shards = new[:self.window]
                refs = self._training_refs(reader, carried + shards)
                if shards and not {r.shard for r in refs} & set(shards):
                    taken |= set(shards)       # shards of rejected or held-out samples only: nothing to train
                    continue
                stream = RowStream([r.num_tokens for r in refs], self.max_len, f"{self.seed}/window-{w}")
                first = self.windows[-1].end if self.windows else 0
                record = WindowRecord(shards, carried + shards, first, segment_steps(stream, 1, self.rows_per_step),
                                      len(refs))
                logger.info("window %d: %d new shards, %d held, %d samples, steps %d-%d", w, len(shards),
                            len(record.reads), len(refs), first, record.end)
                return record
            if done.complete:
                return None
            state = (len(new), tuple(sorted(done.done)), done.world_size)
            if state != said:
                logger.info("following %s: %d new training shards of %d per window; dump ranks done: %s of %s",
                            self.store, len(new), self.window, sorted(done.done), done.world_size or "?")
                said = state
            time.sleep(self.poll_s)


def whole_store(refs: list[SampleRef], stream: RowStream, steps: int) -> Iterator[Segment]:
    """The one segment of a run on a finished store."""
    yield Segment(0, 0, steps, refs, stream)


def check_follow_split(reader: StoreReader, heldout: tuple[float, int]) -> None:
    """Refuse a store whose dump wrote held-out shards by another rule than the trainer's split
    (its training shards would hold held-out samples, which retiring them would lose)."""
    dumped = (reader.dump_config.get("heldout_split") or {})
    theirs = (dumped.get("heldout_fraction"), dumped.get("heldout_seed"))
    if theirs != tuple(heldout):
        raise ValueError(f"train.follow: store {reader.path} was dumped with held-out split (fraction, seed) "
                         f"{theirs}, the trainer's eval.heldout_fraction / heldout_seed are {tuple(heldout)}: "
                         "retiring its shards would lose held-out samples; use the dump's split (conf/heldout_split)")


def wait_for_store(store: Path, poll_s: float, ready: Callable[[Path], bool]) -> None:
    """Block until the dump has created the store (its store.json), saying once what it waits for."""
    said = False
    while not ready(store):
        if not said:
            logger.info("following %s: waiting for the dump to create it", store)
            said = True
        time.sleep(poll_s)


def follow_summary(schedule: FollowSchedule) -> dict:
    return {"windows": [asdict(w) for w in schedule.windows], "record": str(schedule.record)}

