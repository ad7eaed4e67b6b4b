"""The rules a composed config must satisfy that its types cannot say: a bound, an either/or between
two keys, a setting that only some others allow. (A choice among names is a type:
config/choices.py, refused by OmegaConf at composition.) `config.check` runs them beside the unknown-key check, at composition
and in every entry point before any work, so a setting that would stop a run at its first step, or
after its engine has started and its verifier head is loaded, is refused at once, every key at
fault named in one message.
"""
from __future__ import annotations

import math
from typing import Any

from omegaconf import DictConfig

from config.choices import Acceptance, names



def problems(cfg: DictConfig) -> list[str]:
    """Every rule a stage's config breaks (dump, train and plan, eval: by the keys it holds)."""
    found: list[str] = []
    if "verifier" in cfg:
        # dump and eval capture the aux states: the engine walks the layers in order.
        found += aux_problems(cfg.verifier, ascending="regenerate" in cfg or "draft_sample" in cfg)
    if "regenerate" in cfg:
        found += dump_problems(cfg)
    if "train" in cfg:
        found += train_problems(cfg)
    if "draft_sample" in cfg:
        found += eval_problems(cfg)
    return found


def aux_problems(verifier: DictConfig, ascending: bool) -> list[str]:
    """verifier.aux_layer_ids against the layer count the config states (architecture), so that a
    run, and `python -m dump plan` (which reads no folder), is refused before any engine starts or
    folder is read; Verifier.from_conf converts them later against the folder's own count
    (model/aux_ids.py: vLLM ids 0..N, the state entering layer k; SGLang ids 0..N-1, its output).
    ascending: the capture's rule (dump/capture.py CaptureSpec), for the stages that capture."""
    ids, convention = list(verifier.aux_layer_ids), verifier.aux_convention
    found = []
    if "num_hidden_layers" in verifier.architecture:
        layers = verifier.architecture.num_hidden_layers
        top = layers if convention == "vllm" else layers - 1
        if any(not 0 <= i <= top for i in ids):
            found.append(f"verifier.aux_layer_ids={ids} ({convention} convention: ids 0..{top} of the "
                         f"verifier's {layers} layers, verifier.architecture.num_hidden_layers)")
    if ascending and ids != sorted(set(ids)):
        found.append(f"verifier.aux_layer_ids={ids} (distinct and ascending: the capture keeps vLLM's order)")
    return found


def dump_problems(cfg: DictConfig) -> list[str]:
    r = cfg.regenerate
    found = _at_least(cfg, {"max_len": 1, "batch_size": 1}) + _at_least(cfg.capture, {"max_batch_tokens": 1}, "capture.")
    found += _at_least(cfg.heldout_set, {"conversations": 0, "max_tokens": 1, "answer_tokens": 1}, "heldout_set.")
    if r.enabled:
        found += _at_least(r, {"max_tokens": 1}, "regenerate.")
        if not (math.isfinite(r.temperature) and r.temperature >= 0):
            found.append(f"regenerate.temperature={r.temperature} (0 for greedy, else > 0)")
        if not 0 <= r.sampled_share <= 1:
            found.append(f"regenerate.sampled_share={r.sampled_share} (in [0, 1])")
        if r.sampled_share > 0 and not (math.isfinite(r.sampled_temperature) and r.sampled_temperature > 0):
            found.append(f"regenerate.sampled_temperature={r.sampled_temperature} (> 0 where sampled_share > 0)")
        if not 0 < r.top_p <= 1:
            found.append(f"regenerate.top_p={r.top_p} (in (0, 1])")
    return found


def train_problems(cfg: DictConfig) -> list[str]:
    t, loss = cfg.train, cfg.train.loss
    found = _at_least(t, {"micro_batch": 1, "grad_accum": 1, "max_len": 1, "follow_window": 1,
                           "pad_multiple": 1, "sequence_parallel": 1}, "train.")
    found += _at_least(t, {"log_every": 0, "checkpoint_every": 0, "num_workers": 0}, "train.")
    found += _at_least(cfg.eval, {"every": 0}, "eval.")
    found += _at_least(t.ttt, {"steps": 1}, "train.ttt.")
    if not (math.isfinite(t.aux_noise) and t.aux_noise >= 0):
        found.append(f"train.aux_noise={t.aux_noise} (a finite scale >= 0; 0: no noise)")
    if t.init_from_verifier is not None and t.init_from_verifier < 0:
        found.append(f"train.init_from_verifier={t.init_from_verifier} (a verifier layer id, or null)")
    if t.steps is not None and t.steps < 0:
        found.append(f"train.steps={t.steps} (0 or more; null: train.epochs passes)")
    found += warmup_problems(t.warmup_steps, t.warmup_ratio)
    if t.lr_tuned_steps is not None and t.lr_tuned_steps < 1:
        found.append(f"train.lr_tuned_steps={t.lr_tuned_steps} (a number of steps, or null)")
    if not 0.0 < t.train_fraction <= 1.0:
        found.append(f"train.train_fraction={t.train_fraction} (in (0, 1])")
    found += acceptance_problems(loss.acceptance, loss.acceptance_weight, loss.target_topk, "train.loss.")
    return found


def warmup_problems(steps: int | None, ratio: float | None) -> list[str]:
    """train.warmup_steps or train.warmup_ratio, exactly one (also train/deepspeed_setup.py's
    warmup_steps_of, for a config built by hand)."""
    if (steps is None) == (ratio is None):
        return [f"train.warmup_steps={steps} and train.warmup_ratio={ratio}: set exactly one, the other null"]
    if ratio is not None and not 0.0 <= ratio <= 1.0:
        return [f"train.warmup_ratio={ratio} (a fraction in [0, 1])"]
    if steps is not None and steps < 0:
        return [f"train.warmup_steps={steps} (0 or more)"]
    return []


def acceptance_problems(kind: str | None, weight: float, target_topk: int | None, prefix: str = "") -> list[str]:
    """The acceptance term's settings (also train/objective.py's ObjectiveConfig, built by hand in
    tests and tools): a known kind, a finite weight >= 0, and the whole distribution to act on."""
    found = []
    if kind is not None and kind not in names(Acceptance):
        found.append(f"{prefix}acceptance={kind!r} (one of {', '.join(names(Acceptance))}, or null)")
    if not (math.isfinite(weight) and weight >= 0):
        found.append(f"{prefix}acceptance_weight={weight} (a finite weight >= 0)")
    if kind is not None and target_topk:
        found.append(f"{prefix}acceptance={kind!r} with {prefix}target_topk={target_topk}: the acceptance "
                     "sum_v min(p, q) needs the verifier's whole distribution, which top-k targets do not keep")
    return found


def eval_problems(cfg: DictConfig) -> list[str]:
    found = _at_least(cfg, {"num_speculative_tokens": 1, "num_prompts": 1, "max_tokens": 1, "max_len": 1})
    return found


def _at_least(node: DictConfig, floors: dict[str, Any], prefix: str = "") -> list[str]:
    return [f"{prefix}{key}={node[key]} (at least {floor})" for key, floor in floors.items()
            if node[key] is not None and node[key] < floor]
