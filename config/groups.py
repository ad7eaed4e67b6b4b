"""The types of the config groups under conf/ (one dataclass per group, shared by every stage).

The yaml files under conf/<group>/ hold the values and say what each one means; these classes say
only what type each key has. A field has no default here (OmegaConf reads it as MISSING, `???`),
so a default lives in one place, the yaml. A key that only some options of a group use (a
codec's level) is Optional with default None here and absent from the yaml of the options that
do not use it.
Free-form tables that belong to another program (a verifier's HF architecture, DeepSpeed's
zero_optimization, vLLM's compilation_config) are typed Dict[str, Any] and passed on as they are.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from config.choices import (Attention, AuxCapture, AuxConvention, AuxEncoding, DataFormat, FinalEncoding,
                            FinalRows, OnError)

@dataclass
class VerifierConf:
    """conf/verifier/<name>.yaml: the verifier a store is dumped from and a draft is trained for."""

    name: str
    path: str
    aux_layer_ids: List[int]
    aux_convention: AuxConvention
    aux_capture: AuxCapture
    final_norm_module: Optional[str]
    chat_format: str
    trust_remote_code: bool
    cpu_dtype: str
    end_of_turn: str
    serving_tp: int
    serving_pp: int
    architecture: Dict[str, Any]


@dataclass
class DraftLayerShape:
    """The draft decoder layer's shapes, named alike in conf/draft, the exported config.json and
    model/draft.py's DraftConfig (which extends this class)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    q_lora_rank: Optional[int]    # None: one q_proj instead of the q_a/q_b low-rank pair
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int


@dataclass
class DraftConf(DraftLayerShape):
    """conf/draft/<name>.yaml: the draft's shapes (mostly `${verifier.*}`) and switches."""

    name: str
    verifier: str         # the conf/verifier option this draft is written for
    rope_parameters: Dict[str, Any]
    rope_interleave: bool
    vocab_size: int
    draft_vocab_size: Optional[int]
    target_hidden_size: int
    target_num_hidden_layers: int
    target_model_type: str
    aux_layer_ids: List[int]
    aux_convention: AuxConvention
    aux_capture: AuxCapture
    fc_norm: Optional[bool]
    norm_before_residual: Optional[bool]
    norm_output: Optional[bool]
    attention: Attention
    train_head: bool
    train_norm: bool


@dataclass
class DeepSpeedConf:
    """conf/deepspeed/<stage>.yaml: the ZeRO stage's settings, handed to DeepSpeed as written."""

    name: str
    zero_optimization: Dict[str, Any]


@dataclass
class DataConf:
    """conf/data/<source>.yaml: where conversations come from and how they split."""

    name: str
    format: DataFormat
    path: Optional[str]
    category: str
    heldout_fraction: float
    split_seed: int
    max_samples: Optional[int]
    on_error: OnError
    require_answer: bool
    # {pattern: <regex>, share: <fraction>} or null. Untyped: OmegaConf cannot merge a command-line
    # table (data.select={pattern: x, share: 0.5}) onto a null typed node; data/conversations.py
    # select_share checks the two keys.
    select: Any


@dataclass
class EngineConf:
    """conf/engine/<device>.yaml: the vLLM engine's settings."""

    name: str
    dtype: str
    attention_backend: Optional[str]
    tensor_parallel_size: int
    pipeline_parallel_size: int
    distributed_executor_backend: Optional[str]
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enforce_eager: bool
    compilation_config: Optional[Dict[str, Any]]
    kv_cache_space_gib: Optional[float]
    reserved_cpus: Optional[int]
    in_process: bool
    gpu_memory_utilization: Optional[float]
    seed: int


@dataclass
class CompressorConf:
    """conf/store's `compressor`: zstd (level), blosc (cname, clevel, shuffle) or none."""

    name: str
    level: Optional[int] = None
    cname: Optional[str] = None
    clevel: Optional[int] = None
    shuffle: Optional[str] = None


@dataclass
class StoreConf:
    """conf/store/<preset>.yaml: how hidden states are encoded and chunked. The one type of a
    store's settings: store/settings.py checks a node into it and reads store.json's "storage"
    block back into it (there max_bytes and poll_s, a running dump's, are not recorded)."""

    mode: str
    aux: AuxEncoding
    final: FinalEncoding
    final_rows: FinalRows
    topk: int
    fp4_block: int
    compressor: CompressorConf
    target_chunk_bytes: int
    shard_bytes: int
    max_bytes: Optional[int]
    poll_s: float


@dataclass
class SplitConf:
    """conf/heldout_split/default.yaml: the trainer's held-out split of a store's samples."""

    heldout_fraction: float
    heldout_seed: int


@dataclass
class CaptureConf:
    """conf/capture/default.yaml: the size of one capture engine call."""

    max_batch_tokens: int
