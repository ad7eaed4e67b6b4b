"""The types of each stage's whole config: conf/dump.yaml, conf/train.yaml (and conf/plan.yaml, which
composes it), conf/eval.yaml and conf/build_verifier.yaml.

As in config/groups.py, the values and their meaning are in the yaml; a field here has no
default (MISSING to OmegaConf) and only says the key exists and what type it takes. Hydra merges
the yaml onto these classes, so a mistyped value (train.steps=x) or an unknown key fails at
composition, naming the key.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional


from config.choices import Acceptance, DecodeDtype, DraftSample, ExportDtype, OverLong, Precision, Split, Turns
from config.groups import (CaptureConf, DataConf, DeepSpeedConf, DraftConf, EngineConf, SplitConf, StoreConf,
                           VerifierConf)


# ---- conf/dump.yaml --------------------------------------------------------------------------


@dataclass
class RegenerateConf:
    enabled: bool
    turns: Turns
    temperature: float
    sampled_share: float
    sampled_temperature: float
    top_p: float
    max_tokens: int
    seed: int
    dtype: DecodeDtype


@dataclass
class HeldoutSetConf:
    conversations: int
    max_tokens: int
    answer_tokens: int


@dataclass
class DumpJob:
    verifier: VerifierConf
    data: DataConf
    engine: EngineConf
    store: StoreConf
    capture: CaptureConf
    output_dir: str
    split: Split
    max_len: int
    over_long: OverLong
    batch_size: int
    rank: Optional[int]
    world_size: Optional[int]
    regenerate: RegenerateConf
    heldout_split: SplitConf
    heldout_set: HeldoutSetConf


# ---- conf/train.yaml (the recipe group, conf/recipe/<verifier>.yaml, fills part of `train`) ----


@dataclass
class TTTConf:
    steps: int
    decay: float


@dataclass
class LossConf:
    last_turn_only: bool          # from the recipe
    chunk_bytes: int
    target_cache_bytes: int
    target_topk: Optional[int]
    acceptance: Optional[Acceptance]
    acceptance_weight: float


@dataclass
class TrainConf:
    # From the recipe (conf/recipe/<verifier>.yaml).
    max_len: int
    lr: float
    lr_tuned_steps: Optional[int]
    warmup_steps: Optional[int]
    warmup_ratio: Optional[float]
    min_lr_ratio: float
    grad_clip: float
    recompute: bool
    # From conf/train.yaml.
    micro_batch: int
    grad_accum: int
    steps: Optional[int]
    train_fraction: float
    epochs: Optional[float]
    precision: Precision
    betas: List[float]
    eps: float
    weight_decay: float
    head_lr_scale: float
    torch_adam: bool
    ttt: TTTConf
    loss: LossConf
    aux_noise: float
    threads: Optional[int]
    sequence_parallel: int
    follow: bool
    follow_window: int
    follow_poll_s: float
    pad_multiple: int
    num_workers: int
    prefetch_factor: int
    log_every: int
    checkpoint_every: int
    keep_checkpoints: int
    resume: Optional[str]
    init_from: Optional[str]
    init_from_verifier: Optional[int]
    export: bool
    export_dtype: ExportDtype


@dataclass
class HeldoutConf(SplitConf):
    every: int
    ttt_steps: int


@dataclass
class TrainJob:
    verifier: VerifierConf
    draft: DraftConf
    deepspeed: DeepSpeedConf
    store_dir: str
    seed: int
    train: TrainConf
    eval: HeldoutConf


@dataclass
class PlanConf:
    world_size: int
    json: Optional[str]


@dataclass
class PlanJob(TrainJob):
    """conf/plan.yaml: a training config plus the ranks it is planned for (`python -m train plan`)."""

    plan: PlanConf


# ---- conf/eval.yaml --------------------------------------------------------------------------


@dataclass
class CategoryConf:
    benchmark: str
    split: Split
    data: DataConf


@dataclass
class SampledConf:
    enabled: bool
    temperature: float
    top_p: float


@dataclass
class SimulateConf:
    chunk_bytes: int
    threads: Optional[int]


@dataclass
class EvalJob:
    verifier: VerifierConf
    engine: EngineConf
    store: StoreConf
    capture: CaptureConf
    draft_dir: str
    num_speculative_tokens: int
    num_prompts: int
    max_tokens: int
    max_len: int
    seed: int
    categories: Dict[str, CategoryConf]
    sampled: SampledConf
    draft_sample: DraftSample
    decode_dtype: DecodeDtype
    simulate: SimulateConf
    card: bool
    plot: bool


# ---- conf/build_verifier.yaml ----------------------------------------------------------------


@dataclass
class TokenizerConf:
    vocab_size: int
    train_conversations: int
    special_tokens: List[str]


@dataclass
class VerifierTrainingConf:
    seq_len: int
    batch_size: int
    steps: int
    lr: float
    min_lr_ratio: float
    warmup_steps: int
    weight_decay: float
    betas: List[float]
    grad_clip: float
    bf16_autocast: bool
    eval_every: int
    eval_tokens: int
    threads: Optional[int]


@dataclass
class CardConf:
    samples: List[str]
    max_new_tokens: int


@dataclass
class BuildVerifierJob:
    verifier: VerifierConf
    data: DataConf
    output_dir: str
    seed: int
    tokenizer: TokenizerConf
    training: VerifierTrainingConf
    card: CardConf


# The schema of each conf group (config/groups.py), by group name.
GROUP_SCHEMAS = {"verifier": VerifierConf, "draft": DraftConf, "deepspeed": DeepSpeedConf, "data": DataConf,
                 "engine": EngineConf, "store": StoreConf, "capture": CaptureConf, "heldout_split": SplitConf}

# The schema each conf/<name>.yaml is merged onto (its first default, `<name>_schema`).
SCHEMAS = {"dump": DumpJob, "train": TrainJob, "plan": PlanJob, "eval": EvalJob,
           "build_verifier": BuildVerifierJob}
