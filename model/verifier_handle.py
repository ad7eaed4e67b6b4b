"""The verifier as one handle per process: its folder read once, shared by every caller.

    verifier = Verifier.from_conf(cfg.verifier)     # the run's verifier, with its aux layers
    verifier = Verifier.open(folder)                # a folder alone (no aux layers)
    verifier.identity, verifier.aux_layer_ids, verifier.sglang_aux_layer_ids
    verifier.token_ids, verifier.hidden_size, verifier.config (what config.json says)
    verifier.head(), verifier.lm_head(torch.float32), verifier.embedding()
    verifier.tokenizer()                            # its chat template marks the assistant's tokens

These two are the only ways in: code that needs the verifier takes a `Verifier` (parameter name
`verifier`) and its caller opens it, so the aux layers a run names are converted to vLLM's
convention once, here, against the layer count of the folder's config.json, and every reader
sees the same ids. (The configured ids are first checked against the configured architecture by
config/validate.py, before any folder is read: `python -m dump plan` has no folder.)

`VerifierFiles` is what the folder holds: config.json (read when opened), the identity a store
records (store/identity.py's hashes), and the embedding, final norm and lm_head, read at the
first request through model/verifier_weights.py (`head()` reads the three in one go, each
safetensors file opened once) and kept as stored; a request in another dtype converts the stored tensor (and keeps the conversion), so
the bf16 head the draft copies and the fp32 lm_head the loss reads come from one read. A Kimi
head is gigabytes: `release_tensors` lets the process drop them once their users hold copies.

The files are memoized by resolved path (and the files' sizes and times, so a folder rewritten in
place is read anew), and only this module opens them: `Verifier.open` and `Verifier.from_conf`
of one folder share one VerifierFiles. `Verifier` adds what the configuration says about the
verifier (its name, aux layers, capture mode, final norm) to the shared files.

Remote code: a Kimi folder ships its tokenizer (and config class) as Python files named in an
`auto_map` (tokenizer_config.json, config.json), which transformers and vLLM run only with
trust_remote_code. `verifier.trust_remote_code` says whether this project may; a folder that needs
it without it is refused by `check_remote_code` with one message naming the setting, before
transformers asks for it interactively or fails on its own.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from omegaconf import DictConfig
from torch import Tensor

from infra import resolve
from model.aux_ids import to_vllm_aux_ids, vllm_to_sglang_aux_ids
from model.verifier_weights import HEAD_PARTS, INDEX_FILE, SINGLE_FILE, VerifierHead, read_head, token_ids_of
from store.identity import identity_of

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

CONFIG_FILE = "config.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
# The tokenizer file transformers' own classes load; with it a folder's tokenizer needs no code.
FAST_TOKENIZER = "tokenizer.json"


def remote_code(folder: str | Path) -> list[str]:
    """The classes a folder names in an auto_map that loading its tokenizer runs as code: the
    tokenizer's (when no tokenizer.json stands in for it) and the config's (when transformers does
    not know the model_type, which the tokenizer's loading reads). Empty: no code to trust."""
    folder = Path(folder)
    needed = []
    tokenizer_config = folder / TOKENIZER_CONFIG
    if tokenizer_config.is_file() and not (folder / FAST_TOKENIZER).is_file():
        auto = json.loads(tokenizer_config.read_text()).get("auto_map", {}).get("AutoTokenizer")
        names = [auto] if isinstance(auto, str) else [n for n in (auto or []) if n]
        needed += [f"{TOKENIZER_CONFIG}: {name}" for name in names]
    config = json.loads((folder / CONFIG_FILE).read_text()) if (folder / CONFIG_FILE).is_file() else {}
    auto_config = config.get("auto_map", {}).get("AutoConfig")
    if auto_config and needed:
        from transformers import CONFIG_MAPPING

        if config.get("model_type") not in CONFIG_MAPPING:
            needed.append(f"{CONFIG_FILE}: {auto_config}")
    return needed


def check_remote_code(folder: str | Path, trusted: bool) -> None:
    """Refuse a folder whose tokenizer is code when verifier.trust_remote_code is false."""
    needed = remote_code(folder)
    if needed and not trusted:
        raise ValueError(f"verifier folder {folder} ships its tokenizer as code ({'; '.join(needed)}), which "
                         "runs only with verifier.trust_remote_code=true (every Kimi folder does; vLLM's "
                         "--trust-remote-code). Set it if you trust the folder's .py files")


class VerifierFiles:
    """One verifier folder, read once: config.json, identity hashes, the head tensors."""

    _open: ClassVar[dict[tuple[Any, ...], VerifierFiles]] = {}

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        config_file = self.path / CONFIG_FILE
        if not config_file.is_file():
            raise FileNotFoundError(f"{self.path} is not a verifier folder: {CONFIG_FILE} is missing")
        self.config: dict[str, Any] = json.loads(config_file.read_text())
        self._identity: dict[str, Any] | None = None
        self._stored: dict[str, Tensor] = {}                        # part -> tensor as stored
        self._cast: dict[tuple[int, torch.dtype], Tensor] = {}     # (stored tensor, dtype) -> converted

    @classmethod
    def open(cls, path: str | Path) -> VerifierFiles:
        """The process's VerifierFiles of the folder (one per resolved path); for Verifier's
        constructors, so that every opening of a folder shares one read."""
        folder = Path(path).resolve()
        key = (folder, *(_signature(folder / name) for name in (CONFIG_FILE, INDEX_FILE, SINGLE_FILE)))
        if key not in cls._open:
            cls._open = {k: v for k, v in cls._open.items() if k[0] != folder}   # a rewritten folder
            cls._open[key] = cls(Path(path).absolute())                     # as the caller names it
        return cls._open[key]

    # ---- config.json ----------------------------------------------------------------------
    @property
    def text_config(self) -> dict[str, Any]:
        """The language model's config (multimodal checkpoints nest it in text_config)."""
        return self.config.get("text_config", self.config)

    @property
    def hidden_size(self) -> int:
        return int(self.text_config["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.text_config["vocab_size"])

    @property
    def num_hidden_layers(self) -> int:
        return int(self.text_config["num_hidden_layers"])

    @property
    def token_ids(self) -> dict[str, int | list[int] | None]:
        """bos/eos/pad token ids as config.json writes them (None where absent)."""
        return token_ids_of(self.config)

    @property
    def eos_token_ids(self) -> list[int]:
        """The end-of-sequence ids as a list (config.json may give one id, a list, or none)."""
        eos = self.token_ids["eos_token_id"]
        return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))

    def identity(self, name: str) -> dict[str, Any]:
        """What a store records of its verifier (store/identity.py's hashes), under `name`."""
        if self._identity is None:
            self._identity = identity_of(self.path, self.config, "")
        return self._identity | {"name": name}

    # ---- the head tensors -----------------------------------------------------------------
    def tensor(self, part: str, dtype: torch.dtype | None = None) -> Tensor:
        """One of HEAD_PARTS, as stored or in `dtype` (converted from the stored one)."""
        self._read([part])
        stored = self._stored[part]
        if dtype is None or dtype == stored.dtype:
            return stored
        # Keyed by the stored tensor: a tied lm_head (the embedding itself) is converted once.
        key = (id(stored), dtype)
        if key not in self._cast:
            self._cast[key] = stored.to(dtype)
        return self._cast[key]

    def head(self, dtype: torch.dtype | None = None) -> VerifierHead:
        """Embedding, final norm and lm_head (the embedding when lm_head is tied and absent)."""
        self._read(HEAD_PARTS)
        return VerifierHead(*(self.tensor(part, dtype) for part in HEAD_PARTS))

    def _read(self, parts: Sequence[str]) -> None:
        """The parts not read yet, in one read (each safetensors file opened once)."""
        missing = [part for part in parts if part not in self._stored]
        if missing:
            self._stored.update(read_head(self.path, missing))

    def release_tensors(self) -> None:
        """Forget the head tensors (config and identity stay); a later request reads them again."""
        self._stored.clear()
        self._cast.clear()


def _signature(path: Path) -> tuple[int, int] | None:
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return stat.st_mtime_ns, stat.st_size


@dataclass(frozen=True)
class Verifier:
    """A verifier as the run names it: its folder's files (shared), its name, the aux layers the
    draft reads (vLLM convention), what their states are and the module that norms the final
    state; the aux layers, their capture and the final norm are None for a verifier opened from
    a folder alone."""

    files: VerifierFiles
    name: str
    aux_layer_ids: tuple[int, ...] | None = None
    aux_capture: str | None = None
    final_norm_module: str | None = None    # verifier.final_norm_module (dump/capture.py)
    trust_remote_code: bool = False     # verifier.trust_remote_code: run the folder's .py files
    chat_format: str | None = None      # verifier.chat_format: marks the assistant's tokens

    @classmethod
    def open(cls, folder: str | Path) -> Verifier:
        """The verifier in `folder`, named after it, without configured aux layers: for a folder
        a record names (a training checkpoint's verifier, a tool's), where no run's config is at hand."""
        files = VerifierFiles.open(folder)
        return cls(files, files.path.name)

    @classmethod
    def from_conf(cls, node: DictConfig | Any) -> Verifier:
        """The verifier of a conf/verifier node (cfg.verifier): its `path`, name, aux layers
        (converted from `aux_convention` here, the one conversion, against the folder's layer
        count), capture mode and final norm."""
        files = VerifierFiles.open(resolve(node.path))
        aux = to_vllm_aux_ids(list(node.aux_layer_ids), node.aux_convention, files.num_hidden_layers)
        return cls(files, node.name, tuple(aux), aux_capture=node.aux_capture,
                   final_norm_module=node.final_norm_module, trust_remote_code=node.trust_remote_code,
                   chat_format=node.chat_format)

    @property
    def path(self) -> Path:
        return self.files.path

    # ---- config.json ----------------------------------------------------------------------
    @property
    def config(self) -> dict[str, Any]:
        """The language model's config.json (a multimodal checkpoint's text_config)."""
        return self.files.text_config

    @property
    def hidden_size(self) -> int:
        return self.files.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.files.vocab_size

    @property
    def num_hidden_layers(self) -> int:
        return self.files.num_hidden_layers

    @property
    def token_ids(self) -> dict[str, int | list[int] | None]:
        """bos/eos/pad token ids as config.json writes them (None where absent)."""
        return self.files.token_ids

    @property
    def eos_token_ids(self) -> list[int]:
        """The end-of-sequence ids as a list (config.json may give one id, a list, or none)."""
        return self.files.eos_token_ids

    @property
    def identity(self) -> dict[str, Any]:
        """What a store dumped from this verifier records (store/identity.py), under its name."""
        return self.files.identity(self.name)

    @property
    def sglang_aux_layer_ids(self) -> tuple[int, ...] | None:
        """aux_layer_ids in SGLang's convention (layer outputs; model/aux_ids.py)."""
        if self.aux_layer_ids is None:
            return None
        return tuple(vllm_to_sglang_aux_ids(self.aux_layer_ids, self.files.num_hidden_layers))

    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The folder's tokenizer (its code run where trust_remote_code allows), its chat template
        the one that marks the assistant's tokens (data/template.py marked_template)."""
        from transformers import AutoTokenizer

        from data.template import marked_template

        check_remote_code(self.path, self.trust_remote_code)
        tokenizer = AutoTokenizer.from_pretrained(self.path, trust_remote_code=self.trust_remote_code)
        tokenizer.chat_template = marked_template(tokenizer, self.chat_format, f"verifier folder {self.path}")
        return tokenizer

    # ---- the head tensors -----------------------------------------------------------------
    def embedding(self, dtype: torch.dtype | None = None) -> Tensor:
        """The embedding [V, H] (read alone if nothing else of the head was asked for yet)."""
        return self.files.tensor("embed_tokens", dtype)

    def norm(self, dtype: torch.dtype | None = None) -> Tensor:
        """The final norm's weight [H]."""
        return self.files.tensor("norm", dtype)

    def lm_head(self, dtype: torch.dtype | None = None) -> Tensor:
        """lm_head [V, H] (the embedding when tied)."""
        return self.files.tensor("lm_head", dtype)

    def head(self, dtype: torch.dtype | None = None) -> VerifierHead:
        return self.files.head(dtype)

    def release_tensors(self) -> None:
        """Let the process drop the head tensors once their users hold copies (a Kimi head is gigabytes)."""
        self.files.release_tensors()
