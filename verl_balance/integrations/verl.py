"""verl-facing adapters: drop-in balancing, ``DataProto`` <-> ``Batch``, layout-invariant loss.

Everything here is usable from an existing verl (0.9.x) pipeline without leaving verl:

- ``get_seqlen_balanced_partitions``, ``rearrange_micro_batches``, ``get_reverse_idx``: the
  signatures and return values of ``verl.utils.seqlen_balancing``'s functions, backed by
  ``verl_balance.balance``;
- ``patch_verl()``: swaps them into verl (and into every verl module that imported the names
  directly) and replaces ``RayPPOTrainer._balance_batch`` by our DP partition with a FLOPs
  workload of the actor's model; the returned handle (also a context manager) undoes it;
- ``balance_batch``: reorders a DataProto by our joint DP x micro-batch plan (for our worker);
- ``batch_from_dataproto`` / ``batch_to_dataproto`` / ``batch_from_tensordict``: conversions;
- ``loss_counts`` + ``agg_loss``: the loss contract of ``verl_balance.loss`` for verl-shaped
  ``(bs, response_length)`` loss matrices;
- ``VerlActorWorker`` (lazily, from ``verl_balance.integrations.verl_worker``): our actor as a
  verl ``Worker``.

Invariants:
- Importing this module never imports verl; functions that need verl import it when called and
  raise ``VerlNotInstalledError`` (an ImportError naming the ``verl`` extra) when it is missing.
- The drop-ins keep verl's contracts: every index appears exactly once; partitions are lists of
  ascending ints; ``equal_size`` partitions have equal counts; every micro-batch's effective token
  count is <= max_token_len; with a ``dp_group`` every DP rank gets the same number of
  micro-batches, and every fatal condition is agreed by one all-reduce before any rank raises
  (so no rank is left waiting in a collective).
- ``patch_verl`` is reversible: ``undo()`` puts back exactly the objects it replaced, and is
  idempotent; patches nest (the inner undo restores the outer patch).
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from verl_balance.balance import (
    BalanceInputError,
    FlopsWorkload,
    OverlongSampleError,
    TooFewSamplesError,
    balanced_partition,
    plan_balance,
)
from verl_balance.balance.workload import resolve_workload

__all__ = [
    "VerlNotInstalledError",
    "VerlPatch",
    "LossCounts",
    "agg_loss",
    "batch_from_dataproto",
    "batch_from_tensordict",
    "batch_to_dataproto",
    "balance_batch",
    "get_reverse_idx",
    "get_seqlen_balanced_partitions",
    "loss_counts",
    "patch_verl",
    "rearrange_micro_batches",
    "workload_from_hf_config",
]

INSTALL_HINT = "pip install 'verl-balance[verl]'"


class VerlNotInstalledError(ImportError):
    """verl is not importable; the message says how to install the extra."""


def require_verl():
    """Import and return the ``verl`` package, or raise VerlNotInstalledError."""
    try:
        import verl
    except ImportError as exc:  # pragma: no cover - exercised only without verl
        raise VerlNotInstalledError(
            f"verl_balance.integrations.verl needs verl (0.9.x), which is not importable ({exc}); "
            f"install it with: {INSTALL_HINT}"
        ) from exc
    return verl


def __getattr__(name: str):
    # VerlActorWorker subclasses verl's Worker, so it can only be defined once verl is imported.
    if name == "VerlActorWorker":
        require_verl()
        from verl_balance.integrations.verl_worker import VerlActorWorker

        return VerlActorWorker
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --------------------------------------------------------------------------- workloads
_HF_DIMENSION_NAMES = {
    "num_layers": ("num_hidden_layers", "num_layers", "n_layer"),
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "intermediate_size": ("intermediate_size", "ffn_hidden_size", "n_inner"),
    "num_heads": ("num_attention_heads", "num_heads", "n_head"),
    "num_kv_heads": ("num_key_value_heads", "num_kv_heads", "num_attention_heads", "num_heads", "n_head"),
    "vocab_size": ("vocab_size",),
}


def workload_from_hf_config(config: Any) -> FlopsWorkload:
    """FLOPs workload from a model config with Hugging Face (or ``ModelConfig``) dimension names.

    Accepts a ``transformers.PretrainedConfig``, our ``ModelConfig``, a dict or any object with the
    attributes; multimodal configs are read through ``text_config`` when they have one.
    """
    getter = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    text_config = getter("text_config", None)
    if text_config is not None and getter("hidden_size", None) is None:
        return workload_from_hf_config(text_config)
    dims = {}
    for ours, names in _HF_DIMENSION_NAMES.items():
        value = next((getter(n) for n in names if getter(n, None) is not None), None)
        if value is None:
            raise BalanceInputError(
                f"model config {type(config).__name__} has none of {list(names)}; a FLOPs workload needs "
                f"{sorted(_HF_DIMENSION_NAMES)} (pass workload='tokens' to balance by tokens instead)"
            )
        dims[ours] = int(value)
    head_dim = getter("head_dim", None)
    return FlopsWorkload(**dims, head_dim=int(head_dim) if head_dim else None)


def _workload_of_actor(trainer) -> Any:
    """FLOPs workload of the PPO actor's model (read from its local HF config), else tokens."""
    model_cfg = trainer.config.actor_rollout_ref.model
    try:
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(
            model_cfg.path, trust_remote_code=bool(model_cfg.get("trust_remote_code", False)), local_files_only=True
        )
        return workload_from_hf_config(hf_config)
    except Exception as exc:  # noqa: BLE001 - a missing/odd config must not stop training
        warnings.warn(
            f"verl_balance: could not build a FLOPs workload from actor_rollout_ref.model.path={model_cfg.path!r} "
            f"({exc}); balancing by token count instead",
            stacklevel=2,
        )
        return "tokens"


