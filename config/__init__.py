"""Config composition: the one place that says how conf/ becomes a stage's config and what a
composed config must satisfy before any work starts.

    register()                      the stage schemas (config/stages.py) in Hydra's ConfigStore
    compose_config(name, overrides) a stage's config as its entry point would see it (tests, tools)
    compose_draft_conf(draft)       cfg.draft of `python -m train draft=<draft>`, with its verifier
    check(cfg, choices)             refuse a config that cannot run: keys no schema knows (added
                                    with `+key=`), a draft written for another verifier, a value
                                    that breaks a rule of config/validate.py (a bound, an
                                    either/or between keys); a choice outside its config/choices.py
                                    type is refused earlier, by the composition itself
    check_entry(cfg, prog)          check() in a running Hydra job; a refusal exits with status 2
    recorded(group, record)         a group's config as an older run recorded it (a store's
                                    dump config, the verifier's training facts), typed again

Each conf/<stage>.yaml lists `<stage>_schema` first in its defaults, so Hydra merges the yaml onto
the stage's dataclass: values take the declared types (a string where a number belongs fails,
naming the key), and a key that is not declared is refused at composition (Hydra: "Could not
override 'train.stepz'"). Code reads typed attributes (cfg.train.lr is a float), never `.get` with
a default of its own: the yaml states every default once (tests/test_config_contract.py counts).

Pairing: conf/train.yaml selects `draft: ${verifier}` and `recipe@train: ${verifier}`, so choosing
a verifier brings its draft and recipe. A draft yaml names the verifier option it is written for
(`verifier: kimi_k3`); composing it with another verifier is refused, naming both.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

from infra import CONF_DIR


class ConfigError(ValueError):
    """A composed config that cannot run; the message names every problem and what to change."""


def register() -> None:
    """Put each stage's schema in Hydra's ConfigStore as `<stage>_schema` (idempotent)."""
    from hydra.core.config_store import ConfigStore

    from config.stages import SCHEMAS

    store = ConfigStore.instance()
    for name, schema in SCHEMAS.items():
        store.store(name=f"{name}_schema", node=schema)


def compose_config(name: str, overrides: list[str] | None = None, checked: bool = True) -> DictConfig:
    """conf/<name>.yaml with these command-line overrides, as `python -m <stage>` composes it;
    checked (the default): refused as the entry point would refuse it (ConfigError)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import ConfigCompositionException

    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        try:
            cfg = hydra_compose(config_name=name, overrides=overrides or [], return_hydra_config=True)
        except ConfigCompositionException as error:
            # A value its type refuses (a choice, config/choices.py): Hydra's message names the
            # override, its cause the key and the values allowed.
            raise ConfigError(f"config refused: {error}: {error.__cause__}") from error
    choices = dict(cfg.hydra.runtime.choices)
    with _open(cfg):
        del cfg["hydra"]
    if checked:
        check(cfg, choices)
    return cfg


def compose_draft_conf(draft: str, verifier: str | None = None) -> DictConfig:
    """cfg.draft of `python -m train draft=<draft> verifier=<verifier>`, composed by Hydra.

    The draft yaml points at `${verifier.*}` for what must match the verifier; `verifier` (a
    conf/verifier name) defaults to the one the draft yaml names in its own `verifier` key.
    """
    if verifier is None:
        verifier = compose_config("train", [f"draft={draft}"], checked=False).draft.verifier
    # A verifier named here is meant: the pairing check (config.check) is told so.
    return compose_config("train", [f"draft={draft}", f"verifier={verifier}", f"draft.verifier={verifier}"]).draft


def check_entry(cfg: DictConfig, prog: str) -> None:
    """check() inside a running Hydra job (an entry point's main, `prog`), with that job's choices;
    a refusal is printed and ends the process with status 2, before any work."""
    import sys

    from hydra.core.hydra_config import HydraConfig

    try:
        check(cfg, dict(HydraConfig.get().runtime.choices))
    except ConfigError as error:
        print(f"{prog}: {error}", file=sys.stderr)
        raise SystemExit(2) from None


def check(cfg: DictConfig, choices: Mapping[str, Any]) -> None:
    """Raise ConfigError naming every problem of a composed config at once."""
    problems = [f"unknown key {key!r}: no such setting (a typo? `python -m <stage> --cfg job` "
                f"lists them)" for key in unknown_keys(cfg)]
    problems += draft_pairing_problems(cfg, choices)
    if not problems:               # the rules read typed keys: only once every key is known
        from config.validate import problems as rule_problems

        problems = rule_problems(cfg)
    if problems:
        raise ConfigError("config refused: " + "; ".join(problems))


def draft_pairing_problems(cfg: DictConfig, choices: Mapping[str, Any]) -> list[str]:
    """A draft composed against a verifier it is not written for."""
    if "draft" not in cfg or "verifier" not in choices:
        return []
    written_for, chosen = cfg.draft.verifier, choices["verifier"]
    if written_for == chosen:
        return []
    draft = choices.get("draft", cfg.draft.name)
    return [f"draft={draft} is written for verifier={written_for}, but the verifier is {chosen} "
            f"(verifier={chosen}): add verifier={written_for}, or choose a draft of {chosen} "
            f"(draft={chosen}); draft.verifier={chosen} pairs them anyway"]


def unknown_keys(cfg: DictConfig) -> list[str]:
    """Dotted keys of the config that its schema does not declare (added with `+key=value`)."""
    found: list[str] = []
    _walk_unknown(cfg, "", found)
    return found


def _walk_unknown(node: DictConfig, prefix: str, found: list[str]) -> None:
    schema = OmegaConf.get_type(node)
    declared = {f.name for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else None
    for key in node.keys():
        path = f"{prefix}{key}"
        if declared is not None and key not in declared:
            found.append(path)
            continue
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not (child._is_missing() or child._is_none()
                                                   or child._is_interpolation()):
            _walk_unknown(child, path + ".", found)


# Keys added to a group after records of it were written, with what their absence meant then.
RECORDED_DEFAULTS: dict[str, dict[str, Any]] = {
    "data": {"require_answer": True,   # readers always required an answer
             "select": None},          # the file's conversations in order
}


def recorded(group: str, record: Mapping[str, Any]) -> DictConfig:
    """A conf group's config as a run recorded it (JSON), merged onto the group's schema: the
    keys it predates take RECORDED_DEFAULTS; a key the schema does not know is refused."""
    from config.stages import GROUP_SCHEMAS

    return OmegaConf.merge(OmegaConf.structured(GROUP_SCHEMAS[group]), RECORDED_DEFAULTS.get(group, {}),
                           dict(record))


def _open(cfg: DictConfig) -> Any:
    from omegaconf import open_dict

    return open_dict(cfg)
