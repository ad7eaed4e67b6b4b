"""The config contract, checked on the source (parsed with `ast`, never imported) and on the
entry points: code outside conf/, tests/ and bench/ reads typed attributes of the composed config
(config/stages.py), never `.get` with a default of its own nor a cast of a value the schema has
already typed; a mistyped key or a draft written for another verifier is refused before any work.

A config name is a parameter annotated DictConfig (or a config/ schema class) or named `cfg`, and
any local bound to an attribute or item of one (`t = cfg.train`); plain dicts made from a config
(OmegaConf.to_container: a table handed to DeepSpeed or vLLM) are not config nodes.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from config import ConfigError, compose_config, recorded
from config.stages import SCHEMAS
from infra import REPO_ROOT
from tests.test_layout import project_modules

CASTS = {"int", "float", "bool", "str"}
EXEMPT = ("bench", "tests")
CONFIG_TYPES = {"DictConfig"} | {schema.__name__ for schema in SCHEMAS.values()}


def _root(node: ast.expr) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _is_config_annotation(annotation: ast.expr | None) -> bool:
    return annotation is not None and any(name in ast.unparse(annotation) for name in CONFIG_TYPES)


def _config_names(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    args = function.args
    names = {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]
             if a.arg == "cfg" or _is_config_annotation(a.annotation)}
    changed = True
    while changed:                      # locals bound to a part of a config name, to a fixed point
        changed = False
        for node in ast.walk(function):
            if isinstance(node, ast.Assign) and isinstance(node.value, (ast.Attribute, ast.Subscript, ast.Name, ast.Tuple)):
                targets = [t for target in node.targets
                           for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
                values = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
                for target, value in zip(targets, values if len(values) == len(targets) else values * len(targets)):
                    if isinstance(target, ast.Name) and _root(value) in names and target.id not in names:
                        names.add(target.id)
                        changed = True
    return names


def config_misreads(path: Path) -> list[str]:
    """`file:line: code` for each `.get(` on, getattr default of, or cast of a config name."""
    found = []
    tree = ast.parse(path.read_text(), str(path))
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        names = _config_names(function)
        for node in ast.walk(function):
            if not isinstance(node, ast.Call) or not names:
                continue
            func = node.func
            bad = (isinstance(func, ast.Attribute) and func.attr == "get" and _root(func.value) in names) or \
                  (isinstance(func, ast.Name) and func.id in CASTS and len(node.args) == 1
                   and _root(node.args[0]) in names and not isinstance(node.args[0], ast.Name)) or \
                  (isinstance(func, ast.Name) and func.id == "getattr" and len(node.args) == 3
                   and _root(node.args[0]) in names)
            if bad:
                found.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno}: {ast.unparse(node)}")
    return sorted(set(found))


def test_code_reads_typed_config_attributes() -> None:
    misreads = [line for module, path in sorted(project_modules(REPO_ROOT).items())
                if module.split(".")[0] not in EXEMPT for line in config_misreads(path)]
    assert misreads == [], "config read with .get / a cast (the schema types it):\n" + "\n".join(misreads)


def test_the_scan_finds_what_it_is_for(tmp_path: Path) -> None:
    path = tmp_path / "mod.py"
    path.write_text(
        "from omegaconf import DictConfig\n"
        "def f(cfg):\n    t = cfg.train\n    return int(t.steps), cfg.get('turns', 'all')\n"
        "def g(conf: DictConfig):\n    return float(conf.lr), getattr(conf, 'x', 1)\n"
        "def h(config: dict):\n    return config.get('name'), int(config['level'])\n")
    found = [line.split(": ", 1)[1] for line in config_misreads_at(path, tmp_path)]
    assert sorted(found) == sorted(["int(t.steps)", "cfg.get('turns', 'all')", "float(conf.lr)",
                                    "getattr(conf, 'x', 1)"])


def config_misreads_at(path: Path, root: Path) -> list[str]:
    global REPO_ROOT
    saved, REPO_ROOT = REPO_ROOT, root
    try:
        return config_misreads(path)
    finally:
        REPO_ROOT = saved


# ---- refusals before any work ----------------------------------------------------------------
def test_a_draft_written_for_another_verifier_is_refused_naming_both() -> None:
    with pytest.raises(ConfigError) as refused:
        compose_config("train", ["draft=kimi_k3"])
    message = str(refused.value)
    assert "draft=kimi_k3" in message and "verifier=kimi_k3" in message and "kimi_tiny" in message


def test_a_verifier_brings_its_draft_and_recipe() -> None:
    cfg = compose_config("train", ["verifier=kimi_k3"])
    assert cfg.draft.name == "kimi-k3-eagle3" and cfg.train.max_len == 46000 and cfg.train.lr == 2.0e-5
    assert cfg.train.loss.last_turn_only is True
    assert cfg.draft.train_head is False and cfg.train.head_lr_scale == 1.0     # the verifier's lm_head, frozen
    tiny = compose_config("train")
    assert tiny.draft.name == "kimi-tiny-eagle3" and tiny.train.max_len == 2048
    assert tiny.draft.train_head is True and tiny.train.head_lr_scale == 0.3    # trained, at 0.3 x the lr
    assert compose_config("train", ["train.head_lr_scale=0.5"]).train.head_lr_scale == 0.5


def test_added_keys_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="'train.stepz'"):
        compose_config("train", ["+train.stepz=3"])


def test_values_take_the_schema_types() -> None:
    cfg = compose_config("train", ["train.lr=1", "train.steps=7"])
    assert isinstance(cfg.train.lr, float) and cfg.train.steps == 7


@pytest.mark.parametrize("overrides, named", [
    (["draft=kimi_k3"], "verifier=kimi_k3"),
    (["train.stepz=3"], "train.stepz"),
    (["+train.stepz=3"], "train.stepz"),
])
def test_the_train_command_refuses_before_any_work(overrides: list[str], named: str, tmp_path: Path) -> None:
    # store_dir points nowhere: a run that got past the config would fail on the store instead.
    done = subprocess.run([sys.executable, "-m", "train", *overrides, f"store_dir={tmp_path}/none",
                           f"hydra.run.dir={tmp_path}/run"], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode != 0 and named in done.stderr, done.stderr[-2000:]
    assert "store" not in done.stderr.lower().split(named)[0][-200:]
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_every_stage_has_a_schema() -> None:
    assert set(SCHEMAS) == {"dump", "train", "plan", "eval", "build_verifier"}
    for name in SCHEMAS:
        text = (REPO_ROOT / "conf" / f"{name}.yaml").read_text()
        assert f"{name}_schema" in text, f"conf/{name}.yaml does not start from its schema"


def test_a_recorded_group_config_is_typed_again_with_the_meaning_it_had() -> None:
    old = {"name": "sharegpt", "format": "sharegpt", "path": None, "category": "dialogue",
           "heldout_fraction": 0.02, "split_seed": 0, "max_samples": None, "on_error": "skip"}
    data = recorded("data", old)
    assert data.require_answer is True and data.select is None and data.heldout_fraction == 0.02
    with pytest.raises(Exception, match="stepz"):
        recorded("data", {**old, "stepz": 3})