# --------------------------------------------------------------------------- drop-ins
def _as_1d_numbers(values, what: str) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    array = np.asarray(values)
    if array.ndim != 1:
        raise BalanceInputError(f"{what} must be one value per item (1-D), got shape {array.shape}")
    if array.size and (not np.all(np.isfinite(array.astype(np.float64))) or array.min() < 0):
        bad = int(np.flatnonzero(~np.isfinite(array.astype(np.float64)) | (array < 0))[0])
        raise BalanceInputError(f"{what}[{bad}] = {array[bad]!r}; valid: a finite value >= 0")
    return array


def get_seqlen_balanced_partitions(seqlen_list, k_partitions: int, equal_size: bool) -> list[list[int]]:
    """Drop-in for verl's function: ``k_partitions`` lists of ascending indices, balanced by sum.

    ``seqlen_list`` may be a list, numpy array or tensor of lengths or workloads (verl passes the
    output of ``calculate_workload``). With ``equal_size`` every partition has len / k items
    (verl requires divisibility); otherwise sizes are free, but no partition is empty.
    """
    values = _as_1d_numbers(seqlen_list, "seqlen_list")
    n, k = len(values), int(k_partitions)
    if k < 1:
        raise BalanceInputError(f"k_partitions={k_partitions!r}; valid: an integer >= 1")
    if n < k:
        raise TooFewSamplesError(f"number of items {n} < k_partitions {k}; valid: at least k_partitions items")
    if equal_size and n % k:
        raise TooFewSamplesError(
            f"equal_size=True needs len(seqlen_list) divisible by k_partitions; got {n} items and k={k}"
        )
    parts = [np.asarray(p, dtype=np.int64) for p in balanced_partition(costs=values.astype(np.float64), num_parts=k,
                                                                         equal_size=bool(equal_size))]
    if not equal_size:
        parts = _fill_empty_parts(parts, values)
    assert sorted(np.concatenate(parts).tolist()) == list(range(n)), "partition lost or duplicated an index"
    return [sorted(int(i) for i in p) for p in parts]


