"""verl's spellings of the recipes' keys: one table, applied to the merged config.

Each ``VerlKey`` is a verl key the typed schemas do not declare:
- ``honoured``: its value is written into ``target``, our key of the same meaning;
- ``no_effect``: accepted, removed and named once in the start-up line with its reason (with
  ``schema_when``: a declared key only one backend reads, reset to its default for the others).

``values``, when set, are the only values accepted. Two spellings of one key with different values
are refused naming both. ``docs/verl_keys.md`` is ``python -m verl_balance.trainer.config.verl_keys``.
"""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from verl_balance.trainer.config.checks import ConfigError
from verl_balance.trainer.config.typed import instantiate_section

__all__ = [
    "VERL_KEYS",
    "VerlKey",
    "command_line",
    "docs_table",
    "lookup",
    "startup_line",
    "target_of",
    "translate",
    "undeclared_leaves",
]

RECIPES = ("grpo", "sft")
AR = "actor_rollout_ref"


@dataclass(frozen=True)
class VerlKey:
    """One verl key (``pattern``: a dotted key, ``*`` for any part) and what our recipes do with it."""

    pattern: str
    status: str
    """'honoured' (written into target) or 'no_effect' (accepted, named at start-up)."""
    reason: str
    target: str | None = None
    """Our key; a target ending in ``*`` takes the key's tail (a key under a free dict)."""
    values: tuple[str, ...] | None = None
    """The only values accepted (compared case-insensitively); None = any."""
    recipes: tuple[str, ...] = RECIPES
    group: bool = False
    """A choice of verl's Hydra config group (``engine=fsdp``): a command-line word, not a key."""
    schema_when: tuple[str, str] | None = None
    """(key, value): a declared key only runs with that value read (vLLM's keys); elsewhere a non-default
    value is named without effect, checked as that run would, and reset to the schema's default."""

    def __post_init__(self) -> None:
        assert self.status in ("honoured", "no_effect"), self.status
        assert (self.target is not None) == (self.status == "honoured"), self.pattern
        assert not (self.group and self.target), self.pattern
        assert not (self.schema_when and ("*" in self.pattern or self.group)), self.pattern


def _honoured(pattern: str, target: str, reason: str, *, values=None, recipes=RECIPES) -> VerlKey:
    return VerlKey(pattern, "honoured", reason, target=target, values=values, recipes=recipes)


def _none(
    patterns: Sequence[str], reason: str, *, values=None, recipes=RECIPES, group=False, schema_when=None
) -> list[VerlKey]:
    return [
        VerlKey(p, "no_effect", reason, values=values, recipes=recipes, group=group, schema_when=schema_when)
        for p in patterns
    ]


def _reward_manager_keys() -> list[VerlKey]:
    """verl's reward manager keys (naive/dapo, overlong shaping), ``reward.*`` and legacy ``reward_model.*``."""
    ours = "custom_reward_function"
    manager = "verl's reward manager: naive, or dapo (the score plus DAPO's overlong penalty)"
    keys = [
        _honoured(f"{prefix}", f"{ours}.reward_manager", manager, values=("naive", "dapo"), recipes=("grpo",))
        for prefix in ("reward.reward_manager.name", "reward_model.reward_manager")
    ]
    for kwargs in ("reward.reward_kwargs", "reward_model.reward_kwargs"):
        keys += [
            _honoured(
                f"{kwargs}.overlong_buffer_cfg.{name}",
                f"{ours}.overlong_buffer.{name}",
                "DAPO's overlong penalty (the dapo reward manager)",
                recipes=("grpo",),
            )
            for name in ("enable", "len", "penalty_factor", "log")
        ]
        keys.append(
            _honoured(f"{kwargs}.max_resp_len", f"{ours}.max_resp_len", "DAPO's overlong penalty", recipes=("grpo",))
        )
    return keys


