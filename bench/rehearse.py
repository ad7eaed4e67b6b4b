"""`make rehearse` (`python -m bench.rehearse`): a Kimi-K2 run rehearsed on this machine at Kimi-K2's
real widths, from a folder shaped like a real Kimi checkpoint, before anyone rents a GPU node.

The verifier is conf/verifier/kimi_k2_rehearsal.yaml (every width of Kimi-K2, 7 layers, 4 experts),
its folder made from a seed by tools/rehearsal_verifier.py (random bf16 weights, sharded, tiktoken
tokenizer as remote code). Stages, each a process of its own under a memory watch (peak RSS of
every process it starts, and of the whole machine), in bf16, timed:

  folder              python -m tools.rehearsal_verifier (only where the folder is missing)
  tokenizer           AutoTokenizer and the project (model/verifier_handle.py) refuse the folder without
                      trust_remote_code; AutoTokenizer loads it with it
  dump                python -m dump, regeneration on, the Kimi-K2 recipe's dump settings but max_len
                      (--max-len: a random verifier never ends an answer, so every sample runs to
                      max_len, and 2 cores decode ~50 tokens/s), then `python -m dump inspect`
  train_zero2_1rank   python -m train at the Kimi-K2 draft's shapes (full vocabulary, TTT 4, the
                      recipe's recompute), ZeRO-2, 1 rank
  train_zero3_2ranks  the same on 2 ranks (torchrun) with ZeRO-3, killed after a checkpoint and resumed
  init_from           a TorchSpec-style K2.x folder at these shapes (tools/published_drafts.py) as
                      train.init_from
  export              the first run's draft folder: bytes, config.json beside the published drafts'
  serve               vLLM with the verifier alone and with the exported draft (EAGLE-3, 3 drafts) on 4
                      prompts, greedy: whether the outputs are identical, where they part and the
                      verifier's own margin there; the accept length (near 1: random weights);
                      bench/rehearse_serve.py

Each stage's plan (`python -m dump plan`, `python -m train plan`, same overrides) stands beside its
measurement. Results: bench/results/rehearsal_k2.json (rewritten after every stage).
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import infra
from bench.machine import machine
from bench.process_tree import GIB, checked, watch

infra.configure_environment()

PY = sys.executable
VERIFIER = "kimi_k2_rehearsal"


# ---- the stages --------------------------------------------------------------------------------
class Rehearsal:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work = infra.resolve(args.work)
        self.folder = infra.resolve(args.folder)
        self.store = self.work / "store"
        self.logs = self.work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.out = infra.resolve(args.out)
        self.results: dict[str, Any] = json.loads(self.out.read_text()) if self.out.exists() and args.keep else {}
        self.results.setdefault("stages", {})

    def save(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(self.results, indent=2) + "\n")

    @property
    def verifier(self) -> list[str]:
        return [f"verifier={VERIFIER}", f"verifier.path={self.folder}"]

    def dump_overrides(self) -> list[str]:
        a = self.args
        # The KV cache of 20 rows of 1,024 tokens is ~0.2 GiB at 8 KiB a token: 1 GiB leaves the
        # machine room beside vLLM's worker, which holds the verifier's weights and their repacked
        # copies (13 GiB for the 9 GiB checkpoint).
        return [*self.verifier, f"data.max_samples={a.samples}", "heldout_set.conversations=0", f"max_len={a.max_len}",
                f"capture.max_batch_tokens={a.call_tokens}", f"output_dir={self.store}", "engine.kv_cache_space_gib=1"]

    def train_overrides(self, run: str, stage: str, steps: int, extra: Sequence[str] = ()) -> list[str]:
        return [*self.verifier, f"store_dir={self.store}", f"deepspeed={stage}", f"train.max_len={self.args.train_len}",
                f"train.steps={steps}", "train.num_workers=1", "eval.every=0", f"hydra.run.dir={self.work / run}",
                *extra]

    def stage(self, name: str, result: dict[str, Any]) -> None:
        self.results["stages"][name] = result
        self.save()
        print(f"{name}: {json.dumps(result)[:400]}", flush=True)

    # -- folder and tokenizer --------------------------------------------------------------------
    def folder_stage(self) -> None:
        if (self.folder / "config.json").exists() and not self.args.rebuild:
            self.results["folder"] = {"built": False, "path": str(self.folder)}
        else:
            run = checked(watch([PY, "-m", "tools.rehearsal_verifier", str(self.folder)],
                                log=self.logs / "folder.log"), "the folder")
            self.results["folder"] = {"built": True, **run}
        self.results["folder"] |= folder_facts(self.folder)
        self.save()

    def tokenizer_stage(self) -> None:
        script = ("import infra; infra.configure_environment()\n"
                  "import sys, json\nfrom transformers import AutoTokenizer\n"
                  "from model.verifier_handle import check_remote_code\n"
                  "def refusal(load):\n    try:\n        load()\n    except Exception as e:\n"
                  "        return f'{type(e).__name__}: {e}'[:400]\n"
                  "refused = refusal(lambda: AutoTokenizer.from_pretrained(sys.argv[1]))\n"
                  "ours = refusal(lambda: check_remote_code(sys.argv[1], False))\n"
                  "t = AutoTokenizer.from_pretrained(sys.argv[1], trust_remote_code=True)\n"
                  "print(json.dumps({'refused_without_trust': refused, 'project_refusal': ours,"
                  " 'class': type(t).__name__, 'len': len(t),"
                  " 'im_end': t.convert_tokens_to_ids('<|im_end|>'), 'is_fast': t.is_fast}))\n")
        done = subprocess.run([PY, "-c", script, str(self.folder)], capture_output=True, text=True, stdin=subprocess.DEVNULL,
                              cwd=infra.REPO_ROOT, timeout=600)
        # transformers' question ("run the custom code? [y/N]") ends without a newline.
        facts = json.loads(done.stdout[done.stdout.rindex('{"refused_without_trust"'):])
        if not facts["refused_without_trust"] or not facts["project_refusal"]:
            raise RuntimeError(f"the folder loaded without trust_remote_code: {facts}")
        self.results["tokenizer"] = facts
        self.save()

    # -- dump -------------------------------------------------------------------------------------
    def dump_stage(self) -> None:
        overrides = self.dump_overrides()
        fresh(self.store)
        plan = plan_json([PY, "-m", "dump", "plan", *overrides, "--json", "-"])
        run = checked(watch([PY, "-m", "dump", *overrides], log=self.logs / "dump.log"), "the dump")
        inspect = subprocess.run([PY, "-m", "dump", "inspect", str(self.store)], capture_output=True, text=True,
                                 cwd=infra.REPO_ROOT)
        summary = json.loads((self.store / "summaries" / "rank-00000.json").read_text())
        from dump.plan import DUMP

        run |= {"plan_gib": round(plan["peak_bytes"][DUMP] / GIB, 3),
                "plan_gib_by_process": {p: round(b / GIB, 3) for p, b in plan["peak_bytes"].items()},
                "inspect_ok": inspect.returncode == 0 and "OK" in inspect.stdout,
                "samples": summary["samples_written"], "tokens": summary["tokens_written"],
                "settings": dump_settings(overrides)}
        run["peak_rss_gib"] = run["processes"].get("dump", {}).get("peak_rss_gib")
        self.stage("dump", run)
        self.results["store"] = store_facts(self.store, plan)
        self.save()

    # -- training ----------------------------------------------------------------------------------
    def train_plan(self, overrides: Sequence[str], world: int) -> float:
        plan = plan_json([PY, "-m", "train", "plan", *overrides, f"plan.world_size={world}", "--json", "-"])
        return round(plan["total_bytes"] / GIB, 3)

    def train_zero2(self) -> None:
        overrides = self.train_overrides("train-zero2", "zero2", self.args.steps, ["train.checkpoint_every=0"])
        fresh(self.work / "train-zero2")
        plan = self.train_plan(overrides, 1)
        run = checked(watch([PY, "-m", "train", *overrides], log=self.logs / "train-zero2.log"), "ZeRO-2 training")
        run |= {"plan_gib": plan, "peak_rss_gib": run["processes"].get("train", {}).get("peak_rss_gib"),
                **run_facts(self.work / "train-zero2")}
        self.stage("train_zero2_1rank", run)

    def train_zero3(self) -> None:
        run_dir = fresh(self.work / "train-zero3")
        overrides = self.train_overrides("train-zero3", "zero3", self.args.steps,
                                         ["train.grad_accum=1", "train.checkpoint_every=2"])
        plan = self.train_plan(overrides, 2)
        launch = [str(Path(PY).with_name("torchrun")), "--standalone", "--nproc_per_node", "2", "-m", "train", *overrides]
        # Killed as a crash would kill it: after its step-3 update, past the checkpoint of step 2.
        killed = watch(launch, env={infra.FAILPOINTS_ENV: "train.step.done:3:kill"}, log=self.logs / "train-zero3-killed.log")
        if killed["rc"] == 0:
            raise RuntimeError("the ZeRO-3 run was to be killed at its third step and was not")
        resumed = checked(watch(launch, log=self.logs / "train-zero3-resumed.log"), "the resumed ZeRO-3 run")
        facts = run_facts(run_dir)
        ranks = [v["peak_rss_gib"] for run in (killed, resumed) for k, v in run["processes"].items()
                 if k.startswith("train rank")]
        self.stage("train_zero3_2ranks", {
            "plan_gib": plan, "peak_rss_gib": max(ranks) if ranks else None, "killed": killed, "resumed": resumed,
            "wall_s": round(killed["wall_s"] + resumed["wall_s"], 1),
            "node_used_peak_gib": max(killed["node_used_peak_gib"], resumed["node_used_peak_gib"]), **facts})

    def init_from(self) -> None:
        folder = fresh(self.work / "torchspec-k2")
        fresh(self.work / "train-init-from")
        made = checked(watch([PY, "-m", "bench.rehearse", "--make-torchspec", str(folder), "--folder", str(self.folder)],
                             log=self.logs / "torchspec.log"), "the TorchSpec-style folder")
        overrides = self.train_overrides("train-init-from", "zero2", 1, [f"train.init_from={folder}", "train.export=false"])
        run = checked(watch([PY, "-m", "train", *overrides], log=self.logs / "train-init-from.log"), "init_from")
        log = (self.logs / "train-init-from.log").read_text()
        run |= {"folder_wall_s": made["wall_s"], "folder_bytes": sum(f.stat().st_size for f in folder.iterdir()),
                "initialised_from_folder": f"draft initialised from {folder}" in log,
                "peak_rss_gib": run["processes"].get("train", {}).get("peak_rss_gib"), **run_facts(self.work / "train-init-from")}
        self.stage("init_from", run)

    # -- export and serve -------------------------------------------------------------------------
    def export_stage(self) -> None:
        draft = self.work / "train-zero2" / "draft"
        self.results["export"] = export_facts(draft)
        self.save()

    def serve_stage(self) -> None:
        draft = self.work / "train-zero2" / "draft"
        out = self.work / "serve.json"
        run = checked(watch([PY, "-m", "bench.rehearse_serve", str(draft), str(self.folder), str(out)],
                            log=self.logs / "serve.log"), "serving")
        self.results["serve"] = {**json.loads(out.read_text()), "wall_s": run["wall_s"], "processes": run["processes"],
                                 "node_used_peak_gib": run["node_used_peak_gib"]}
        self.save()


# ---- facts -------------------------------------------------------------------------------------
def fresh(path: Path) -> Path:
    """path, emptied: each stage measures a run from nothing, not a resume of an earlier rehearsal's."""
    shutil.rmtree(path, ignore_errors=True)
    return path


