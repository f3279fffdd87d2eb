"""The recipe checks of `roll train rlvr`, made before a model is loaded: by the plan
(`roll validate`, `--dry-run`) and again when the run prepares. Each error names the recipe
key to change."""

from __future__ import annotations

from pathlib import Path

from roll_core.config.rlvr import RLVRConfig
from roll_core.data import is_local_path, load_rows
from roll_core.errors import ConfigError
from roll_core.models import check_chat_template_choice
from roll_core.rewards.router import check_dataset_domains


def check_algorithm(cfg: RLVRConfig) -> None:
    """Algorithm choices this pipeline cannot run, as recipe errors (no model is loaded)."""
    algo = cfg.algorithm
    if algo.uses_critic and cfg.critic is None:
        raise ConfigError(
            "algorithm.adv_estimator=gae (the ppo preset) needs a critic, and the recipe has "
            "no `critic:` section.",
            hint="Add a `critic:` section to the recipe (`critic: {optim: {lr: 1.0e-5}}`, or "
            "`critic: {}` for the defaults; on the command line `critic.optim.lr=1e-5`), or "
            "use a critic-free estimator: grpo, dr_grpo, rloo, reinforce_plus_plus.",
        )
    if algo.needs_groups and cfg.rollout.n < 2:
        raise ConfigError(
            f"algorithm.adv_estimator={algo.adv_estimator} compares the samples of a group, "
            f"but rollout.n is {cfg.rollout.n}.",
            hint="Set rollout.n to 2 or more (8 is common), or use adv_estimator=reinforce_plus_plus.",
        )


def check_chat_template(cfg: RLVRConfig) -> None:
    """`data.chat_template` against the tokenizer's files (no model or tokenizer is loaded):
    a missing template file, or `model` with a tokenizer that has no template, is a
    ConfigError at validation instead of a failure at run time."""
    check_chat_template_choice(
        cfg.data.chat_template,
        key="data.chat_template",
        tokenizer_name=cfg.model.tokenizer or cfg.model.path,
    )


def check_data_domains(cfg: RLVRConfig) -> None:
    """The domains of local data against the reward sections, before any model or reward is
    built (`roll validate`, the dry run): a row whose domain has no reward, or a row without
    a domain when `reward.default_domain` is unset, is the ConfigError `prepare` would raise.
    Hub data (not downloaded here) and local paths that do not exist yet are left to the run."""
    sources = {"data.train.path": cfg.data.train, "data.eval.path": cfg.data.eval}
    rows = {}
    for key, source in sources.items():
        if source is None or not is_local_path(source.path):
            continue
        if Path(source.path).expanduser().exists():
            rows[key] = load_rows(
                source.path,
                split=source.split,
                subset=source.subset,
                max_rows=source.max_rows,
                key=key,
            )
    checks = [("reward", cfg.reward, list(rows))]  # as in `prepare`: all data, then eval's
    if cfg.eval.reward is not None and "data.eval.path" in rows:
        checks.append(("eval.reward", cfg.eval.reward, ["data.eval.path"]))
    for name, section, keys in checks:
        for key in keys:
            data, column = rows[key], section.domain_key
            values = data[column] if column in data.column_names else [None]
            check_dataset_domains(
                values,
                domains=section.domains,
                default_domain=section.default_domain,
                domain_key=column,
                where=f"{sources[key].path} ({key}, scored by {name})",  # type: ignore[union-attr]
            )
