"""`python -m evaluation draft_dir=<folder>` (`make eval DRAFT=<folder>`): accept length per category.

1. Prompts: the first user turn of the first `num_prompts` conversations of each category's
   split (conf/eval.yaml), rendered with the verifier's chat template.
2. Real: vLLM speculative decoding (eagle3, K drafts, topk 1) with the exported draft, in
   `decode_dtype` (auto: bfloat16 where it runs natively, as served); vLLM's own counters give the
   accept length, greedy and sampled.
3. Shards: the verifier's hidden states over prompt + answer (the very tokens vLLM produced,
   greedy and sampled) are dumped through stage 1's capture, in conf/engine's dtype, into
   <run>/stores/<category>/<mode>.
4. Simulated: the draft replays greedy decoding on the greedy shards and gives the expected
   acceptance on the sampled ones (evaluation/simulate.py); no vLLM involved.
5. Report: table on the console, eval.json, acceptance.png in the run folder; the table goes into
   the draft's README.md (model card).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from omegaconf import OmegaConf

from config.choices import DraftSample, names
from config.groups import EngineConf
from config.stages import EvalJob
from data.conversations import Conversation, load_conversations
from data.template import as_chat, prompt_ids
from infra import resolve

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from model.verifier_handle import Verifier

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Prompt:
    id: str
    ids: list[int]


@dataclasses.dataclass(frozen=True)
class Category:
    name: str
    benchmark: str
    prompts: list[Prompt]


# ---- 1. prompts ----------------------------------------------------------------------------
def first_turn(conversation: Conversation) -> Conversation:
    """The conversation up to its first assistant turn (system + user): one prompt."""
    messages = []
    for m in conversation.messages:
        if m.role == "assistant":
            break
        messages.append(m)
    return Conversation(conversation.id, tuple(messages), conversation.category)


def load_categories(cfg: EvalJob, tokenizer: PreTrainedTokenizerBase) -> list[Category]:
    room = cfg.max_len - cfg.max_tokens - cfg.num_speculative_tokens - 1
    categories = []
    for name, cat in cfg.categories.items():
        prompts, too_long = [], 0
        for conv in load_conversations(cat.data, cat.split):
            ids = prompt_ids(tokenizer, as_chat(first_turn(conv)))
            if len(ids) > room:
                too_long += 1
                continue
            prompts.append(Prompt(conv.id, list(ids)))
            if len(prompts) == cfg.num_prompts:
                break
        if not prompts:
            raise ValueError(f"category {name!r}: no prompt of data {cat.data.name!r} (split {cat.split}) fits "
                             f"{room} tokens (max_len - max_tokens - drafts - 1); {too_long} were longer")
        if too_long:
            logger.info("category %s: skipped %d prompts longer than %d tokens", name, too_long, room)
        categories.append(Category(name, str(cat.get("benchmark", cat.data.name)), prompts))
    return categories


def check_draft(draft_dir: Path, cfg: EvalJob) -> None:
    """Refuse a draft made for another verifier before any engine starts (every disagreement at
    once: model/compatibility.py)."""
    from model.checkpoint import CONFIG_FILE, read_draft_folder
    from model.compatibility import check_compatible
    from model.verifier_handle import Verifier

    if not (draft_dir / CONFIG_FILE).exists():
        raise FileNotFoundError(f"{draft_dir}: no {CONFIG_FILE}; pass an exported draft folder (<run>/draft)")
    check_compatible(verifier=Verifier.from_conf(cfg.verifier), folder=read_draft_folder(draft_dir))


# ---- 2. real -------------------------------------------------------------------------------
def decoding_engine(cfg: EvalJob) -> EngineConf:
    """conf/engine with the dtype the speculative engine decodes in (cfg.decode_dtype through
    dump.engine.decode_dtype); the capture of step 3 keeps conf/engine's own."""
    from dump.engine import decode_dtype, vllm_on_cpu

    return OmegaConf.merge(cfg.engine, {"dtype": decode_dtype(cfg.decode_dtype, cfg.engine.dtype, vllm_on_cpu())})