def plan_json(cmd: Sequence[str]) -> dict[str, Any]:
    done = subprocess.run(list(cmd), capture_output=True, text=True, cwd=infra.REPO_ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout[done.stdout.index("{"):])


def folder_facts(folder: Path) -> dict[str, Any]:
    config = json.loads((folder / "config.json").read_text())
    files = sorted(folder.glob("*.safetensors"))
    return {"model_type": config["model_type"], "hidden_size": config["hidden_size"], "vocab_size": config["vocab_size"],
            "num_hidden_layers": config["num_hidden_layers"], "n_routed_experts": config["n_routed_experts"],
            "safetensors_files": len(files), "weight_bytes": sum(f.stat().st_size for f in files),
            "remote_code": sorted(p.name for p in folder.glob("*.py"))}


def dump_settings(overrides: Sequence[str]) -> dict[str, Any]:
    from config import compose_config

    cfg = compose_config("dump", list(overrides))
    recipe = compose_config("dump", [f"verifier={VERIFIER}"])
    return {"max_len": cfg.max_len, "recipe_max_len": recipe.max_len, "regenerate": dict(cfg.regenerate),
            "engine_dtype": cfg.engine.dtype, "max_batch_tokens": cfg.capture.max_batch_tokens,
            "shard_bytes": cfg.store.shard_bytes}


