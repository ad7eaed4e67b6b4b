"""The EAGLE-3 draft with Multi-Latent Attention, in plain PyTorch.

    aux [B, T, n_aux*H_t] --[fc_norm]--fc--> h0 [B, T, H]
                             fc_norm: each H_t-wide aux chunk through its own RMSNorm first
    step k:  e = input_layernorm(embed(ids_k)),  x = cat[e, hidden_norm(h_k)]   (2H)
             r = h_k                (hidden_norm(h_k) with norm_before_residual)
             r = r + self_attn(x)                       (MLA; TTT cache across steps)
             o = r + mlp(post_attention_layernorm(r))   <- pre-norm output
             h_{k+1} = o            (norm(o) with norm_output)   <- next step's hidden input
             logits_k = lm_head(norm(o))                 (draft vocabulary)

fc_norm, norm_before_residual and norm_output are the optional switches vLLM's
Eagle3DeepseekV2ForCausalLM reads from config.json (all off: the plain EAGLE-3 layer above).

Module and parameter names are those of vLLM's Eagle3DeepseekV2ForCausalLM checkpoint
(fc, fc_norm.*, midlayer.*, norm, lm_head, d2t), so export is a rename at most (model/checkpoint/).
The embedding is a frozen copy of the verifier's and never exported (vLLM shares the target's);
final norm and lm_head start as copies of the verifier's and stay frozen unless `train_head`.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch import Tensor, nn

from config.groups import DraftLayerShape
from model.aux_ids import to_vllm_aux_ids
from model.mla import MLAConfig, MLAttention, RMSNorm
from model.ttt_attention import TTTCache
from model.rope import RopeSpec
from model.vocab import draft_to_target, t2d_from_d2t, target_ids_of

if TYPE_CHECKING:
    from model.verifier_handle import Verifier
    from model.verifier_weights import VerifierHead


@dataclass
class DraftConfig(DraftLayerShape):
    """Shapes and links to the verifier of one draft; filled from conf/draft + conf/verifier.

    The decoder layer's shapes are DraftLayerShape's fields (max_position_embeddings with them: the
    verifier's RoPE, so draft and verifier agree on what a position is).
    """

    rope_parameters: dict[str, Any]
    rope_interleave: bool
    # Vocabulary: target size, and the draft's (== vocab_size when not pruned).
    vocab_size: int
    draft_vocab_size: int
    # The verifier the draft reads from.
    target_hidden_size: int
    target_num_hidden_layers: int
    # The verifier's model_type (deepseek_v3 | kimi_k3): decides which aux ids the exported
    # eagle_config carries for SGLang and TokenSpeed (model/checkpoint/).
    target_model_type: str
    aux_layer_ids: tuple[int, ...]          # vLLM convention (id k = hidden state entering layer k)
    bos_token_id: int | list[int] | None = None
    eos_token_id: int | list[int] | None = None
    # Architecture switches, exported to config.json (vLLM reads each, absent = False).
    fc_norm: bool = False                   # RMSNorm per aux state before fc (fc_norm.{i}.weight)
    norm_before_residual: bool = False      # the layer's residual is hidden_norm(h), not h
    norm_output: bool = False               # the next step reads norm(output), not the pre-norm output
    # Training-time choices (not part of the exported checkpoint).
    attention: str = "ttt"                  # "ttt" | "ttt_blocked" | "reference" (model/ttt_attention.py)
    train_head: bool = False                # train final norm and lm_head too
    train_norm: bool = False                # train the final norm (lm_head stays frozen unless train_head)

    @property
    def pruned(self) -> bool:
        return self.draft_vocab_size != self.vocab_size

    @property
    def num_aux(self) -> int:
        return len(self.aux_layer_ids)

    def rope(self) -> RopeSpec:
        return RopeSpec.from_hf(self.rope_parameters, self.qk_rope_head_dim, self.rope_interleave)

    def mla(self) -> MLAConfig:
        return MLAConfig(
            input_size=2 * self.hidden_size,  # EAGLE-3 first layer reads cat[embedding, hidden]
            hidden_size=self.hidden_size,
            num_heads=self.num_attention_heads,
            q_lora_rank=self.q_lora_rank,
            kv_lora_rank=self.kv_lora_rank,
            qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope=self.rope(),
        )

    @classmethod
    def from_conf(cls, draft: DictConfig | dict[str, Any], verifier: Verifier | None = None) -> DraftConfig:
        """From a resolved conf/draft node (see `config.compose_draft_conf`, or Hydra's cfg.draft).

        verifier: the verifier, whose config.json gives bos/eos ids for the export. The draft's aux
        ids are its own setting (draft.aux_layer_ids, `${verifier.aux_layer_ids}` unless changed),
        converted against the layer count it is written for: model/compatibility.py compares them
        with the verifier's, and train/plan.py sizes a draft with no verifier folder at hand.
        """
        d = OmegaConf.to_container(draft, resolve=True, enum_to_str=True) if isinstance(draft, DictConfig) else dict(draft)
        assert isinstance(d, dict)
        if verifier is not None:
            d = verifier.token_ids | d
        if d["hidden_size"] != d["target_hidden_size"]:
            # vLLM feeds the target's embedding (width H_t) into the draft layer.
            raise ValueError("the draft hidden_size must equal the verifier's")
        aux = to_vllm_aux_ids(d["aux_layer_ids"], d["aux_convention"], d["target_num_hidden_layers"])
        return cls(
            **layer_shapes(d),
            rope_parameters=dict(d["rope_parameters"]),
            rope_interleave=bool(d["rope_interleave"]),
            vocab_size=d["vocab_size"],
            draft_vocab_size=d["draft_vocab_size"] or d["vocab_size"],
            target_hidden_size=d["target_hidden_size"],
            target_num_hidden_layers=d["target_num_hidden_layers"],
            target_model_type=str(d["target_model_type"]),
            aux_layer_ids=tuple(aux),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            **architecture_flags(d),
            attention=d.get("attention", "ttt"),
            train_head=bool(d.get("train_head", False)),
            train_norm=bool(d.get("train_norm", False)),
        )


# The draft layer's shapes: named alike in conf/draft, the exported config.json and DraftConfig.
LAYER_SHAPE_KEYS = tuple(f.name for f in fields(DraftLayerShape))


def layer_shapes(d: dict[str, Any]) -> dict[str, Any]:
    """The LAYER_SHAPE_KEYS of a config dict, as DraftConfig keyword arguments."""
    shapes = {k: d[k] for k in LAYER_SHAPE_KEYS}
    shapes["rms_norm_eps"] = float(shapes["rms_norm_eps"])
    return shapes


# The optional architecture switches: named alike in conf/draft, config.json and DraftConfig.
ARCHITECTURE_FLAGS = ("fc_norm", "norm_before_residual", "norm_output")


def architecture_flags(d: dict[str, Any]) -> dict[str, bool]:
    """The ARCHITECTURE_FLAGS of a config dict as DraftConfig keyword arguments; absent or null =
    False (what vLLM assumes, so configs and folders written before the switches keep their
    meaning; a conf's null means "the train.init_from folder's", which
    model/checkpoint/init_from.py draft_config_for_run fills in)."""
    return {k: bool(d.get(k, False)) for k in ARCHITECTURE_FLAGS}


class DraftMLP(nn.Module):
    """Dense SwiGLU MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    """The one EAGLE-3 decoder layer ("midlayer"): 2H-wide MLA input, residual from the hidden
    (from the normed hidden with norm_before_residual)."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(H, eps)
        self.hidden_norm = RMSNorm(H, eps)
        self.self_attn = MLAttention(cfg.mla(), attention=cfg.attention)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp = DraftMLP(H, cfg.intermediate_size)

    def forward(
        self,
        embeds: Tensor,
        hidden: Tensor,
        positions: Tensor,
        cache: TTTCache | None,
        segment_ids: Tensor | None,
    ) -> tuple[Tensor, TTTCache]:
        """embeds, hidden: [B, T, H] -> (pre-norm output [B, T, H], cache)."""
        normed = self.hidden_norm(hidden)
        x = torch.cat((self.input_layernorm(embeds), normed), dim=-1)  # [B, T, 2H], embeddings first
        attn, cache = self.self_attn(x, positions, cache, segment_ids)
        residual = (normed if self.norm_before_residual else hidden) + attn
        return residual + self.mlp(self.post_attention_layernorm(residual)), cache


class StepOutput(NamedTuple):
    # The next step's hidden input, as vLLM's drafter feeds it back: the layer's pre-norm
    # output, or `normed` with norm_output. Every chain (training, simulation) reads this one.
    hidden: Tensor            # [B, T, H]
    normed: Tensor            # [B, T, H] norm(pre-norm output): what lm_head reads
    logits: Tensor | None     # [B, T, draft_vocab] (None when not asked for: the loss may chunk lm_head)
    cache: TTTCache           # keys/values for the next step


class Eagle3Draft(nn.Module):
    def __init__(self, cfg: DraftConfig, verifier_tensors_on: torch.device | str | None = None) -> None:
        """verifier_tensors_on: where the [V, H] embedding and lm_head are made (default: with the
        rest); "meta" for a draft that takes the verifier's own (`build_draft` with a head)."""
        super().__init__()
        self.config = cfg
        H = cfg.hidden_size
        # Frozen verifier embedding: a non-persistent buffer, so it is neither trained, nor in
        # state_dict / training checkpoints, nor exported (vLLM shares the target's).
        self.register_buffer("embed_tokens", torch.zeros(cfg.vocab_size, H, device=verifier_tensors_on),
                             persistent=False)
        self.fc = nn.Linear(cfg.num_aux * cfg.target_hidden_size, H, bias=False)
        # One norm per aux state: the verifier's layers differ widely in scale; normed, each
        # reaches fc at unit RMS (times its learned weight).
        self.fc_norm = (nn.ModuleList(RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps) for _ in range(cfg.num_aux))
                        if cfg.fc_norm else None)
        self.midlayer = DraftLayer(cfg)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False, device=verifier_tensors_on)
        if cfg.pruned:
            # Persistent: the vocabulary is part of the trained draft.
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
            self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        else:
            self.d2t = None
            self.t2d = None
        self.norm.weight.requires_grad_(cfg.train_head or cfg.train_norm)
        self.lm_head.weight.requires_grad_(cfg.train_head)

    # ---- initialisation -------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, std: float = 0.02, generator: torch.Generator | None = None,
                     skip: nn.Module | None = None) -> None:
        """Random init of the trainable layer: normal(0, std) linears, unit norms (`skip` left as it
        is: the lm_head the verifier's replaces, last of the modules, so the others draw the same)."""
        for module in self.modules():
            if module is skip:
                continue
            if isinstance(module, nn.Linear):
                module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * std)
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)

    @torch.no_grad()
    def set_vocab(self, d2t: Tensor) -> None:
        """Install the pruned vocabulary (d2t [draft_vocab] offsets); t2d follows from it."""
        if self.d2t is None:
            raise ValueError("this draft has the full vocabulary (draft_vocab_size == vocab_size)")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d_from_d2t(d2t.to(self.t2d.device), self.config.vocab_size))

    @torch.no_grad()
    def take_verifier_head(self, head: VerifierHead) -> None:
        """Embedding, final norm and lm_head from the verifier's tensors, without a copy where the
        draft only reads them: the embedding is the verifier's tensor itself, and so is a frozen
        full-vocabulary lm_head (`shares_verifier_head`); the norm, and a pruned or trained lm_head,
        are copies in the draft's dtype. The caller gives them in the dtype it trains in."""
        self.embed_tokens = head.embed_tokens
        self.norm.weight.copy_(head.norm)
        if self.shares_verifier_head:
            # The verifier's, like the embedding: a non-persistent buffer, so that it is neither
            # trained, nor in training checkpoints, nor partitioned by ZeRO-3 (`exported_state`
            # adds it back for an export; a checkpoint's export reads it from the verifier).
            del self.lm_head.weight
            self.lm_head.register_buffer("weight", head.lm_head, persistent=False)
            return
        rows = head.lm_head if self.d2t is None else head.lm_head[target_ids_of(self.d2t.cpu())]
        self.lm_head.weight = nn.Parameter(rows.to(self.fc.weight.dtype, copy=True), requires_grad=self.config.train_head)

    def exported_state(self) -> dict[str, Tensor]:
        """state_dict plus the lm_head where it is the verifier's (a buffer state_dict leaves out):
        every tensor a draft folder holds but the embedding."""
        state = self.state_dict()
        return state if "lm_head.weight" in state else {**state, "lm_head.weight": self.lm_head.weight}

    @property
    def shares_verifier_head(self) -> bool:
        """Whether lm_head is, and stays, the verifier's: full vocabulary and not trained."""
        return self.d2t is None and not self.config.train_head

    @torch.no_grad()
    def load_verifier_head(self, verifier: Verifier) -> None:
        """Embedding, final norm and lm_head (rows of the draft vocabulary) from the verifier
        (model/verifier_handle.py reads its folder once per process)."""
        head = verifier.head()
        self.embed_tokens.copy_(head.embed_tokens)
        self.norm.weight.copy_(head.norm)
        rows = head.lm_head if self.d2t is None else head.lm_head[target_ids_of(self.d2t.cpu())]
        self.lm_head.weight.copy_(rows)

    @torch.no_grad()
    def load_verifier_embedding(self, verifier: Verifier) -> None:
        """Only the embedding (for a trained draft whose norm and lm_head come from its checkpoint);
        a draft made on the meta device (train/export.py draft_from_state) takes the tensor itself."""
        embedding = verifier.embedding(self.embed_tokens.dtype)
        if self.embed_tokens.is_meta:
            self.embed_tokens = embedding
        else:
            self.embed_tokens.copy_(embedding)

    # ---- forward pieces -------------------------------------------------------------------
    def project_aux(self, aux: Tensor) -> Tensor:
        """aux: [B, T, n_aux*H_t] (aux layers concatenated in aux_layer_ids order) -> [B, T, H]."""
        if self.fc_norm is not None:
            chunks = aux.chunk(len(self.fc_norm), dim=-1)
            aux = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(aux)

    def embed(self, input_ids: Tensor) -> Tensor:
        """[B, T] -> [B, T, H] with the frozen verifier embedding."""
        return F.embedding(input_ids, self.embed_tokens)

    def compute_logits(self, normed: Tensor) -> Tensor:
        """normed: [..., H] -> logits [..., draft_vocab] (draft ids; see `to_target_logits`)."""
        return self.lm_head(normed)

    def step(
        self,
        input_ids: Tensor,
        hidden: Tensor,
        positions: Tensor,
        cache: TTTCache | None = None,
        segment_ids: Tensor | None = None,
        *,
        with_logits: bool = True,
    ) -> StepOutput:
        """One draft step (TTT step k or one generation step).

        input_ids: [B, T] ids of this step; hidden: [B, T, H] (fc output at step 0, else the
        previous step's `StepOutput.hidden`, which follows norm_output); positions: [B, T] RoPE
        positions (position_ids + k at step k); cache: None at step 0, else the previous step's;
        segment_ids: [B, T] for packed rows.
        """
        out, cache = self.midlayer(self.embed(input_ids), hidden, positions, cache, segment_ids)
        normed = self.norm(out)
        logits = self.compute_logits(normed) if with_logits else None
        return StepOutput(normed if self.config.norm_output else out, normed, logits, cache)

    def draft_to_target(self, draft_ids: Tensor) -> Tensor:
        return draft_to_target(draft_ids, self.d2t)

    def to_target_logits(self, logits: Tensor) -> Tensor:
        """Draft logits [..., Vd] scattered into the target vocabulary [..., V], -inf elsewhere (vLLM's view)."""
        if self.d2t is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        full[..., target_ids_of(self.d2t)] = logits
        return full


