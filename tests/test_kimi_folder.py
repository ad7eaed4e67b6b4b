"""A verifier folder with a Kimi checkpoint's conventions, at kimi-tiny's widths
(tools/rehearsal_verifier.py, the builder of `make rehearse`'s Kimi-K2-wide folder): config.json of
model_type kimi_k2 with an auto_map, weights sharded over several safetensors files with an index, a
tiktoken tokenizer that is the folder's own code, Kimi's chat template without generation markers.
The pipeline runs on it as on kimi-tiny: dump through vLLM with regeneration, train, evaluation with
vLLM speculative decoding.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from config import compose_config
from infra import REPO_ROOT
from tests.conftest import in_process_vllm

NAME = "kimi-tiny-kimi-folder"


@pytest.fixture(scope="module")
def kimi_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tools.rehearsal_verifier import build_folder, training_texts

    out = tmp_path_factory.mktemp("kimi_folder") / "kimi-tiny"
    build_folder(compose_config("dump").verifier, out, training_texts(2000), seed=0, max_file_bytes=8 << 20)
    return out


def _verifier(folder: Path, trusted: bool = True) -> list[str]:
    return [f"verifier.path={folder}", f"verifier.trust_remote_code={str(trusted).lower()}", f"verifier.name={NAME}"]


def test_the_folder_has_a_kimi_checkpoints_conventions(kimi_folder: Path) -> None:
    from transformers import AutoTokenizer

    config = json.loads((kimi_folder / "config.json").read_text())
    assert config["model_type"] == "kimi_k2" and config["auto_map"]["AutoConfig"].startswith("configuration_")
    assert "rope_scaling" in config and "rope_parameters" not in config            # transformers 4.x keys
    index = json.loads((kimi_folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3 and not (kimi_folder / "model.safetensors").exists()
    assert not (kimi_folder / "tokenizer.json").exists() and (kimi_folder / "tiktoken.model").exists()
    # transformers refuses to run the folder's code unasked: in a fresh process, since one that
    # has loaded the folder's classes with trust_remote_code (another test of this module) no
    # longer asks.
    refused = subprocess.run([sys.executable, "-c", "import sys; from transformers import AutoTokenizer; "
                              "AutoTokenizer.from_pretrained(sys.argv[1])", str(kimi_folder)],
                             cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0 and "trust_remote_code" in refused.stderr, refused.stderr[-3000:]
    tokenizer = AutoTokenizer.from_pretrained(kimi_folder, trust_remote_code=True)
    assert not tokenizer.is_fast and len(tokenizer) == 8192
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end == 8192 - 256 + 2 == json.loads((kimi_folder / "generation_config.json").read_text())["eos_token_id"]
    text = "def f(x):\n    return x  # 你好"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_a_folder_whose_tokenizer_is_code_needs_trust_remote_code(kimi_folder: Path) -> None:
    from dump.engine import make_llm
    from model.verifier_handle import Verifier

    cfg = compose_config("dump", _verifier(kimi_folder, trusted=False))
    with pytest.raises(ValueError, match="verifier.trust_remote_code=true"):
        Verifier.from_conf(cfg.verifier).tokenizer()
    with pytest.raises(ValueError, match="verifier.trust_remote_code=true"):     # before any engine starts
        make_llm(kimi_folder, cfg.engine, trust_remote_code=False)


def test_a_python_tokenizer_marks_the_assistant_tokens_as_a_fast_one_does(kimi_folder: Path,
                                                                          kimi_tiny_dir: Path) -> None:
    """The folder's template has no generation markers, so the project's Kimi template marks the
    assistant's text; its tokenizer has no offsets, so the text is tokenized piece by piece: the
    marked text is the same as kimi-tiny's own (fast) tokenizer marks."""
    from data.conversations import Conversation, Message
    from data.template import GENERATION_MARK, chat_format_template, tokenize_conversation
    from model.verifier_handle import Verifier

    kimi = Verifier.from_conf(compose_config("dump", _verifier(kimi_folder)).verifier).tokenizer()
    tiny = Verifier.from_conf(compose_config("dump").verifier).tokenizer()
    assert not GENERATION_MARK.search((kimi_folder / "chat_template.jinja").read_text())
    assert kimi.chat_template == chat_format_template("kimi")
    conv = Conversation("c", (Message("system", "Be brief."), Message("user", "Sum 2 and 2?"),
                              Message("assistant", "4.\n```py\nprint(2 + 2)\n```"), Message("user", "Thanks"),
                              Message("assistant", "You're welcome!")), "dialogue")
    marked = [tokenize_conversation(t, conv, 2048, "truncate") for t in (kimi, tiny)]
    texts = [t.decode(s.input_ids[s.loss_mask]) for t, s in zip((kimi, tiny), marked)]
    assert texts[0] == texts[1] == "4.\n```py\nprint(2 + 2)\n```<|im_end|>You're welcome!<|im_end|>"
    assert kimi.decode(marked[0].input_ids) == tiny.decode(marked[1].input_ids)