def store_facts(store: Path, plan: dict[str, Any]) -> dict[str, Any]:
    """Bytes per token on disk and each shard's size, on disk and as buffered (its arrays
    uncompressed, what store.shard_bytes bounds)."""
    from store import StoreReader

    reader = StoreReader(store)
    shards = []
    for entry in reader.shards():
        folder = store / "shards" / entry.name
        raw = 0
        for meta in folder.rglob("zarr.json"):
            node = json.loads(meta.read_text())
            if node.get("node_type") == "array":
                itemsize = {"uint8": 1, "bool": 1, "int32": 4, "int64": 8, "uint16": 2, "float32": 4}[node["data_type"]]
                n = 1
                for d in node["shape"]:
                    n *= d
                raw += n * itemsize
        shards.append({"name": entry.name, "samples": len(entry.sample_ids), "tokens": sum(entry.num_tokens),
                       "bytes_on_disk": entry.nbytes, "bytes_buffered": raw, "heldout": entry.heldout})
    tokens = sum(s["tokens"] for s in shards)
    disk = sum(s["bytes_on_disk"] for s in shards)
    shard_bytes = plan["spec"]["shard_bytes"]
    largest = max(s["bytes_buffered"] for s in shards)
    return {"shards": len(shards), "tokens": tokens, "bytes_per_token": round(disk / tokens, 1),
            "shard_bytes": shard_bytes, "shard_bytes_max": max(s["bytes_on_disk"] for s in shards),
            "shard_buffered_bytes_max": largest, "largest_shard_of_shard_bytes": round(largest / shard_bytes, 3),
            "per_shard": shards}