_FALSE = ("false",)
_VLLM = (
    "a vLLM engine setting, read with rollout.name=vllm only; rollout.name is auto, kv_cache (the built-in "
    "model), hf (an HF model directory, a PyTorch decoder with its own KV cache) or vllm (an HF model directory "
    "on an in-process vLLM engine): the engine runs on the actor's workers (the rollout workers with "
    "trainer.v1.trainer_mode=separate_async)"
)
_WITH_VLLM = (f"{AR}.rollout.name", "vllm")
_SGLANG = "an SGLang/vLLM engine setting that the vllm backend does not read (one in-process engine per worker)"
_FSDP = "the engine is FSDP2 over each data-parallel group"
_ACTOR_LOGPROB = "the reference log-probs run on the actor's engine, with the actor's FSDP settings"
_CHUNKED = "the output head is always chunked (model.logits_chunk_size), log-probs and entropy alike"

VERL_KEYS: tuple[VerlKey, ...] = (
    # -- honoured: verl's spelling of one of our keys
    _honoured("data.max_response_length", f"{AR}.rollout.response_length", "verl's spelling", recipes=("grpo",)),
    _honoured(f"{AR}.rollout.prompt_length", "data.max_prompt_length", "verl's spelling", recipes=("grpo",)),
    _honoured(
        f"{AR}.*.fsdp_config.ulysses_sequence_parallel_size",
        f"{AR}.actor.ulysses_sequence_parallel_size",
        "one Ulysses degree for the actor and its reference passes",
        recipes=("grpo",),
    ),
    _honoured(
        "ulysses_sequence_parallel_size",
        f"{AR}.actor.ulysses_sequence_parallel_size",
        "the SFT recipe's spelling",
        recipes=("grpo",),
    ),
    _honoured(
        "reward.custom_reward_function.path", "custom_reward_function.path", "verl's newer spelling", recipes=("grpo",)
    ),
    _honoured(
        "reward.custom_reward_function.name", "custom_reward_function.name", "verl's newer spelling", recipes=("grpo",)
    ),
    _honoured(
        "engine.ulysses_sequence_parallel_size",
        "ulysses_sequence_parallel_size",
        "sft_trainer's spelling",
        recipes=("sft",),
    ),
    _honoured("model.use_remove_padding", "use_remove_padding", "sft_trainer's spelling", recipes=("sft",)),
    _honoured("model.partial_pretrain", "model.path", "sft_trainer's spelling", recipes=("sft",)),
    _honoured(
        "data.multiturn.messages_key", "data.messages_key", "verl's legacy fsdp_sft_trainer spelling", recipes=("sft",)
    ),
    *_none(
        ["data.multiturn.enable"],
        "verl's legacy switch to chat data: here each file is read as chats from data.messages_key (unset: its "
        "'messages' column when it has one), else from data.prompt_key/data.response_key",
        values=("true", "false"),
        recipes=("sft",),
    ),
    _honoured(
        "data.multiturn.tools_key", "data.tools_key", "verl's legacy fsdp_sft_trainer spelling", recipes=("sft",)
    ),
    *_none(
        ["data.multiturn.enable_thinking_key"],
        "verl's multi-turn dataset passes a row's enable_thinking to the chat template; here the template's default",
        recipes=("sft",),
    ),
    _honoured("optim.lr_warmup_steps_ratio", "optim.warmup_steps_ratio", "verl's spelling", recipes=("sft",)),
    _honoured(
        "optim.lr_decay_style", "optim.lr_scheduler", "verl's spelling", values=("constant", "cosine"), recipes=("sft",)
    ),
    _honoured(
        "optim.warmup_style",
        "optim.lr_scheduler",
        "verl's older spelling",
        values=("constant", "cosine"),
        recipes=("sft",),
    ),
    _honoured(
        "ray_kwargs.ray_init.*",
        "ray_kwargs.ray_init.*",
        "passed to ray.init (trainer/cluster.py start_ray) over our arguments, runtime_env key by key; "
        "null values left out as in verl; a key ray.init does not take is refused",
    ),
    # -- no effect here: the engine, the device, the rollout
    *_none(
        [f"{AR}.rollout.multi_turn.use_inference_chat_template"],
        "each turn continues the recorded token ids (verl's false); re-rendering the chat is not done here",
        values=_FALSE,
        recipes=("grpo",),
    ),
    *_none(
        [f"{AR}.rollout.multi_turn.num_repeat_rollouts"],
        "verl's trainer reads it nowhere; rollout.n sets the responses per prompt",
        recipes=("grpo",),
    ),
    *_none(
        [f"{AR}.rollout.multi_turn.interaction_config_path"],
        "older verl's interaction agents (a simulated user's turns) are not run; only tool turns",
        values=("null", "none"),
        recipes=("grpo",),
    ),
    *_none(
        ["engine", "optim"],
        "sft_trainer's config group of the FSDP engine; " + _FSDP,
        values=("fsdp",),
        recipes=("sft",),
        group=True,
    ),
    *_none(["model"], "sft_trainer's config group of an HF model", values=("hf_model",), recipes=("sft",), group=True),
    *_none([f"{AR}.actor.strategy", f"{AR}.ref.strategy", "engine.strategy"], _FSDP, values=("fsdp", "fsdp2")),
    *_none(
        [
            "engine.tensor_model_parallel_size",
            "engine.pipeline_model_parallel_size",
            "engine.expert_model_parallel_size",
        ],
        "Megatron parallelism; " + _FSDP,
        recipes=("sft",),
    ),
    *_none(
        [
            "engine.use_mbridge",
            "engine.vanilla_mbridge",
            "engine.use_megatron_fsdp",
            "engine.override_transformer_config.*",
            f"{AR}.*.megatron.*",
        ],
        "read by verl's Megatron engine only; " + _FSDP,
    ),
    *_none(
        [f"{AR}.*.fsdp_config.fsdp_size", "engine.fsdp_size"], _FSDP + " (fsdp_size=-1); hybrid sharding is not built"
    ),
    *_none(
        [f"{AR}.ref.fsdp_config.{k}" for k in ("param_offload", "optimizer_offload", "offload_policy")],
        _ACTOR_LOGPROB + " (actor_rollout_ref.actor.fsdp_config.param_offload offloads it)",
        recipes=("grpo",),
    ),
    *_none(
        [f"{AR}.model.enable_activation_offload"],
        "activation offload is not built; see model.enable_gradient_checkpointing",
        recipes=("grpo",),
    ),
    *_none(
        [f"{AR}.*.fsdp_config.{k}" for k in ("forward_prefetch", "use_orig_params", "model_dtype")]
        + [f"{AR}.actor.fsdp_config.turbo_config.*", f"{AR}.ref.fsdp_config.turbo_config.*"],
        "FSDP1/turbo engine setting; " + _FSDP,
        recipes=("grpo",),
    ),
    *_none([f"{AR}.ref.fsdp_config.reshard_after_forward"], _ACTOR_LOGPROB, recipes=("grpo",)),
    *_none(
        [f"{AR}.*.fsdp_config.mixed_precision.reduce_dtype"],
        "gradients are reduced in fp32; model.param_dtype sets the compute dtype",
        values=("fp32", "float32"),
        recipes=("grpo",),
    ),
    *_none(
        [f"{AR}.*.entropy_checkpointing", f"{AR}.*.entropy_from_logits_with_chunking", f"{AR}.*.fsdp_config.entropy_*"]
        + [f"{AR}.model.use_fused_kernels"],
        _CHUNKED,
        recipes=("grpo",),
    ),
    *_none(
        [f"{AR}.actor.use_torch_compile", f"{AR}.ref.use_torch_compile"],
        "the engine runs eagerly (no torch.compile)",
        recipes=("grpo",),
    ),
    *_none([f"{AR}.nccl_timeout"], "worker calls are bounded by trainer.worker_call_timeout_s", recipes=("grpo",)),
    *_none(
        [
            f"{AR}.rollout.{k}"
            for k in (
                "gpu_memory_utilization",
                "enable_chunked_prefill",
                "enable_prefix_caching",
                "enforce_eager",
                "free_cache_engine",
                "max_model_len",
                "max_num_batched_tokens",
                "load_format",
                "dtype",
                "seed",
            )
        ],
        _VLLM,
        recipes=("grpo",),
        schema_when=_WITH_VLLM,
    ),
    *_none(
        [f"{AR}.rollout.tensor_model_parallel_size"],
        "every rollout worker runs one vLLM engine of its own (tensor parallel size 1; an engine across workers "
        "is not built)",
        recipes=("grpo",),
    ),
    *_none(
        [
            f"{AR}.rollout.{k}"
            for k in ("layered_summon", "multi_stage_wake_up", "checkpoint_engine.*", "engine_kwargs.*", "mode")
        ],
        _SGLANG,
        recipes=("grpo",),
    ),
    *_none(
        [f"{AR}.rollout.calculate_log_probs"],
        "the old log-probs come from the actor (recompute_old_log_prob)",
        recipes=("grpo",),
    ),
    *_none([f"{AR}.rollout.ignore_eos"], "generation stops at the tokenizer's EOS", values=_FALSE, recipes=("grpo",)),
    *_none(
        [f"{AR}.rollout.top_k"],
        "top-k sampling is off (rollout.name=vllm reads it)",
        values=("-1", "0"),
        recipes=("grpo",),
        schema_when=_WITH_VLLM,
    ),
    *_none([f"{AR}.rollout.val_kwargs.top_k"], "top-k sampling is off", values=("-1", "0"), recipes=("grpo",)),
    *_none(
        [f"{AR}.rollout.val_kwargs.do_sample"], "rollout.val_kwargs.temperature decides (0 = greedy)", recipes=("grpo",)
    ),
    *_none(
        [f"{AR}.actor.calculate_sum_pi_squared"],
        "the old log-prob pass computes sum pi^2 whenever algorithm.adv_estimator is optimal_token_baseline or "
        "tir_optimal_token_baseline, its only readers (verl needs the key set for them)",
        recipes=("grpo",),
    ),
    *_none(
        ["algorithm.filter_groups.max_inflight_gen_batches"],
        "dynamic sampling generates one whole prompt batch at a time until the train batch is full or "
        "algorithm.filter_groups.max_num_gen_batches is reached (the DAPO recipe's loop); verl's V1 replay "
        "buffer, which reads this key, refills prompt by prompt with up to this many train batches in flight",
        recipes=("grpo",),
    ),
    *_none([f"{AR}.actor.optim.optimizer"], "the optimizer is AdamW", values=("adamw",), recipes=("grpo",)),
    *_none(
        [f"{AR}.actor.optim.lr_warmup_steps"],
        "warm-up is set by optim.warmup_steps_ratio",
        values=("-1", "0"),
        recipes=("grpo",),
    ),
    *_none(
        ["optim.min_lr", "optim.lr_warmup_init"],
        "the schedule decays to optim.min_lr_ratio x lr from 0 warm-up",
        recipes=("sft",),
    ),
    *_none(
        [f"critic.fsdp.{k}" for k in ("fsdp_size", "forward_prefetch", "use_orig_params", "model_dtype")]
        + ["critic.fsdp.wrap_policy.*"],
        "FSDP1/hybrid-sharding setting; " + _FSDP,
        recipes=("grpo",),
    ),
    *_none(
        ["model.trust_remote_code", f"{AR}.model.trust_remote_code", "data.trust_remote_code"],
        "no remote code runs: the supported model families are built in",
    ),
    # -- data, reward, checkpoint, Ray
    *_none(
        [
            "data.filter_overlong_prompts_workers",
            "data.return_raw_chat",
            "data.pad_mode",
            "data.ignore_input_ids_mismatch",
        ],
        "the prompt dataset filters and packs in the driver (no padding)",
    ),
    *_none(
        ["data.custom_cls.path", "data.custom_cls.name"],
        "the prompt dataset is our RLHFDataset equivalent; custom dataset classes are not loaded",
        values=("null", "none", "rlhfdataset"),
    ),
    *_none(["data.image_key", "data.image_patch_size"], "text-only models: image columns are not read"),
    *_none(
        ["data.apply_chat_template_kwargs.reasoning_effort"],
        "the chat template renders with its own defaults (gpt-oss's reasoning_effort is medium); "
        "other apply_chat_template_kwargs are refused",
        values=("medium",),
        recipes=("grpo",),
    ),
    *_none(["checkpoint.save_contents"], "checkpoints always hold the model, the optimizer and the trainer state"),
    *_none(
        ["reward.num_workers"],
        "rewards are scored in the driver (custom_reward_function.timeout_s bounds a call)",
        recipes=("grpo",),
    ),
    *_reward_manager_keys(),
    *_none(
        ["reward.reward_model.enable"],
        "reward models are not built; rewards are rule-based",
        values=_FALSE,
        recipes=("grpo",),
    ),
    *_none(["reward.reward_model.*"], "read only with reward.reward_model.enable=true", recipes=("grpo",)),
    *_none(["distillation.enabled"], "on-policy distillation is not built", values=_FALSE, recipes=("grpo",)),
    *_none(["distillation.*"], "read only with distillation.enabled=true", recipes=("grpo",)),
    *_none(
        ["ray_kwargs.timeline_json_file"], "Ray's timeline is not written; trainer.profile_steps traces the workers"
    ),
)