def _fill_empty_parts(parts: list[np.ndarray], values: np.ndarray) -> list[np.ndarray]:
    """verl asserts every partition is non-empty; zero-cost items may leave one empty: give it the
    cheapest item of the part with the most items (n >= k guarantees a donor with >= 2 items)."""
    parts = [p.copy() for p in parts]
    for i, part in enumerate(parts):
        if len(part):
            continue
        donor = max(range(len(parts)), key=lambda j: (len(parts[j]), -j))
        cheapest = parts[donor][np.argmin(values[parts[donor]])]
        parts[donor] = parts[donor][parts[donor] != cheapest]
        parts[i] = np.array([cheapest], dtype=np.int64)
    return parts


def get_reverse_idx(idx_map):
    """Drop-in for verl's function: ``out[idx_map[i]] = i`` (a list, like verl's).

    Unlike verl it checks that idx_map is a permutation of 0..n-1 (verl silently returns a wrong
    map otherwise, which scrambles restored log-probs)."""
    idx = np.asarray(idx_map.tolist() if isinstance(idx_map, torch.Tensor) else list(idx_map), dtype=np.int64)
    n = len(idx)
    if n and (idx.min() < 0 or idx.max() >= n or np.unique(idx).size != n):
        raise BalanceInputError(f"idx_map must be a permutation of 0..{n - 1}; got {idx.tolist()[:16]}...")
    reverse = np.empty(n, dtype=np.int64)
    reverse[idx] = np.arange(n)
    return reverse.tolist()


def _effective_seq_lens(batch) -> np.ndarray:
    input_ids = batch["input_ids"]
    if getattr(input_ids, "is_nested", False):
        return input_ids.offsets().diff().cpu().numpy().astype(np.int64)
    return batch["attention_mask"].sum(dim=1).cpu().numpy().astype(np.int64)


def _reduce_device(group) -> torch.device:
    import torch.distributed as dist

    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _split_heaviest(micro: list[list[int]], costs: np.ndarray, unit: int) -> list[list[int]]:
    """Split the costliest micro-batch with >= 2 units into two by alternating its units in
    descending cost. Splitting never raises a micro-batch's token count, so the cap still holds."""
    candidates = [i for i, mb in enumerate(micro) if len(mb) >= 2 * unit]
    assert candidates, "caller checked that there are at least as many units as micro-batches"
    heaviest = max(candidates, key=lambda i: (costs[micro[i]].sum(), -i))
    members = np.asarray(micro[heaviest], dtype=np.int64).reshape(-1, unit)
    order = np.argsort(-costs[members].sum(axis=1), kind="stable")
    first, second = members[order[0::2]].ravel(), members[order[1::2]].ravel()
    micro = micro[:heaviest] + micro[heaviest + 1:]
    return micro + [sorted(first.tolist()), sorted(second.tolist())]