def measure_real(cfg: EvalJob, categories: list[Category], verifier: Verifier, draft_dir: Path,
                 stop: list[int], engine: EngineConf) -> dict[str, dict[str, Any]]:
    """Step 2 on an engine of `engine` (decoding_engine(cfg)): every category and mode in one call."""
    from dump.engine import shutdown_llm
    from evaluation.speculative import RunRequest, run_together, speculative_engine

    K = cfg.num_speculative_tokens
    wanted: dict[tuple[str, str], RunRequest] = {}
    for cat in categories:
        prompts = [p.ids for p in cat.prompts]
        wanted[cat.name, "greedy"] = RunRequest(prompts)
        if cfg.sampled.enabled:
            wanted[cat.name, "sampled"] = RunRequest(prompts, cfg.sampled.temperature, cfg.sampled.top_p, cfg.seed)
    llm = speculative_engine(verifier.path, engine, draft_dir, K, cfg.draft_sample, cfg.max_len,
                             trust_remote_code=verifier.trust_remote_code)
    try:
        # Every category and mode in one engine call: its steps carry all of them together.
        done = run_together(llm, list(wanted.values()), K, cfg.max_tokens, stop)
    finally:
        shutdown_llm(llm)
    runs: dict[str, dict[str, Any]] = {}
    for (name, mode), run in zip(wanted, done):
        runs.setdefault(name, {})[mode] = run
    for name, by_mode in runs.items():
        logger.info("vLLM %s: %s", name, {m: f"{r.counts.accept_length():.3f}" for m, r in by_mode.items()})
    return runs


# ---- 3. shards of the texts vLLM produced -------------------------------------------------
def dump_texts(cfg: EvalJob, categories: list[Category], runs: dict[str, dict[str, Any]],
               verifier: Verifier, run_dir: Path, llm=None) -> dict[str, dict[str, Path]]:
    """Stage 1's capture over prompt + each answer vLLM produced: <run>/stores/<category>/<mode>.

    `llm`: a capture engine already running on the verifier with cfg.engine and cfg.max_len (tests
    share one); else one is started and shut down at the end."""
    from data.template import TokenizedSample
    from dump.capture import HiddenStateCapture, capture_spec, start_capture_engine
    from dump.engine import shutdown_llm
    from dump.pipeline import open_writer, token_batches, write_batch

    stores: dict[str, dict[str, Path]] = {}
    spec = capture_spec(verifier)
    own_engine = llm is None
    if own_engine:
        llm = start_capture_engine(verifier.path, cfg.engine, spec, cfg.max_len,
                                   trust_remote_code=verifier.trust_remote_code)
    try:
        capture = HiddenStateCapture(llm, spec)
        for cat in categories:
            for mode, run in runs[cat.name].items():
                path = run_dir / "stores" / cat.name / mode
                record = {"output_dir": str(path), "verifier": OmegaConf.to_container(cfg.verifier, resolve=True, enum_to_str=True),
                          "store": OmegaConf.to_container(cfg.store, resolve=True, enum_to_str=True), "rank": 0, "world_size": 1,
                          "eval": {"category": cat.name, "benchmark": cat.benchmark, "mode": mode,
                                   "draft_dir": cfg.draft_dir}}
                writer = open_writer(path, cfg.verifier, cfg.store, record, rank=0, world_size=1)
                done = writer.done_sample_ids()
                samples = []
                for prompt, answer in zip(cat.prompts, run.outputs):
                    ids = np.asarray(prompt.ids + answer, dtype=np.int32)[:cfg.max_len]
                    mask = np.arange(len(ids)) >= len(prompt.ids)
                    if prompt.id not in done and mask.any():
                        samples.append(TokenizedSample(prompt.id, cat.name, ids, mask))
                lengths = [len(s.input_ids) for s in samples]
                for call in token_batches(lengths, cfg.capture.max_batch_tokens):
                    write_batch(writer, capture, [samples[i] for i in call])
                writer.close()
                stores.setdefault(cat.name, {})[mode] = path
    finally:
        if own_engine:
            shutdown_llm(llm)
    return stores