def exported_parameter_count(draft: Eagle3Draft) -> int:
    """Parameters that go into the checkpoint (all but the frozen embedding buffer), the lm_head
    included wherever the draft holds it."""
    head = draft.lm_head.weight
    return sum(p.numel() for p in draft.parameters()) + (0 if isinstance(head, nn.Parameter) else head.numel())


def build_draft(cfg: DraftConfig, device: torch.device | str | None = None, head: VerifierHead | None = None,
                d2t: Tensor | None = None) -> Eagle3Draft:
    """A draft with random layer weights (`device="meta"` for shapes only).

    head: the verifier's embedding, final norm and lm_head (`take_verifier_head`; d2t: the pruned
    vocabulary, installed first). With a head, the [V, H] tensors are never allocated for the draft
    itself: at Kimi's vocabulary each is 4.7 GB in fp32, and the verifier's tensors take their
    place. The layer's random weights are the same as without one."""
    if head is None:
        with torch.device(device or "cpu"):
            draft = Eagle3Draft(cfg)
        if d2t is not None:
            draft.set_vocab(d2t)
        if torch.device(device or "cpu").type != "meta":
            draft.init_weights()
        return draft
    with torch.device(device or "cpu"):
        draft = Eagle3Draft(cfg, verifier_tensors_on="meta")
    if d2t is not None:
        draft.set_vocab(d2t)
    draft.init_weights(skip=draft.lm_head)
    draft.take_verifier_head(head)
    return draft