def run_facts(run_dir: Path) -> dict[str, Any]:
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [s for s in steps if "loss" in s]
    return {"steps": summary["steps"], "resumed_from": summary["resumed_from"], "zero_stage": summary["zero_stage"],
            "precision": summary["precision"], "world_size": summary["world_size"],
            "train_tokens_per_s": summary["train_tokens_per_s"],
            "loss": [round(s["loss"], 4) for s in train], "step_rss_gib": [round(s["rss_bytes"] / GIB, 2) for s in train],
            "exported": summary["exported"]}


# The published Kimi-K2 MLA drafts' config.json (TorchSpec's K2.x export; tools/published_drafts.py) beside ours.
def export_facts(draft: Path) -> dict[str, Any]:
    from tools.published_drafts import K25_TEMPLATE

    config = json.loads((draft / "config.json").read_text())
    keys = ("architectures", "model_type", "hidden_size", "intermediate_size", "num_attention_heads", "q_lora_rank",
            "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "vocab_size", "draft_vocab_size",
            "num_hidden_layers", "rope_theta", "eagle_aux_hidden_state_layer_ids", "eagle_config")
    published = {"architectures": ["Eagle3DeepseekV2ForCausalLM"], "hidden_size": 7168, "intermediate_size": 18432,
                 "num_attention_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
                 "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 163840, "draft_vocab_size": 163840,
                 "num_hidden_layers": 1, "rope_theta": K25_TEMPLATE["rope_theta"],
                 "model_type": K25_TEMPLATE["model_type"]}
    weights = draft / "model.safetensors"
    return {"folder": str(draft), "bytes": weights.stat().st_size, "published_bytes_approx": 3.7e9,
            "config": {k: config.get(k) for k in keys},
            "differs_from_published": {k: {"ours": config.get(k), "published": v} for k, v in published.items()
                                       if config.get(k) != v}}