def lookup(key: str, *, recipe: str) -> VerlKey | None:
    """The registry's entry for ``key`` in ``recipe`` ('grpo' or 'sft'), or None."""
    for entry in VERL_KEYS:
        if recipe in entry.recipes and fnmatch.fnmatchcase(key, entry.pattern):
            return entry
    return None


def _split(arg: str) -> tuple[str, str]:
    key, _, value = arg.partition("=")
    return key.lstrip("+"), value


def _norm(value: Any) -> str:
    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value, resolve=True)
    return str(value).strip().strip("'\"").lower()


def _same(a: Any, b: Any) -> bool:
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (a, b))
    return float(a) == float(b) if numbers else _norm(a) == _norm(b)


def _check_value(key: str, value: Any, entry: VerlKey) -> None:
    if entry.values is not None and _norm(value) not in entry.values:
        raise ConfigError(
            f"{key}={value}: this project accepts only {list(entry.values)} here ({entry.reason}); "
            "set one of them or remove the key"
        )


def target_of(key: str, entry: VerlKey) -> str:
    """Our key for ``key``: the entry's target; a target ending in ``*`` takes the key's tail."""
    if not entry.target.endswith("*"):
        return entry.target
    return entry.target.rstrip("*") + key[len(entry.pattern.rstrip("*")) :]


