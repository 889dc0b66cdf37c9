"""Cost of checkpoint checksums: hashing a checkpoint's files vs saving it.

A built-in model (default the ~100M preset) with AdamW state is saved as DCP (model + optimizer,
as ``TrainEngine.save_checkpoint`` writes it; ``--files`` shard files, like ``--files`` ranks
would write), then its files are hashed as the trainer does (``utils.checksums``): by one process,
and split over ``--files`` processes (``share_of``, as the workers share it). sha256 is shown for
comparison. The files are in the page cache right after the save, as they are when the trainer
hashes them; a resume reads them from disk first (the hash then warms the cache for the load).

    python benchmarks/checkpoint_hash_bench.py [--preset 100m] [--files 2] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import tempfile
import time
import warnings
from concurrent.futures import ProcessPoolExecutor

import torch

from verl_balance.models import LlamaForCausalLM, ModelConfig
from verl_balance.utils import checksums


def _save(model, optimizer, path: str, files: int) -> float:
    import torch.distributed.checkpoint as dcp

    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        writer = dcp.FileSystemWriter(path, thread_count=files)
        dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, storage_writer=writer, no_dist=True)
    return time.perf_counter() - start


def _hash_share(args) -> dict:
    root, sizes, rank, world = args
    return checksums.hash_files(root, checksums.share_of(sizes, rank=rank, world=world))


def _hash_parallel(root: str, world: int) -> float:
    sizes = checksums.list_files(root)
    start = time.perf_counter()
    with ProcessPoolExecutor(world) as pool:
        parts = list(pool.map(_hash_share, [(root, sizes, r, world) for r in range(world)]))
    elapsed = time.perf_counter() - start
    assert sum(len(p) for p in parts) == len(sizes)
    return elapsed


def _sha256_seconds(root: str) -> float:
    start = time.perf_counter()
    for name in checksums.list_files(root):
        digest = hashlib.sha256()
        with open(os.path.join(root, name), "rb") as f:
            while chunk := f.read(8 << 20):
                digest.update(chunk)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="100m")
    parser.add_argument("--files", type=int, default=2, help="shard files / hashing processes (the ranks)")
    parser.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temp dir)")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = LlamaForCausalLM(ModelConfig.preset(args.preset))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()  # creates exp_avg / exp_avg_sq: the checkpoint holds weights + 2 moments
    params = sum(p.numel() for p in model.parameters())
    root = tempfile.mkdtemp(prefix="hash_bench_", dir=args.dir)
    try:
        path = os.path.join(root, "global_step_1")
        save_s = _save(model, optimizer, path, args.files)
        gb = sum(checksums.list_files(path).values()) / 1e9
        start = time.perf_counter()
        manifest = checksums.build_manifest(path)
        hash_1 = time.perf_counter() - start
        hash_n = _hash_parallel(path, args.files)
        start = time.perf_counter()
        checksums.verify_manifest(path, manifest)
        verify_s = time.perf_counter() - start
        sha_s = _sha256_seconds(path)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"model {args.preset}: {params / 1e6:.1f}M params, checkpoint {gb:.2f} GB in {len(manifest)} files")
    print(f"{'what':<34} {'seconds':>8} {'/ save':>7} {'GB/s':>7}")
    rows = [
        ("save (DCP, model + AdamW)", save_s),
        ("xxh3_128, 1 process (driver)", hash_1),
        (f"xxh3_128, {args.files} processes (workers)", hash_n),
        ("verify (stat + xxh3_128, 1 proc)", verify_s),
        ("sha256, 1 process (comparison)", sha_s),
    ]
    for what, seconds in rows:
        print(f"{what:<34} {seconds:>8.2f} {seconds / save_s:>7.2f} {gb / seconds:>7.2f}")


if __name__ == "__main__":
    main()