# ---- helpers run in processes of their own ---------------------------------------------------------
def make_torchspec(out: Path, folder: Path) -> None:
    """A TorchSpec-style K2.x --vllm export at the rehearsal's shapes: random layer weights
    (seed 1), the verifier's embedding and lm_head."""
    import torch

    from config import compose_config
    from model.draft import DraftConfig, build_draft
    from model.verifier_handle import Verifier
    from tools.published_drafts import torchspec_export

    cfg = compose_config("train", [f"verifier={VERIFIER}", f"verifier.path={folder}"])
    verifier = Verifier.open(folder)
    head = verifier.head(torch.bfloat16)
    torch.manual_seed(1)
    draft = build_draft(DraftConfig.from_conf(cfg.draft, verifier), head=head)
    torchspec_export(out, draft, head.embed_tokens, "k2", vllm=True)


# ---- entry -------------------------------------------------------------------------------------
STAGES = ("folder", "tokenizer", "dump", "train_zero2_1rank", "train_zero3_2ranks", "init_from", "export", "serve")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.rehearse", description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", default=f"runs/rehearsal/{VERIFIER.replace('_', '-')}", help="the verifier folder")
    parser.add_argument("--work", default="runs/rehearsal/run", help="stores, runs and logs")
    parser.add_argument("--out", default="bench/results/rehearsal_k2.json")
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, of {', '.join(STAGES)}")
    parser.add_argument("--keep", action="store_true", help="add to the results file instead of starting it anew")
    parser.add_argument("--rebuild", action="store_true", help="rebuild the folder even if it exists")
    parser.add_argument("--samples", type=int, default=20, help="conversations the dump reads")
    parser.add_argument("--max-len", type=int, default=1024, help="the dump's max_len (the recipe's: 8,192)")
    parser.add_argument("--call-tokens", type=int, default=16384, help="capture.max_batch_tokens")
    parser.add_argument("--train-len", type=int, default=512, help="train.max_len")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps of each training run")
    parser.add_argument("--make-torchspec", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.make_torchspec:
        make_torchspec(args.make_torchspec, infra.resolve(args.folder))
        return 0
    rehearsal = Rehearsal(args)
    rehearsal.results |= {"date": time.strftime("%Y-%m-%d"), "command": "python -m bench.rehearse " + " ".join(argv or sys.argv[1:]),
                          "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                                   text=True, cwd=infra.REPO_ROOT).stdout.strip(),
                          "machine": machine()}
    began = time.time()
    run = {"folder": rehearsal.folder_stage, "tokenizer": rehearsal.tokenizer_stage, "dump": rehearsal.dump_stage,
           "train_zero2_1rank": rehearsal.train_zero2, "train_zero3_2ranks": rehearsal.train_zero3,
           "init_from": rehearsal.init_from, "export": rehearsal.export_stage, "serve": rehearsal.serve_stage}
    for name in args.stages.split(","):
        print(f"== {name}", flush=True)
        run[name]()
    rehearsal.results["wall_s"] = round(time.time() - began, 1)
    rehearsal.save()
    print(f"wrote {rehearsal.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