def command_line(args: Sequence[str], *, recipe: str) -> tuple[list[str], list[str]]:
    """(the command line with the table's keys written ``++key=value`` and verl's config-group choices
    removed; those choices). Nothing is translated here."""
    out: list[str] = []
    groups: list[str] = []
    for given in args:
        key, value = _split(given)
        entry = lookup(key, recipe=recipe) if "=" in given and not given.startswith("-") else None
        if entry is None:
            out.append(given)
        elif entry.group:
            _check_value(key, value, entry)
            groups.append(key)
        else:
            out.append(f"++{key}={value}")
    return out, groups


def _is_section(node: Any) -> bool:
    return isinstance(node, DictConfig) and not node._is_none() and dataclasses.is_dataclass(OmegaConf.get_type(node))


def _leaves(parent: DictConfig, key: Any, path: tuple) -> list[tuple[tuple, Any]]:
    node = parent._get_node(key)
    if isinstance(node, DictConfig) and not node._is_none() and not node._is_missing() and len(node):
        return [leaf for k in node.keys() for leaf in _leaves(node, k, (*path, k))]
    value = parent[key]
    return [(path, OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value)]


def undeclared_leaves(cfg: DictConfig, path: tuple = ()) -> list[tuple[tuple, Any]]:
    """(key path, value) of every undeclared leaf; the schema's free dicts and lists are values, not walked."""
    declared = {f.name for f in dataclasses.fields(OmegaConf.get_type(cfg))}
    out: list[tuple[tuple, Any]] = []
    for key in cfg.keys():
        if key not in declared:
            out += _leaves(cfg, key, (*path, key))
        elif _is_section(cfg._get_node(key)):
            out += undeclared_leaves(cfg._get_node(key), (*path, key))
    return out