# ---- 4. simulated --------------------------------------------------------------------------
def simulate_all(cfg: EvalJob, stores: dict[str, dict[str, Path]], verifier: Verifier,
                 draft_dir: Path) -> dict[str, dict[str, Any]]:
    """Per category: greedy replay on the greedy texts; the sampled expectation on the sampled texts."""
    import torch

    from evaluation.simulate import Sampling, simulate_store
    from model.checkpoint import load_draft
    from store import StoreReader

    if cfg.simulate.threads:
        torch.set_num_threads(cfg.simulate.threads)
    head = verifier.lm_head(torch.float32)                                       # [V, H]
    draft = load_draft(draft_dir, verifier=verifier).eval()                      # the embedding of the same read
    verifier.release_tensors()                                                   # head and draft hold copies
    chunk = max(1, cfg.simulate.chunk_bytes // (4 * head.shape[0]))
    K = cfg.num_speculative_tokens
    sampling = Sampling(cfg.sampled.temperature, cfg.sampled.top_p, cfg.draft_sample)
    out = {}
    for name, by_mode in stores.items():
        greedy = simulate_store(draft, head, StoreReader(by_mode["greedy"]), K, None, chunk, progress=True).summary()
        out[name] = {key: greedy[key] for key in ("samples", "answer_tokens", "greedy", "greedy_all_positions")}
        if "sampled" in by_mode:
            sampled = simulate_store(draft, head, StoreReader(by_mode["sampled"]), K, sampling, chunk, progress=True)
            out[name]["sampled"] = sampled.summary()["sampled"]
    return out


# ---- 5. report -----------------------------------------------------------------------------
def proposal_method(draft_sample: str, draft_dir: Path) -> str:
    """cfg.draft_sample as vLLM takes it: auto is probabilistic for a full-vocabulary draft and
    greedy for a pruned one (vLLM refuses probabilistic proposals with a d2t map)."""
    if draft_sample not in names(DraftSample):
        raise ValueError(f"draft_sample {draft_sample!r}: use one of {', '.join(names(DraftSample))}")
    if draft_sample != "auto":
        return draft_sample
    config = json.loads((draft_dir / "config.json").read_text())
    pruned = config.get("draft_vocab_size", config["vocab_size"]) != config["vocab_size"]
    return "greedy" if pruned else "probabilistic"


def evaluate_draft(cfg: EvalJob, run_dir: Path, capture_llm=None) -> dict[str, Any]:
    """The whole evaluation (steps 1-5) into run_dir. `capture_llm`: a running capture engine for
    step 3 (see dump_texts); else one is started after the speculative engine is shut down."""
    from evaluation import report
    from model.card import write_card
    from model.verifier_handle import Verifier

    draft_dir = resolve(cfg.draft_dir)
    check_draft(draft_dir, cfg)
    cfg.draft_sample = proposal_method(cfg.draft_sample, draft_dir)
    verifier = Verifier.from_conf(cfg.verifier)
    tokenizer = verifier.tokenizer()
    stop = [tokenizer.convert_tokens_to_ids(cfg.verifier.end_of_turn)]
    categories = load_categories(cfg, tokenizer)
    began = time.perf_counter()
    decoder = decoding_engine(cfg)
    runs = measure_real(cfg, categories, verifier, draft_dir, stop, decoder)
    stores = dump_texts(cfg, categories, runs, verifier, run_dir, capture_llm)
    sims = simulate_all(cfg, stores, verifier, draft_dir)

    results = {}
    for cat in categories:
        real = {mode: run.summary() for mode, run in runs[cat.name].items()}
        sim = sims[cat.name]
        results[cat.name] = {"benchmark": cat.benchmark, "n": len(cat.prompts), "real": real, "sim": sim,
                             "greedy_gap": report.gap(sim["greedy"]["accept_length"], real["greedy"]["accept_length"]),
                             "stores": {mode: str(p) for mode, p in stores[cat.name].items()}}
    sampled = (f"T={cfg.sampled.temperature:g} top-p {cfg.sampled.top_p:g}" if cfg.sampled.enabled else None)
    text = report.table(results, sampled)
    out = {"draft_dir": str(draft_dir), "verifier": cfg.verifier.name, "num_speculative_tokens": cfg.num_speculative_tokens,
           "max_tokens": cfg.max_tokens, "draft_sample": cfg.draft_sample,
           "decode_dtype": decoder.dtype, "sampled": OmegaConf.to_container(cfg.sampled),
           "wall_s": time.perf_counter() - began, "categories": results, "table": text}
    (run_dir / "eval.json").write_text(json.dumps(out, indent=2) + "\n")
    if cfg.plot:
        report.plot(results, run_dir / "acceptance.png",
                    f"{draft_dir.parent.name}/{draft_dir.name} on {cfg.verifier.name}: acceptance per draft position")
    if cfg.card:
        write_card(draft_dir, cfg.verifier.name, cfg.verifier.path, cfg.verifier.serving_tp, cfg.verifier.serving_pp,
                   text)
    return out

