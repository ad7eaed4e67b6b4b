"""`python -m train [hydra overrides]` trains a draft; `python -m train export <checkpoint> [out]`
exports any DeepSpeed checkpoint of a run as a vLLM draft folder; `python -m train plan [hydra
overrides] [plan.world_size=N] [--json FILE]` prints the per-rank memory plan (train/plan.py);
`python -m train verify-checkpoint <checkpoint>` checks its files against complete.json.

    python -m train                                      kimi-tiny on `make dump`'s store
    python -m train train.steps=50 deepspeed=zero3       any value of conf/train.yaml
    python -m train -m train.ttt.steps=1,4               a Hydra sweep (one run per value)
    python -m train hydra.run.dir=<run> train.resume=auto  continue a killed run from its newest checkpoint
    torchrun --standalone --nproc_per_node 2 -m train    two ranks (see train/distributed.py for more)

Exit status 2: refused before the first step: a store of another draft, or one with no training
sample (the message names the store, its counts and the setting to change).
Exit status 3: the loss became NaN/Inf (the message names the last good checkpoint).
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig

import config
import infra
from config.stages import TrainJob

infra.configure_environment()  # offline hubs, caches in the repo: before transformers loads
config.register()              # the schemas conf/train.yaml is merged onto

logger = logging.getLogger("train")


@hydra.main(version_base=None, config_path=str(infra.CONF_DIR), config_name="train")
def train_main(cfg: TrainJob) -> None:
    config.check_entry(cfg, "python -m train")
    from store import StoreMismatchError
    from train.batches import SplitTooSmallError
    from train.distributed import NonFiniteLossError
    from train.loop import fit

    try:
        summary = fit(cfg, Path(HydraConfig.get().runtime.output_dir))
    except (StoreMismatchError, SplitTooSmallError) as error:
        logger.error("%s", error)
        print(f"train refused: {error}", file=sys.stderr)
        sys.exit(2)
    except NonFiniteLossError as error:
        logger.error("%s", error)
        print(f"train stopped: {error}", file=sys.stderr)
        sys.exit(3)
    if summary["rank"] != 0:
        return
    speed = summary["train_tokens_per_s"]
    print(f"train done: {summary['steps']} steps, {_heldout_line(summary['heldout'])}, "
          f"{'-' if speed is None else f'{speed:.0f}'} tokens/s; draft {summary['exported']}; "
          f"run {summary['run_dir']}")


def _heldout_line(held: dict[str, float]) -> str:
    if not held:                  # the store held no sample out (train/loop.py skipped it, warning)
        return "no held-out evaluation (no held-out samples)"
    K = sum(1 for key in held if key.startswith("acc_"))
    accs = ", ".join(f"{held[f'acc_{k}']:.3f}" for k in range(K))
    return (f"held-out accept length {held['accept_length']:.3f} (chain replay "
            f"{held['chain_accept_length']:.3f}; top-1 per step {accs})")


def export_main(argv: list[str]) -> int:
    """Export a checkpoint folder without a process group: from the checkpoint alone (its weights,
    the draft config and vocabulary it carries, the verifier its marker names)."""
    import torch

    from model.checkpoint import export_draft, needs_embedding
    from model.verifier_handle import Verifier
    from train.export import consolidated_checkpoint_state, draft_from_state
    from train.run_folder import EXPORT_DIR, checkpoint_draft, find_checkpoint

    parser = argparse.ArgumentParser(prog="python -m train export",
                                     description="Export a training checkpoint as a vLLM draft.")
    parser.add_argument("checkpoint", type=Path, help="a checkpoint folder, or a run folder (newest checkpoint)")
    parser.add_argument("out", type=Path, nargs="?", help="default: <checkpoint>/draft")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--verifier", type=Path, default=None,
                        help="the verifier folder (a Kimi-K3 export ships its embedding); default: the one "
                             "the checkpoint's complete.json names")
    args = parser.parse_args(argv)
    folder = find_checkpoint(args.checkpoint)
    source = checkpoint_draft(folder)
    verifier = args.verifier or source.verifier
    if needs_embedding(source.config.target_model_type) and (verifier is None or not verifier.is_dir()):
        known = f"names the verifier {verifier}, not on this machine" if verifier else "names no verifier"
        print(f"python -m train export: checkpoint {folder} {known}, and a {source.config.target_model_type} "
              "export ships the verifier's embedding: pass --verifier <folder>", file=sys.stderr)
        return 2
    handle = Verifier.open(verifier) if verifier is not None and verifier.is_dir() else None
    draft = draft_from_state(source.config, consolidated_checkpoint_state(folder), source.d2t, handle)
    out = export_draft(draft, args.out or folder / EXPORT_DIR, getattr(torch, args.dtype), verifier=handle)
    print(f"exported {folder} -> {out}")
    return 0


def verify_main(argv: list[str]) -> int:
    """Check a checkpoint folder's files against its complete.json (sizes and sha256)."""
    from train.checkpoints import CheckpointError, verify_checkpoint

    parser = argparse.ArgumentParser(prog="python -m train verify-checkpoint",
                                     description="Verify a training checkpoint's files.")
    parser.add_argument("checkpoint", type=Path, help="a checkpoint folder (<run>/checkpoints/step-N)")
    folder = parser.parse_args(argv).checkpoint
    try:
        marker = verify_checkpoint(folder)
    except CheckpointError as error:
        print(error, file=sys.stderr)
        return 1
    print(f"{folder}: step {marker['step']}, {len(marker['files'])} files verified")
    return 0


if __name__ == "__main__":
    infra.run_subcommand({"verify-checkpoint": verify_main,
                          "export": export_main, "plan": "train.plan:main"}, train_main)
