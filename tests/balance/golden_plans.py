"""Golden plans: a fixed set of balancer inputs and the plans they gave when the snapshot was made.

The snapshot (``tests/balance/data/golden_plans.json``) pins the balancer's exact output, so a
refactor that must not change behaviour is proven bit-identical: the same indices in the same
micro-batches on the same ranks, and the same figures (floats compared exactly, via their JSON
repr). Regenerate ONLY for an intended change of the plans, and say so in the commit:

    PYTHONPATH=. python tests/balance/golden_plans.py

Cases: heavy-tailed (lognormal) and uniform lengths, several seeds, token / FLOPs / calibrated
workloads, dp 1/3/8, sp 1/2, a fixed micro_batch_size or a token cap, no groups / atomic groups
(group_scope="micro_batch") / rank-scoped groups, equal_size on and off, overlong skip/truncate,
balance off; and the verl drop-ins ``get_seqlen_balanced_partitions`` (up to 3000 items, both
of its algorithms) and ``rearrange_micro_batches`` (with force_group_size and a forced count).
"""

from __future__ import annotations

import itertools
import json
import pathlib

import numpy as np

from verl_balance.balance import FlopsWorkload, plan_balance
from verl_balance.balance.workload import CalibratedWorkload

SNAPSHOT = pathlib.Path(__file__).parent / "data" / "golden_plans.json"
FLOPS = FlopsWorkload(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, vocab_size=97)
CALIBRATED = CalibratedWorkload(micro_batch=5e-4, sequence=2e-5, token=1e-5, pair=3e-8)
TRUNC = "truncate"
WORKLOADS = {"tokens": None, "flops": FLOPS, "calibrated": CALIBRATED}


