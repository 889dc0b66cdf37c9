"""Names of the ``Batch`` columns and meta keys that cross a module or process boundary.

The driver writes them and the workers (or the integration) read them, so both sides import the
names from here instead of from each other.
"""

from __future__ import annotations

MICRO_BATCH_SIZES_KEY = "micro_batch_sizes"
"""Meta key of one DP rank's chunk: its micro-batch sizes in row order (set by ``split_by_plan``);
the worker recovers its micro-batches with ``chunk.split(chunk.meta[MICRO_BATCH_SIZES_KEY])``."""

PLANNED_MICRO_BATCH_SIZES_KEY = "verl_balance/micro_batch_sizes"
"""Meta key of a whole verl ``DataProto`` reordered by a plan: one list of micro-batch sizes per
DP rank (the integration's drop-ins set it; each rank's worker takes its own list)."""

TEMPERATURE_KEY = "temperature"
"""Meta key (verl's): the sampling temperature at which old, reference and new log-probs are
taken; absent means 1."""

ON_POLICY_KEY = "on_policy"
"""Meta key of an update chunk: True when this optimizer step is the only one on rows the current
weights sampled (one PPO epoch, one mini-batch), so the PPO loss takes the old log-probs from the
update forward itself (detached) and the chunk carries no ``old_log_probs``; absent means False."""

ROLLOUT_LOG_PROBS_KEY = "rollout_log_probs"
"""Tensor column of a rollout batch: the sampler's own log-probs of the response tokens
(token-aligned like ``loss_mask``, 0 elsewhere)."""

WIRE_KEYS = (
    "input_ids",
    "attention_mask",
    "loss_mask",
    "position_ids",
    "old_log_probs",
    "advantages",
    "ref_log_prob",
    ROLLOUT_LOG_PROBS_KEY,
)
"""Tensor columns a worker hands to the engine (every other column stays on the driver side)."""

UID_KEY = "uid"
"""Non-tensor column of a rollout batch: the id of the prompt a response answers (verl's key)."""

PROMPT_IDS_KEY = "raw_prompt_ids"
"""Non-tensor column of a prompt batch: each prompt's token ids (verl's key)."""

PROMPT_INDEX_KEY = "prompt_index"
"""Column of a rollout batch: the position of the response's prompt in the step's prompt batch;
a prompt's responses form one balancing group."""

SAMPLE_INDEX_KEY = "sample_index"
"""Non-tensor column of a prompt batch: each prompt's global (dataset) index. With the call's seed it
fixes the prompt's sampling stream, so its responses do not depend on which worker samples it or
which prompts share the call (GRPO rollouts are the same on any layout)."""

__all__ = [
    "MICRO_BATCH_SIZES_KEY",
    "ON_POLICY_KEY",
    "PLANNED_MICRO_BATCH_SIZES_KEY",
    "PROMPT_IDS_KEY",
    "PROMPT_INDEX_KEY",
    "ROLLOUT_LOG_PROBS_KEY",
    "SAMPLE_INDEX_KEY",
    "TEMPERATURE_KEY",
    "UID_KEY",
    "WIRE_KEYS",
]