def _disagree(first: str, first_value: Any, second: str, second_value: Any) -> ConfigError:
    return ConfigError(
        f"{first}={first_value!r} and {second}={second_value!r} disagree: two spellings of one key set to "
        "different values; set one of them"
    )


def _write(cfg: DictConfig, key: str, value: Any, target: str, *, written: dict, defaults) -> None:
    """``value`` of verl's ``key`` into our ``target``; ConfigError when the target holds another user-set value."""
    if target in written:
        if not _same(written[target][1], value):
            raise _disagree(*written[target], key, value)
        return
    current = OmegaConf.select(cfg, target, default=None)
    user_set = all(not _same(current, OmegaConf.select(d, target, default=None)) for d in defaults)
    if current is not None and user_set and not _same(current, value):
        raise _disagree(target, current, key, value)
    try:
        OmegaConf.update(cfg, target, value, merge=True)
    except OmegaConfBaseException as err:
        raise ConfigError(f"{key}={value!r} (our {target}): {err.msg}") from None
    written[target] = (key, value)


def _remove(cfg: DictConfig, path: tuple) -> None:
    """Delete the key at ``path`` and each parent it leaves empty that no typed section declares."""
    while path:
        parent = cfg
        for part in path[:-1]:
            parent = parent._get_node(part)
        if _is_section(parent) and path[-1] in {f.name for f in dataclasses.fields(OmegaConf.get_type(parent))}:
            return
        with open_dict(parent):
            del parent[path[-1]]
        if len(parent) or _is_section(parent):
            return
        path = path[:-1]


