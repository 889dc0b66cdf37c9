"""Names of the ``Batch`` columns and meta keys that cross a module or process boundary; library
code spells them only through these constants (tests/test_batch_keys.py scans for literals)."""

from __future__ import annotations

# ---------------------------------------------------------------------- meta keys
MICRO_BATCH_SIZES_KEY = "micro_batch_sizes"
"""Meta key of one DP rank's chunk: its micro-batch sizes in row order (``split_by_plan``)."""

PLANNED_MICRO_BATCH_SIZES_KEY = "verl_balance/micro_batch_sizes"
"""Meta key of a verl ``DataProto`` reordered by a plan: one list of micro-batch sizes per DP rank."""

TEMPERATURE_KEY = "temperature"
"""Meta key (verl's): the temperature of old, reference and new log-probs; absent means 1."""

ON_POLICY_KEY = "on_policy"
"""Meta key of an update chunk: True when PPO's old log-probs are the update forward's own."""

# ---------------------------------------------------------------------- tensor columns of a Batch row
INPUT_IDS_KEY = "input_ids"
"""Token ids [B, L], right-padded."""

ATTENTION_MASK_KEY = "attention_mask"
"""[B, L]: 1 on a row's non-empty prefix, 0 after it."""

POSITION_IDS_KEY = "position_ids"
"""[B, L]: restart at 0 per sequence, 0 on padding."""

LOSS_MASK_KEY = "loss_mask"
"""[B, L]: 1 where token t is a target (its log-prob p(tok_t | tok_<t) counts)."""

OLD_LOG_PROBS_KEY = "old_log_probs"
"""RL: log-probs of the policy that sampled the responses, token-aligned like ``loss_mask`` (0 elsewhere)."""

ADVANTAGES_KEY = "advantages"
"""RL: the advantage of each response token (token-aligned like ``loss_mask``)."""

REF_LOG_PROB_KEY = "ref_log_prob"
"""RL (verl's key): the reference policy's log-probs, for the KL loss (token-aligned like ``loss_mask``)."""

ROLLOUT_LOG_PROBS_KEY = "rollout_log_probs"
"""Rollout column: the sampler's own log-probs of the response tokens (token-aligned, 0 elsewhere)."""

ROLLOUT_IS_WEIGHTS_KEY = "rollout_is_weights"
"""RL (verl's key): the rollout correction's importance weight per token (token-aligned)."""

POLICY_VERSION_KEY = "policy_version"
"""Async rollout column (int64): the policy version (actor's completed steps) that generated the row."""

VALUES_KEY = "values"
"""PPO: the critic's values per token (the value loss's old values; a value pass's output)."""

RETURNS_KEY = "returns"
"""PPO: the GAE returns, the value loss's targets (token-aligned like ``loss_mask``)."""

LOG_PROBS_KEY = "log_probs"
"""Output column of a log-prob pass: each target token's log-prob, aligned like ``loss_mask``."""

ENTROPY_KEY = "entropy"
"""Output column of a log-prob pass (when asked for): each position's entropy, aligned like ``log_probs``."""

SUM_PI_SQUARED_KEY = "sum_pi_squared"
"""Log-prob pass output and RL column (verl's key): sum_v p(v)^2 per position at the pass's temperature."""

PROMPT_LENGTHS_KEY = "prompt_lengths"
"""Column of a rollout batch: the prompt's length in tokens (the response starts there)."""

RESPONSE_LENGTHS_KEY = "response_lengths"
"""Column of a rollout batch: the response's length in tokens."""

FINISH_REASON_KEY = "finish_reason"
"""Non-tensor column of a rollout batch: why the response ended ('stop' or 'length')."""

RESPONSE_MASK_KEY = "response_mask"
"""verl's name of the loss mask of a response (its engine backend reads either)."""

VERL_ENTROPY_KEY = "entropys"
"""verl's ``DataProto`` column of the per-token entropy (our ``entropy``)."""

WIRE_KEYS = (
    INPUT_IDS_KEY,
    ATTENTION_MASK_KEY,
    LOSS_MASK_KEY,
    POSITION_IDS_KEY,
    OLD_LOG_PROBS_KEY,
    ADVANTAGES_KEY,
    REF_LOG_PROB_KEY,
    ROLLOUT_LOG_PROBS_KEY,
    ROLLOUT_IS_WEIGHTS_KEY,
)
"""Tensor columns a worker hands to the engine (every other column stays on the driver side)."""

CRITIC_WIRE_KEYS = WIRE_KEYS + (VALUES_KEY, RETURNS_KEY)
"""Tensor columns a critic worker hands to its engine: the actor's and the value loss's."""

LOG_PROB_INPUT_KEYS = (INPUT_IDS_KEY, ATTENTION_MASK_KEY, POSITION_IDS_KEY)
"""The columns a log-prob (or value) pass reads (the worker packs every wire column it receives)."""

CRITIC_UPDATE_KEYS = LOG_PROB_INPUT_KEYS + (LOSS_MASK_KEY, VALUES_KEY, RETURNS_KEY)
"""The columns a critic update reads: the sequences, the response mask, the old values and the returns."""

# ---------------------------------------------------------------------- non-tensor columns
UID_KEY = "uid"
"""Non-tensor column of a rollout batch: the id of the prompt a response answers (verl's key)."""

PROMPT_IDS_KEY = "raw_prompt_ids"
"""Non-tensor column of a prompt batch: each prompt's token ids (verl's key)."""

PROMPT_INDEX_KEY = "prompt_index"
"""Rollout column: the position of the response's prompt in the step's prompt batch (its group)."""

INDEX_KEY = "index"
"""Prompt column from the dataset: each prompt's dataset index (verl's ``extra_info.index`` if any)."""

SAMPLE_INDEX_KEY = "sample_index"
"""Prompt column: each prompt's global index; with the call's seed it fixes the prompt's sampling stream."""

__all__ = [
    "ADVANTAGES_KEY",
    "ATTENTION_MASK_KEY",
    "CRITIC_UPDATE_KEYS",
    "CRITIC_WIRE_KEYS",
    "ENTROPY_KEY",
    "FINISH_REASON_KEY",
    "INDEX_KEY",
    "INPUT_IDS_KEY",
    "LOG_PROBS_KEY",
    "LOG_PROB_INPUT_KEYS",
    "LOSS_MASK_KEY",
    "MICRO_BATCH_SIZES_KEY",
    "OLD_LOG_PROBS_KEY",
    "ON_POLICY_KEY",
    "PLANNED_MICRO_BATCH_SIZES_KEY",
    "POLICY_VERSION_KEY",
    "POSITION_IDS_KEY",
    "PROMPT_IDS_KEY",
    "PROMPT_INDEX_KEY",
    "PROMPT_LENGTHS_KEY",
    "REF_LOG_PROB_KEY",
    "RESPONSE_LENGTHS_KEY",
    "RESPONSE_MASK_KEY",
    "RETURNS_KEY",
    "ROLLOUT_IS_WEIGHTS_KEY",
    "ROLLOUT_LOG_PROBS_KEY",
    "SAMPLE_INDEX_KEY",
    "SUM_PI_SQUARED_KEY",
    "TEMPERATURE_KEY",
    "UID_KEY",
    "VALUES_KEY",
    "VERL_ENTROPY_KEY",
    "WIRE_KEYS",
]