def rearrange_micro_batches(
    batch,
    max_token_len,
    dp_group=None,
    num_batches_divided_by=None,
    same_micro_num_in_dp=True,
    min_num_micro_batch=None,
    use_dynamic_bsz_balance=True,
    force_group_size=1,
    *,
    workload=None,
):
    """Drop-in for verl's function: split a TensorDict into token-capped micro-batches.

    Returns ``(micro_batches, micro_bsz_idx)`` like verl: a list of TensorDicts and, for each, the
    ascending list of the sample indices it holds. Effective lengths come from ``attention_mask``
    (or the nested ``input_ids`` offsets); every micro-batch holds <= max_token_len of them.
    ``force_group_size`` consecutive samples stay in one micro-batch. With ``dp_group`` and
    ``same_micro_num_in_dp`` the count is the maximum over the DP group, rounded up to
    ``num_batches_divided_by`` and at least ``min_num_micro_batch``. ``workload`` (ours, keyword
    only): None/"tokens" or a FlopsWorkload; the default set by ``patch_verl(workload=...)``.
    """
    import torch.distributed as dist

    require_verl()
    cost_model = resolve_workload(workload if workload is not None else _PATCH_STATE.workload)
    seq_lens = _effective_seq_lens(batch)
    n = len(seq_lens)
    unit = int(force_group_size)
    if unit < 1 or n % unit:
        raise BalanceInputError(f"batch size {n} must be divisible by force_group_size={force_group_size}")
    max_token_len = int(max_token_len)
    num_units = n // unit
    unit_tokens = seq_lens.reshape(num_units, unit).sum(axis=1)
    group_ids = None if unit == 1 else np.repeat(np.arange(num_units), unit)

    local_count = 0
    if num_units and unit_tokens.max() <= max_token_len:
        plan = plan_balance(seq_lens=seq_lens, dp_size=1, max_token_len_per_gpu=max_token_len, group_ids=group_ids,
                            workload=cost_model, equal_size=False)
        local_micro = [mb.tolist() for mb in plan.micro_batches[0] if len(mb)]
        local_count = len(local_micro)
    target = max(local_count, int(min_num_micro_batch or 0))
    longest_unit = int(unit_tokens.max()) if num_units else 0
    fewest_units = num_units
    if dist.is_available() and dist.is_initialized() and same_micro_num_in_dp and dp_group is not None:
        # One MAX all-reduce agrees on the count and on every fatal condition, so either all DP
        # ranks raise or none does (a lone raise would leave the others hanging in the next collective).
        agreed = torch.tensor([target, longest_unit, -fewest_units], dtype=torch.int64, device=_reduce_device(dp_group))
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=dp_group)
        target, longest_unit, fewest_units = int(agreed[0]), int(agreed[1]), -int(agreed[2])
    if num_batches_divided_by:
        target = -(-target // int(num_batches_divided_by)) * int(num_batches_divided_by)
    if longest_unit > max_token_len:
        what = "sample" if unit == 1 else f"group of {unit} samples"
        raise OverlongSampleError(
            f"a {what} on some DP rank has {longest_unit} tokens > max_token_len={max_token_len}; "
            "valid: raise ppo_max_token_len_per_gpu (max_token_len = per-GPU cap * sp size)"
        )
    if target > fewest_units:
        raise TooFewSamplesError(
            f"{target} micro-batches are needed on every DP rank, but some rank has only {fewest_units} "
            f"{'samples' if unit == 1 else 'groups'}; valid: a larger batch or a larger max_token_len"
        )

    costs = cost_model.cost(seq_lens)
    micro = local_micro if local_count else []
    if len(micro) < target:
        micro = _micro_batches_for_count(seq_lens, costs, target, max_token_len, unit, micro)
    assert len(micro) == target and sorted(sum(micro, [])) == list(range(n)), "micro-batches lost an index"
    assert all(seq_lens[mb].sum() <= max_token_len for mb in micro), "micro-batch over max_token_len"

    if use_dynamic_bsz_balance:
        # verl's order: heaviest first, then the light ones moved to both ends (pipeline bubbles).
        micro.sort(key=lambda mb: (costs[mb].sum(), mb[0] if mb else 0), reverse=True)
        micro = micro[::2][::-1] + micro[1::2]

    from verl.utils import tensordict_utils as tu

    return [tu.index_select_tensor_dict(batch, mb) for mb in micro], micro


def _micro_batches_for_count(seq_lens, costs, target, cap, unit, fallback) -> list[list[int]]:
    """Exactly ``target`` non-empty capped micro-batches: a balanced target-way partition of the
    units (groups of ``unit`` consecutive samples) if it respects the cap, else the capped plan
    with its heaviest micro-batches split."""
    unit_costs = costs.reshape(-1, unit).sum(axis=1)
    parts = _fill_empty_parts(balanced_partition(costs=unit_costs, num_parts=target, equal_size=False), unit_costs)
    micro = [sorted((part[:, None] * unit + np.arange(unit)).ravel().tolist()) for part in parts]
    if all(seq_lens[mb].sum() <= cap for mb in micro):
        return micro
    micro = list(fallback) if fallback else [list(range(len(seq_lens)))]
    while len(micro) < target:
        micro = _split_heaviest(micro, costs, unit)
    return micro


# --------------------------------------------------------------------------- trainer balance
def balance_batch(
    batch,
    *,
    dp_size: int,
    workload=None,
    micro_batch_size: int | None = None,
    max_token_len_per_gpu: int | None = None,
    sp_size: int = 1,
    group_key: str | None = None,
    mini_batch_size: int | None = None,
) -> dict[str, float]:
    """Reorder a DataProto in place with our joint DP x micro-batch plan; returns metrics.

    After reordering, verl's equal DP chunking gives rank r exactly the plan's rows for r, in its
    micro-batch order. ``meta_info["verl_balance/micro_batch_sizes"]`` (one list per DP rank)
    lets a worker that honours it (ours) reuse the planned micro-batches. With
    ``mini_batch_size`` each consecutive mini-batch is planned separately and rank r's share of
    every mini-batch stays contiguous (verl's keep_minibatch). ``group_key`` (e.g. "uid") keeps
    rows with the same id on one rank.
    """
    seq_lens = batch.batch["attention_mask"].reshape(len(batch), -1).sum(-1).cpu().numpy().astype(np.int64)
    n = len(seq_lens)
    if micro_batch_size is None and max_token_len_per_gpu is None:
        micro_batch_size = n  # DP balance only: one micro-batch per rank
    group_ids = None if group_key is None else np.asarray(batch.non_tensor_batch[group_key])
    spans = [(0, n)] if not mini_batch_size else [(s, min(s + mini_batch_size, n)) for s in range(0, n, mini_batch_size)]
    rank_rows: list[list[int]] = [[] for _ in range(dp_size)]
    rank_sizes: list[list[int]] = [[] for _ in range(dp_size)]
    stats: dict[str, float] = {}
    for start, stop in spans:
        plan = plan_balance(
            seq_lens=seq_lens[start:stop], dp_size=dp_size, sp_size=sp_size, micro_batch_size=micro_batch_size,
            max_token_len_per_gpu=max_token_len_per_gpu, group_ids=None if group_ids is None else group_ids[start:stop],
            workload=workload, equal_size=True,
        )
        sizes = {len(plan.rank_indices(r)) for r in range(dp_size)}
        if len(sizes) != 1:
            raise TooFewSamplesError(
                f"rows {start}..{stop} cannot be split into {dp_size} equal DP chunks (rank sizes {sorted(sizes)}); "
                "verl dispatches equal chunks: make the (mini-)batch size a multiple of dp_size (x group size)"
            )
        for r in range(dp_size):
            rank_rows[r].extend((plan.rank_indices(r) + start).tolist())
            rank_sizes[r].extend(int(s) for s in plan.micro_batch_sizes(r))
        for key in ("imbalance", "naive_imbalance", "sync_ratio", "naive_sync_ratio"):
            stats[key] = max(stats.get(key, 0.0), float(plan.stats[key]))
    order = torch.tensor([i for rows in rank_rows for i in rows], dtype=torch.long)
    assert sorted(order.tolist()) == list(range(n)), "balance plan lost or duplicated a row"
    batch.reorder(order)
    batch.meta_info["verl_balance/micro_batch_sizes"] = rank_sizes
    return {f"verl_balance/{k}": v for k, v in stats.items()}


def _balanced_balance_batch(self, batch, metrics, logging_prefix="global_seqlen", keep_minibatch=False):
    """Replacement for ``RayPPOTrainer._balance_batch`` (same signature) using ``balance_batch``."""
    from verl.utils.seqlen_balancing import log_seqlen_unbalance

    actor_cfg = self.config.actor_rollout_ref.actor
    dp_size = self._get_dp_size(self.actor_rollout_wg, "actor")
    if _PATCH_STATE.workload is not None:
        workload = _PATCH_STATE.workload
    else:
        if getattr(self, "_verl_balance_workload", None) is None:
            self._verl_balance_workload = _workload_of_actor(self)
        workload = self._verl_balance_workload
    seqlens_before = batch.batch["attention_mask"].reshape(len(batch), -1).sum(-1).tolist()
    group_key = "uid" if getattr(self, "use_prefix_grouper", False) and "uid" in batch.non_tensor_batch else None
    mini = None
    if keep_minibatch:
        mini = int(actor_cfg.ppo_mini_batch_size) * int(self.config.actor_rollout_ref.rollout.n)
    # DP assignment only: verl's workers re-split their chunk into micro-batches themselves
    # (rearrange_micro_batches, ours once patched), so a planned micro-batch layout would be dropped.
    stats = balance_batch(batch, dp_size=dp_size, workload=workload, group_key=group_key, mini_batch_size=mini)
    # verl's metrics, computed on the reordered batch: partition r is rows [r*n/dp, (r+1)*n/dp).
    n = len(batch)
    chunks = [list(range(r * n // dp_size, (r + 1) * n // dp_size)) for r in range(dp_size)]
    seqlens_after = batch.batch["attention_mask"].reshape(n, -1).sum(-1).tolist()
    verl_stats = log_seqlen_unbalance(seqlen_list=seqlens_after, partitions=chunks, prefix=logging_prefix)
    # verl's min/max/minmax_diff describe the input order (before balancing).
    before = log_seqlen_unbalance(seqlen_list=seqlens_before, partitions=chunks, prefix=logging_prefix)
    for key in ("min", "max", "minmax_diff", "mean"):
        verl_stats[f"{logging_prefix}/{key}"] = before[f"{logging_prefix}/{key}"]
    metrics.update(verl_stats)
    metrics.update(stats)


# --------------------------------------------------------------------------- patching
@dataclass
class _PatchState:
    workload: Any = None
    stack: list = field(default_factory=list)


_PATCH_STATE = _PatchState()

_FUNCTION_TARGETS = {
    "get_seqlen_balanced_partitions": (
        "verl.utils.seqlen_balancing",
        "verl.trainer.ppo.ray_trainer",
        "verl.trainer.sft_trainer_ray",
        "verl.trainer.ppo.v1.trainer_base",
    ),
    "rearrange_micro_batches": ("verl.utils.seqlen_balancing", "verl.workers.engine.utils"),
    "get_reverse_idx": ("verl.utils.seqlen_balancing",),
}


class VerlPatch:
    """Handle returned by ``patch_verl``: ``undo()`` (idempotent) or use it as a context manager.

    ``patched`` lists ``module.attribute`` strings that were replaced; ``skipped`` the target
    modules that could not be imported (optional verl parts, e.g. without transfer_queue)."""

    def __init__(self, workload) -> None:
        self.patched: list[str] = []
        self.skipped: dict[str, str] = {}
        self._saved: list[tuple[Any, str, Any]] = []
        self._previous_workload = _PATCH_STATE.workload
        self._workload = workload
        self.active = False

    def _set(self, owner, name: str, value) -> None:
        self._saved.append((owner, name, owner.__dict__[name]))
        setattr(owner, name, value)
        self.patched.append(f"{getattr(owner, '__module__', '')}.{getattr(owner, '__name__', owner)}.{name}"
                            if isinstance(owner, type) else f"{owner.__name__}.{name}")

    def undo(self) -> None:
        """Restore every replaced attribute to the object it held before this patch."""
        if not self.active:
            return
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()
        _PATCH_STATE.workload = self._previous_workload
        if self in _PATCH_STATE.stack:
            _PATCH_STATE.stack.remove(self)
        self.active = False

    def __enter__(self) -> VerlPatch:
        return self

    def __exit__(self, *exc) -> None:
        self.undo()


def patch_verl(*, workload=None, balance_trainer: bool = True) -> VerlPatch:
    """Swap our balancer into verl in this process; returns a handle whose ``undo()`` reverts it.

    Replaces ``get_seqlen_balanced_partitions``, ``rearrange_micro_batches`` and
    ``get_reverse_idx`` in ``verl.utils.seqlen_balancing`` and in every verl module that imported
    them by name, and (``balance_trainer``) ``RayPPOTrainer._balance_batch``. ``workload``: None
    (trainer: FLOPs of the actor's model config; micro-batching: tokens), "tokens", or a
    FlopsWorkload. To patch Ray workers too, run it in every process, e.g. with
    ``ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=verl_balance.integrations.verl.patch_verl``.
    """
    require_verl()
    if workload is not None:
        resolve_workload(workload)  # validate early
    handle = VerlPatch(workload)
    replacements = {
        "get_seqlen_balanced_partitions": get_seqlen_balanced_partitions,
        "rearrange_micro_batches": rearrange_micro_batches,
        "get_reverse_idx": get_reverse_idx,
    }
    for name, module_names in _FUNCTION_TARGETS.items():
        for module_name in module_names:
            module = _import_optional(module_name, handle)
            if module is not None and name in module.__dict__:
                handle._set(module, name, replacements[name])
    if balance_trainer:
        module = _import_optional("verl.trainer.ppo.ray_trainer", handle)
        if module is not None:
            handle._set(module.RayPPOTrainer, "_balance_batch", _balanced_balance_batch)
    _PATCH_STATE.workload = workload
    _PATCH_STATE.stack.append(handle)
    handle.active = True
    return handle


def _import_optional(module_name: str, handle: VerlPatch):
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        handle.skipped[module_name] = str(exc)
        return None


# --------------------------------------------------------------------------- conversions
def batch_from_dataproto(data) -> Any:
    """``DataProto`` -> ``Batch`` sharing the tensors; non-tensor columns and meta_info carried over.

    A DataProto without tensors (``batch=None``) becomes a Batch with an empty TensorDict of the
    same length; ``batch_to_dataproto`` maps it back to ``batch=None``."""
    from tensordict import TensorDict

    from verl_balance.protocol import Batch

    tensors = data.batch if data.batch is not None else TensorDict({}, batch_size=[len(data)])
    return Batch(tensors=tensors, non_tensors=dict(data.non_tensor_batch or {}), meta=dict(data.meta_info or {}))


def batch_to_dataproto(batch) -> Any:
    """``Batch`` -> ``DataProto`` (a Batch without tensor columns gets ``batch=None``, as verl does)."""
    require_verl()
    from verl import DataProto

    tensors = batch.tensors if len(batch.tensor_keys) else None
    return DataProto(batch=tensors, non_tensor_batch=dict(batch.non_tensors), meta_info=dict(batch.meta))


def batch_from_tensordict(data) -> Any:
    """A verl 0.9 TensorDict (its ``DataProto.to_tensordict`` / no-padding layout) -> ``Batch``.

    Dense tensors stay columns, ``NonTensorStack`` entries become non-tensor columns and
    ``NonTensorData`` entries become meta. Jagged (nested) tensors are right-padded with 0, and an
    ``attention_mask`` is built from the nested ``input_ids`` lengths when absent."""
    from tensordict import NonTensorData, NonTensorStack

    from verl_balance.protocol import Batch

    tensors, non_tensors, meta = {}, {}, {}
    lengths = None
    for key in list(data.keys()):
        value = data.get(key)
        if isinstance(value, NonTensorStack):
            column = np.empty(len(value), dtype=object)
            for i, item in enumerate(value):
                column[i] = item.data if isinstance(item, NonTensorData) else item
            non_tensors[key] = column
        elif isinstance(value, NonTensorData):
            meta[key] = value.data
        elif isinstance(value, torch.Tensor) and value.is_nested:
            if key == "input_ids":
                lengths = value.offsets().diff()
            tensors[key] = torch.nested.to_padded_tensor(value, 0)
        elif isinstance(value, torch.Tensor):
            tensors[key] = value
        else:
            meta[key] = value
    if lengths is not None and "attention_mask" not in tensors:
        width = tensors["input_ids"].shape[1]
        tensors["attention_mask"] = (torch.arange(width)[None, :] < lengths[:, None].cpu()).long()
    return Batch(tensors=tensors, non_tensors=non_tensors, meta=meta)


# --------------------------------------------------------------------------- loss
@dataclass(frozen=True)
class LossCounts:
    """Global counts of one mini-batch: N (loss tokens) and S (sequences with >= 1 loss token)."""

    num_tokens: int
    num_sequences: int


def loss_counts(loss_masks: Sequence[torch.Tensor] | torch.Tensor, *, dp_group=None) -> LossCounts:
    """N and S over the whole mini-batch: every local micro-batch, all-reduced (SUM) over ``dp_group``.

    Pass full (unsliced) ``(bs, response_length)`` masks of all of this rank's micro-batches, once
    per mini-batch. The reduction is over the DP group only: SP ranks of one DP group hold the
    same sequences, so a world reduction would count every token sp times (the SP-halved loss)."""
    from verl_balance.loss import sequence_token_counts

    masks = [loss_masks] if isinstance(loss_masks, torch.Tensor) else list(loss_masks)
    device = masks[0].device if masks else torch.device("cpu")
    totals = torch.zeros(2, dtype=torch.int64, device=device)
    for mask in masks:
        rows, width = mask.shape
        cu_seqlens = torch.arange(rows + 1, device=mask.device) * width
        per_sequence = sequence_token_counts(mask.reshape(-1), cu_seqlens)
        totals += torch.stack([per_sequence.sum(), (per_sequence > 0).sum()]).to(device)
    import torch.distributed as dist

    if dp_group is not None and dist.is_initialized() and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=dp_group)
    return LossCounts(num_tokens=int(totals[0]), num_sequences=int(totals[1]))


def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str, *, counts: LossCounts,
             grad_scale: float = 1.0, loss_scale_factor: float | None = None) -> torch.Tensor:
    """Layout-invariant replacement for verl's ``core_algos.agg_loss`` on one micro-batch.

    Returns ``grad_scale * sum(w * loss_mat)`` with the contract weights w of ``verl_balance.loss``
    (token-mean m/N, seq-mean-token-mean m/(n_i S), seq-mean-token-sum m/S,
    seq-mean-token-sum-norm m/(S C)), N and S from ``loss_counts`` over the whole mini-batch.
    ``grad_scale`` is G, the number of ranks the gradient reduction averages over for disjoint
    data (verl's FSDP: its ``dp_size``); back-propagate the result. The logged loss is the SUM of
    the unscaled values over all micro-batches and DP ranks, identical for every layout.
    """
    from verl_balance.loss import LossConfigError, check_agg_mode

    check_agg_mode(loss_agg_mode)
    if loss_agg_mode == "seq-mean-token-sum-norm" and not (loss_scale_factor and loss_scale_factor > 0):
        raise LossConfigError(f"loss_scale_factor={loss_scale_factor!r}; seq-mean-token-sum-norm needs a positive constant")
    mask = (loss_mask > 0).to(loss_mat.dtype)
    # max(., 1) only avoids 0/0: a zero count means every mask it covers is zero too.
    if loss_agg_mode == "token-mean":
        weights = mask / max(counts.num_tokens, 1)
    elif loss_agg_mode == "seq-mean-token-mean":
        per_sequence = mask.sum(-1, keepdim=True).clamp(min=1)
        weights = mask / (per_sequence * max(counts.num_sequences, 1))
    elif loss_agg_mode == "seq-mean-token-sum":
        weights = mask / max(counts.num_sequences, 1)
    else:
        weights = mask / (max(counts.num_sequences, 1) * float(loss_scale_factor))
    return grad_scale * (weights * loss_mat).sum()

