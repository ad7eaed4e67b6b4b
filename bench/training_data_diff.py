"""Whether two stores train on the same data: their training splits (train/batches.py StoreSplit, the
trainer's own split) compared sample by sample, ids, tokens, loss masks and stored states.

A change to what the dump holds out (data/heldout_set.py) should leave the training samples alone;
this says whether it did, and what the held-out sets share.

    python -m bench.training_data_diff STORE_A STORE_B [--heldout-fraction F --heldout-seed S] [--json OUT]

The split's fraction and seed default to the trainer's (conf/train.yaml eval).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from config import compose_config
from data.split import split_key_for
from store import SampleRef
from train.batches import StoreSplit


def same_sample(a: StoreSplit, b: StoreSplit, ref_a: SampleRef, ref_b: SampleRef) -> bool:
    x, y = a.reader.read_sample(ref_a), b.reader.read_sample(ref_b)
    return all(torch.equal(torch.as_tensor(getattr(x, f)), torch.as_tensor(getattr(y, f)))
               for f in ("input_ids", "loss_mask", "aux", "final"))


def training_data_diff(store_a: Path, store_b: Path, fraction: float, seed: int) -> dict[str, Any]:
    a, b = StoreSplit.open(store_a, fraction, seed), StoreSplit.open(store_b, fraction, seed)
    train_a, train_b = {r.sample_id: r for r in a.train}, {r.sample_id: r for r in b.train}
    shared = [i for i in train_a if i in train_b]
    identical = sum(same_sample(a, b, train_a[i], train_b[i]) for i in tqdm(shared, desc="training samples"))
    key = split_key_for((b.reader.dump_config.get("data") or {}).get("format"))
    held_a, held_b = {r.sample_id for r in a.heldout}, {r.sample_id for r in b.heldout}
    return {
        "stores": [str(store_a), str(store_b)],
        "split": {"heldout_fraction": fraction, "heldout_seed": seed},
        "train_samples": [len(a.train), len(b.train)],
        "train_same_order": [r.sample_id for r in a.train] == [r.sample_id for r in b.train],
        "train_shared": len(shared),
        "train_identical": identical,
        "heldout_samples": [len(held_a), len(held_b)],
        "heldout_conversations": [len({key(i) for i in held_a}), len({key(i) for i in held_b})],
        "heldout_tokens": [sum(r.num_tokens for r in a.heldout), sum(r.num_tokens for r in b.heldout)],
        "heldout_shared": len(held_a & held_b),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("store_a", type=Path)
    parser.add_argument("store_b", type=Path)
    parser.add_argument("--heldout-fraction", type=float)
    parser.add_argument("--heldout-seed", type=int)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    trainer = compose_config("train").eval
    fraction = trainer.heldout_fraction if args.heldout_fraction is None else args.heldout_fraction
    seed = trainer.heldout_seed if args.heldout_seed is None else args.heldout_seed
    report = training_data_diff(args.store_a, args.store_b, fraction, seed)
    text = json.dumps(report, indent=2) + "\n"
    if args.json:
        args.json.write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
