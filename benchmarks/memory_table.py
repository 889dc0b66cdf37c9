"""Print the per-rank memory tables of docs/performance.md ("Memory model") from verl_balance/memory.py.

    PYTHONPATH=. python benchmarks/memory_table.py > /tmp/tables.md

Qwen2.5-7B / 32B / 72B on 8 GPUs (W = dp x sp = 8), bf16 compute with fp32 master weights, AdamW.
"fits" keeps 10% of the device free (CUDA context, NCCL buffers, allocator fragmentation); device
sizes are what the driver reports: H100 80 GB = 79.6 GiB, H200 141 GB = 140.4 GiB.
"""

from __future__ import annotations

from verl_balance.memory import GiB, MemoryLayout, MemoryModelError, check_layout, estimate, load_shapes

MODELS = ("qwen2.5-7b", "qwen2.5-32b", "qwen2.5-72b")
TOKENS = (8192, 16384, 32768)
DEVICES = {"80 GB": 79.6, "141 GB": 140.4}
HEADROOM = 0.1
HEAD_CHUNK = 2048
GPUS = 8


def _g(n: int) -> str:
    return f"{n / GiB:.1f}"


def _fits(total: int) -> str:
    return " / ".join("yes" if total <= (1 - HEADROOM) * gib * GiB else "no" for gib in DEVICES.values())


def _sp_sizes(shapes) -> list[int]:
    sizes = []
    for sp in (1, 2, 4, 8):
        try:
            check_layout(shapes, MemoryLayout(dp=GPUS // sp, sp=sp))
            sizes.append(sp)
        except MemoryModelError:
            pass
    return sizes


def state_table() -> list[str]:
    lines = [
        "| model | parameters | sp allowed (W=8) | params + grads + AdamW / rank | "
        "unsharded params + grads in flight | start-up, full fp32 per rank (old) | start-up, sharded |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in MODELS:
        shapes = load_shapes(name)
        est = estimate(shapes, MemoryLayout(dp=GPUS, tokens=1))
        lines.append(
            f"| {name} | {shapes.num_params / 1e9:.2f}B | {', '.join(map(str, _sp_sizes(shapes)))} | {_g(est.state)} | "
            f"{_g(est.unsharded_params + est.unsharded_grads)} | {_g(est.startup_full)} | {_g(est.startup_sharded)} |"
        )
    return lines


def step_table() -> list[str]:
    lines = [
        f"| model | tokens / rank | longest sequence at sp = 1/2/4/8 | activations AC off / on | head unchunked / "
        f"chunk {HEAD_CHUNK} | total AC off | total AC on | fits 80 / 141 GB, AC off | fits 80 / 141 GB, AC on |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in MODELS:
        shapes = load_shapes(name)
        sps = _sp_sizes(shapes)
        for tokens in TOKENS:
            off, on = (
                estimate(
                    shapes,
                    MemoryLayout(dp=GPUS, tokens=tokens, activation_checkpointing=ac, head_chunk=HEAD_CHUNK),
                )
                for ac in (False, True)
            )
            unchunked = estimate(shapes, MemoryLayout(dp=GPUS, tokens=tokens)).head
            longest = "/".join(f"{tokens * sp // 1024}k" if sp in sps else "-" for sp in (1, 2, 4, 8))
            lines.append(
                f"| {name} | {tokens} | {longest} | {_g(off.activations)} / {_g(on.activations)} | "
                f"{_g(unchunked)} / {_g(off.head)} | {_g(off.total)} | {_g(on.total)} | {_fits(off.total)} | "
                f"{_fits(on.total)} |"
            )
    return lines


if __name__ == "__main__":
    print("\n".join(state_table()))
    print()
    print("\n".join(step_table()))