def test_a_chat_format_that_renders_otherwise_is_refused(kimi_folder: Path) -> None:
    from transformers import AutoTokenizer

    from data.template import marked_template

    tokenizer = AutoTokenizer.from_pretrained(kimi_folder, trust_remote_code=True)
    tokenizer.chat_template = tokenizer.chat_template.replace("You are Kimi", "You are Kiwi")
    with pytest.raises(ValueError, match="verifier.chat_format='kimi'.*renders"):
        marked_template(tokenizer, "kimi")


@pytest.mark.vllm
@pytest.mark.slow
def test_dump_train_and_evaluate_on_a_kimi_folder(kimi_folder: Path, tmp_path: Path) -> None:
    from dump.capture import capture_spec, start_capture_engine
    from dump.engine import shutdown_llm
    from dump.pipeline import run_dump
    from evaluation.run import evaluate_draft
    from model.verifier_handle import Verifier
    from store import inspect_store

    store = tmp_path / "store"
    dump_cfg = compose_config("dump", [*_verifier(kimi_folder), "data.max_samples=8", "max_len=256",
                                       "heldout_set.conversations=0",
                                       "regenerate.max_tokens=24", "regenerate.dtype=engine", f"output_dir={store}"])
    spec = capture_spec(Verifier.from_conf(dump_cfg.verifier))
    llm = start_capture_engine(kimi_folder, dump_cfg.engine, spec, int(dump_cfg.max_len), trust_remote_code=True)
    try:
        summary = run_dump(dump_cfg, llm=llm)
        # A prompt longer than max_len leaves no room for an answer: rejected, by name.
        assert summary["samples_written"] >= 6
        assert set(summary["rejected_by_kind"]) <= {"no assistant turn"}
        assert inspect_store(store)["problems"] == []
        # In a process of its own: this one's in-process vLLM engine below replaces the process
        # group an in-process training would leave for the tests after it.
        subprocess.run([sys.executable, "-m", "train", *_verifier(kimi_folder), f"store_dir={store}",
                        "train.steps=2", "train.max_len=256", "train.num_workers=0", "eval.every=0",
                        f"hydra.run.dir={tmp_path / 'run'}"], cwd=REPO_ROOT, check=True, timeout=600)
        draft = tmp_path / "run" / "draft"
        eval_cfg = compose_config("eval", [*_verifier(kimi_folder), f"draft_dir={draft}", "num_prompts=2",
                                           "max_tokens=16", "max_len=256", "sampled.enabled=false"])
        with in_process_vllm():
            out = evaluate_draft(eval_cfg, tmp_path / "eval", capture_llm=llm)
    finally:
        shutdown_llm(llm)
    from infra import has_bf16_units

    # decode_dtype auto: bfloat16 speculative decoding where this CPU has bf16 units, beside the
    # float32 capture of the same texts.
    assert out["decode_dtype"] == ("bfloat16" if has_bf16_units() else eval_cfg.engine.dtype)
    for name, result in out["categories"].items():
        real = result["real"]["greedy"]
        assert result["n"] == 2 and real["passes"] > 0, name
        assert result["sim"]["samples"] == 2 and result["sim"]["greedy"]["passes"] > 0, name
