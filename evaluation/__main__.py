"""`python -m evaluation draft_dir=<folder> [hydra overrides]` (`make eval DRAFT=<folder>`): the
accept length of an exported draft per category, measured by vLLM and simulated on the verifier's
hidden states (evaluation/run.py, conf/eval.yaml)."""
from __future__ import annotations

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

import config
import infra

infra.configure_environment()  # offline hubs, caches in the repo: before vLLM or transformers load
config.register()              # the schemas conf/eval.yaml is merged onto


@hydra.main(version_base=None, config_path=str(infra.CONF_DIR), config_name="eval")
def main(cfg: DictConfig) -> None:
    config.check_entry(cfg, "python -m evaluation")
    from evaluation.run import evaluate_draft  # imported here: it pulls in transformers

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    out = evaluate_draft(cfg, run_dir)
    print(f"\naccept length of {out['draft_dir']} (topk 1, {out['num_speculative_tokens']} drafts; ceiling "
          f"{out['num_speculative_tokens'] + 1}):\n{out['table']}\nreport: {run_dir / 'eval.json'}")


if __name__ == "__main__":
    main()