def translate(cfg: DictConfig, *, recipe: str, defaults: Sequence[DictConfig] = ()) -> tuple[DictConfig, list[str]]:
    """(a copy of ``cfg`` with honoured verl keys written as ours and the table's keys removed, the
    no-effect keys). ConfigError on a refused value or two spellings of one key with different values."""
    out = copy.deepcopy(cfg)
    no_effect: list[str] = []
    written: dict[str, tuple[str, Any]] = {}
    for path, value in undeclared_leaves(cfg):
        key = ".".join(map(str, path))
        entry = lookup(key, recipe=recipe)
        if entry is None:
            continue
        _check_value(key, value, entry)
        if entry.status == "no_effect":
            no_effect.append(key)
        else:
            _write(out, key, value, target_of(key, entry), written=written, defaults=defaults)
        _remove(out, path)
    return out, no_effect + _unread_schema_keys(out, recipe=recipe, defaults=defaults)


def _unread_schema_keys(cfg: DictConfig, *, recipe: str, defaults: Sequence[DictConfig]) -> list[str]:
    """The user-set ``schema_when`` keys ``cfg``'s run does not read, checked and put back to the first default."""
    unread: list[str] = []
    schema = OmegaConf.get_type(cfg)
    if not defaults and dataclasses.is_dataclass(schema):
        defaults = (OmegaConf.structured(schema),)
    if not defaults:
        return unread  # no schema to tell a set value from a default
    for entry in VERL_KEYS:
        if entry.schema_when is None or recipe not in entry.recipes:
            continue
        when_key, when_value = entry.schema_when
        value = OmegaConf.select(cfg, entry.pattern, default=None)
        if value is None or _norm(OmegaConf.select(cfg, when_key, default=None)) == when_value:
            continue
        if any(_same(value, OmegaConf.select(d, entry.pattern, default=None)) for d in defaults):
            continue
        _check_value(entry.pattern, value, entry)
        _check_as_read(entry, value, schema=schema)
        unread.append(entry.pattern)
        OmegaConf.update(cfg, entry.pattern, OmegaConf.select(defaults[0], entry.pattern), merge=True)
    return unread