def lengths_for(profile: str, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if profile == "heavy":
        return np.clip(rng.lognormal(5.5, 1.1, n), 4, 2000).astype(np.int64)
    return rng.integers(16, 512, n).astype(np.int64)


def plan_cases() -> list[dict]:
    """Keyword arguments of plan_balance (workload by name, lengths by profile/seed/n)."""
    cases = []
    grid = itertools.product(
        (0, 1, 2),
        ("tokens", "flops", "calibrated"),
        (1, 3, 8),
        ("mbs", "cap"),
        ("none", "atomic", "rank"),
        (True, False),
    )
    for seed, workload, dp, mode, grouping, equal_size in grid:
        n = 96 if seed < 2 else 240
        case = dict(profile="heavy" if seed != 1 else "uniform", seed=seed, n=n, workload=workload, dp_size=dp)
        case["equal_size"] = equal_size
        if mode == "mbs":
            case["micro_batch_size"] = 4
        else:
            case["max_token_len_per_gpu"] = 8000 if grouping == "atomic" else 2500
        if grouping != "none":
            case["group_size"] = 4
            case["group_scope"] = "micro_batch" if grouping == "atomic" else "rank"
        cases.append(case)
    extra = [
        dict(profile="heavy", seed=3, n=200, workload="flops", dp_size=4, sp_size=2, max_token_len_per_gpu=1500),
        dict(profile="heavy", seed=4, n=64, workload="tokens", dp_size=4, max_token_len_per_gpu=600, overlong="skip"),
        dict(profile="heavy", seed=4, n=64, workload="tokens", dp_size=4, max_token_len_per_gpu=600, overlong=TRUNC),
        dict(profile="heavy", seed=5, n=64, workload="calibrated", dp_size=4, micro_batch_size=3, balance=False),
        dict(profile="heavy", seed=5, n=64, workload="flops", dp_size=4, max_token_len_per_gpu=4000, balance=False),
        dict(profile="heavy", seed=6, n=600, workload="calibrated", dp_size=8, max_token_len_per_gpu=3000),
        dict(profile="heavy", seed=7, n=512, workload="flops", dp_size=16, micro_batch_size=8),
        dict(profile="uniform", seed=8, n=90, workload="tokens", dp_size=3, max_token_len_per_gpu=5000, ragged=True),
        dict(profile="heavy", seed=9, n=97, workload="flops", dp_size=5, max_token_len_per_gpu=4000, equal_size=False),
    ]
    return cases + extra


def run_plan_case(case: dict) -> dict:
    lengths = lengths_for(case["profile"], case["n"], case["seed"])
    not_kwargs = ("profile", "seed", "n", "workload", "group_size", "ragged")
    kwargs = {k: v for k, v in case.items() if k not in not_kwargs}
    kwargs["workload"] = WORKLOADS[case["workload"]]
    if "group_size" in case:
        kwargs["group_ids"] = np.arange(case["n"]) // case["group_size"]
    if case.get("ragged"):
        kwargs["group_ids"] = np.random.default_rng(case["seed"]).integers(0, case["n"] // 3, case["n"])
    plan = plan_balance(seq_lens=lengths, **kwargs)
    return {
        "micro_batches": [[mb.tolist() for mb in rank] for rank in plan.micro_batches],
        "skipped": plan.skipped.tolist(),
        "truncated": {str(k): v for k, v in sorted(plan.truncated.items())},
        "cell_costs": plan.cell_costs.tolist(),
        "cell_tokens": plan.cell_tokens.tolist(),
        "stats": {k: (v.item() if hasattr(v, "item") else v) for k, v in plan.stats.items()},
    }


def partition_cases() -> list[dict]:
    """Inputs of the verl drop-in get_seqlen_balanced_partitions."""
    cases = []
    for seed, n, k, equal_size in itertools.product((0, 1), (16, 96, 1024), (2, 8), (True, False)):
        cases.append(dict(seed=seed, n=n, k=k, equal_size=equal_size, profile="heavy", flops=seed == 1))
    cases.append(dict(seed=2, n=3000, k=8, equal_size=False, profile="heavy", flops=True))  # deal-first path
    cases.append(dict(seed=3, n=2560, k=16, equal_size=False, profile="uniform", flops=False))
    cases.append(dict(seed=4, n=40, k=8, equal_size=False, profile="zeros", flops=False))  # empty parts filled
    return cases


def partition_input(case: dict) -> list:
    if case["profile"] == "zeros":
        values = np.zeros(case["n"], dtype=np.int64)
        values[:3] = [5, 7, 9]
        return values.tolist()
    lengths = lengths_for(case["profile"], case["n"], case["seed"])
    if case["flops"]:  # verl's calculate_workload: 24576 L + L^2
        return (24576 * lengths + lengths * lengths).tolist()
    return lengths.tolist()


def run_partition_case(case: dict) -> list[list[int]]:
    from verl_balance.integrations.verl.patches.seqlen import get_seqlen_balanced_partitions

    return get_seqlen_balanced_partitions(partition_input(case), case["k"], case["equal_size"])


def rearrange_cases() -> list[dict]:
    """Inputs of the verl drop-in rearrange_micro_batches (single process, no dp_group)."""
    cases = []
    for seed, workload, group in itertools.product((0, 1, 2), ("tokens", "flops"), (1, 2)):
        cases.append(dict(seed=seed, n=64, cap=4000, workload=workload, force_group_size=group))
    cases.append(dict(seed=3, n=48, cap=4000, workload="flops", min_num_micro_batch=9))  # forced count
    cases.append(dict(seed=4, n=48, cap=4000, workload="tokens", num_batches_divided_by=4))
    cases.append(dict(seed=5, n=40, cap=4000, workload="tokens", use_dynamic_bsz_balance=False))
    cases.append(dict(seed=6, n=30, cap=4000, workload="calibrated", min_num_micro_batch=30))  # split to singles
    return cases


def run_rearrange_case(case: dict) -> list[list[int]]:
    import torch
    from tensordict import TensorDict

    from verl_balance.integrations.verl.patches.seqlen import rearrange_micro_batches

    lengths = torch.as_tensor(lengths_for("heavy", case["n"], case["seed"]))
    mask = (torch.arange(int(lengths.max()))[None, :] < lengths[:, None]).long()
    batch = TensorDict({"attention_mask": mask, "input_ids": mask}, batch_size=[len(lengths)])
    kwargs = {k: v for k, v in case.items() if k not in ("seed", "n", "cap", "workload")}
    _, micro = rearrange_micro_batches(batch, case["cap"], workload=WORKLOADS[case["workload"]], **kwargs)
    return [list(map(int, mb)) for mb in micro]


def build_snapshot(*, with_verl: bool = True) -> dict:
    snapshot = {
        "plan_balance": [{"case": c, "plan": run_plan_case(c)} for c in plan_cases()],
        "get_seqlen_balanced_partitions": [{"case": c, "parts": run_partition_case(c)} for c in partition_cases()],
    }
    if with_verl:
        snapshot["rearrange_micro_batches"] = [{"case": c, "micro": run_rearrange_case(c)} for c in rearrange_cases()]
    return snapshot


if __name__ == "__main__":
    SNAPSHOT.parent.mkdir(parents=True, exist_ok=True)
    SNAPSHOT.write_text(json.dumps(build_snapshot(), separators=(",", ":")) + "\n")
    print(f"wrote {SNAPSHOT} ({SNAPSHOT.stat().st_size} bytes)")