def _check_as_read(entry: VerlKey, value: Any, *, schema: type) -> None:
    """ConfigError when ``value`` fails the check of the run that reads ``entry``'s key: the key's
    section at the schema's defaults, with the ``schema_when`` key at its value and this key at ``value``."""
    section, _, leaf = entry.pattern.rpartition(".")
    when_section, _, when_leaf = entry.schema_when[0].rpartition(".")
    assert when_section == section, (entry.pattern, entry.schema_when)
    if not dataclasses.is_dataclass(schema):
        return
    probe = copy.deepcopy(OmegaConf.select(OmegaConf.structured(schema), section))
    OmegaConf.update(probe, when_leaf, entry.schema_when[1])
    OmegaConf.update(probe, leaf, value)
    instantiate_section(probe, section)


def startup_line(no_effect: Sequence[str], *, recipe: str) -> str | None:
    """One line naming each no-effect key once, with its reason; None when there is none."""
    if not no_effect:
        return None
    by_reason: dict[str, list[str]] = {}
    for key in dict.fromkeys(no_effect):
        by_reason.setdefault(lookup(key, recipe=recipe).reason, []).append(key)
    parts = [f"{', '.join(keys)} ({reason})" for reason, keys in by_reason.items()]
    return "verl keys accepted with no effect here: " + "; ".join(parts)


MEANING_DIFFERS = (
    (
        f"{AR}.actor.policy_loss.loss_mode",
        "clip_cov, kl_cov",
        "the covariance of advantage and log-prob, its means, the token count and the top-k are over the whole "
        "mini-batch (every micro-batch of every DP / SP rank), so the loss is layout-invariant; verl takes them "
        "over each micro-batch. Equal when a mini-batch is one micro-batch on one rank. clip_cov's uniform draw "
        "hashes (sequence, position, step), not verl's randperm",
    ),
    (
        f"{AR}.actor.policy_loss.loss_mode",
        "bypass_mode",
        "rollout_is_batch_normalize's mean is over the whole mini-batch (verl: the micro-batch, all-reduced over "
        "DP). With loss_agg_mode=seq-mean-token-mean and token-level rollout_rs a sequence's loss is divided by "
        "all its response tokens (the loss contract's count), verl divides by its kept ones. Only the "
        "rollout_corr/rollout_is_mean and rollout_rs_masked_fraction metrics are logged",
    ),
)
"""Schema keys of verl's name whose meaning differs from verl's here (listed in the docs table)."""


def docs_table() -> str:
    """``docs/verl_keys.md``: every registry entry with its status, recipes and reason."""
    lines = [
        "# verl keys beyond the schemas",
        "",
        "Generated by `python -m verl_balance.trainer.config.verl_keys > docs/verl_keys.md` from",
        "`verl_balance/trainer/config/verl_keys.py`; do not edit. Keys of verl's example scripts that",
        "our schemas do not declare, on the command line, in a YAML file or in a mapping given to",
        "`from_hydra` alike: `honoured` keys are written into our key of the same meaning (two spellings",
        "with different values are refused naming both); `no effect` keys are accepted and named once in",
        "the start-up line with the reason. A key with listed values refuses any other value, naming the",
        "key and these values. A key marked `our key, read with K=V` is declared by the schema and read",
        "only in a run with K=V; in any other run a value other than its default is named without effect",
        "(its listed values, if any, then apply) and put back to the default.",
        "",
        "| verl key | recipes | status | values | our key / reason |",
        "| --- | --- | --- | --- | --- |",
    ]
    for e in VERL_KEYS:
        status = "honoured" if e.status == "honoured" else "no effect"
        if e.schema_when:
            status = f"our key, read with `{e.schema_when[0]}={e.schema_when[1]}`; else no effect"
        values = ", ".join(e.values) if e.values else "any"
        what = f"`{e.target}` ({e.reason})" if e.target else e.reason
        lines.append(f"| `{e.pattern}` | {', '.join(e.recipes)} | {status} | {values} | {what} |")
    lines += ["", "## Declared verl keys whose meaning differs from verl's", "", "| verl key | value | here |"]
    lines += ["| --- | --- | --- |"]
    lines += [f"| `{key}` | {value} | {note} |" for key, value, note in MEANING_DIFFERS]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(docs_table())
