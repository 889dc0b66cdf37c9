"""SFT driver: dataloader -> BalancePlan per step -> actor worker group -> metrics/checkpoints.

One optimizer step per global mini-batch of ``data.train_batch_size`` samples. The plan places
every sample on a DP rank and a micro-batch; the engine normalises the loss over the whole
mini-batch (loss contract), so the logged loss does not depend on the layout or the plan.
"""

from __future__ import annotations

import logging
import os
import time

from verl_balance.data.loader import StatefulDataLoader
from verl_balance.data.sft_dataset import SFTDataConfig as DatasetConfig
from verl_balance.data.sft_dataset import SFTDataset
from verl_balance.data.synthetic import write_dataset
from verl_balance.data.tokenizer import build_tokenizer
from verl_balance.trainer import cluster, common
from verl_balance.trainer.metrics import plan_metrics, reduce_rank_metrics
from verl_balance.trainer.driver import DriverBase
from verl_balance.trainer.config import validate_sft
from verl_balance.workers.actor import ActorWorkerConfig

logger = logging.getLogger(__name__)


def resolve_data_files(cfg) -> tuple[list | str, list | str | None]:
    """The configured files, or a generated synthetic task under ``default_local_dir/data``."""
    d = cfg.data
    if d.train_files is not None:
        return d.train_files, d.val_files
    out_dir = d.synthetic.out_dir or os.path.join(cfg.trainer.default_local_dir, "data")
    train = os.path.join(out_dir, "sft_train.parquet")
    val = os.path.join(out_dir, "sft_val.parquet")
    if not (os.path.exists(train) and os.path.exists(val)):
        print(f"[data] data.train_files is null: generating the synthetic task into {out_dir}", flush=True)
        write_dataset(out_dir=out_dir, num_train=d.synthetic.num_train, num_val=d.synthetic.num_val,
                      seed=d.synthetic.seed, progress=True)
    return train, (d.val_files if d.val_files is not None else val)


class SFTTrainer(DriverBase):
    """Builds data, workers and trackers from a validated config; ``fit()`` trains."""

    def __init__(self, cfg) -> None:
        validate_sft(cfg)
        self.cfg = cfg
        t = cfg.trainer
        self.sp = cfg.ulysses_sequence_parallel_size
        self.world = t.nnodes * t.n_gpus_per_node
        self.dp = self.world // self.sp
        self.out_dir = t.default_local_dir
        os.makedirs(self.out_dir, exist_ok=True)

        self.tokenizer = build_tokenizer(cfg.model.tokenizer)
        train_files, val_files = resolve_data_files(cfg)
        ds_cfg = DatasetConfig(prompt_key=cfg.data.prompt_key, response_key=cfg.data.response_key,
                               messages_key=cfg.data.messages_key, max_length=cfg.data.max_length,
                               truncation=cfg.data.truncation, on_malformed=cfg.data.on_malformed)
        self.train_set = SFTDataset(files=train_files, tokenizer=self.tokenizer, config=ds_cfg)
        self.val_set = SFTDataset(files=val_files, tokenizer=self.tokenizer, config=ds_cfg) if val_files else None
        self.loader = StatefulDataLoader(self.train_set, batch_size=cfg.data.train_batch_size,
                                         collate_fn=self.train_set.collate, shuffle=cfg.data.shuffle,
                                         seed=t.seed, drop_last=True)
        self.total_steps = t.total_training_steps or t.total_epochs * len(self.loader)

        self.model_config = common.build_model_config(cfg.model, vocab_size=self.tokenizer.vocab_size)
        self.workload = common.build_workload(cfg.balance.workload, self.model_config)
        self.token_cap = cfg.data.max_token_len_per_gpu if cfg.data.use_dynamic_bsz else None
        engine_config = common.engine_config_from(cfg, total_steps=self.total_steps,
                                                  loss_agg_mode=cfg.loss_agg_mode,
                                                  loss_scale_factor=cfg.loss_scale_factor, seed=t.seed)
        cluster.start_ray(address=t.ray_address, num_workers=self.world)
        use_gpu = cluster.resolve_use_gpu(t.device)
        print(f"[trainer] {self.world} {'GPU' if use_gpu else 'CPU'} workers: dp={self.dp} x sp={self.sp}; "
              f"model {cfg.model.name} ({self.model_config.num_layers} layers, hidden "
              f"{self.model_config.hidden_size}); {len(self.train_set)} train samples, "
              f"{self.total_steps} steps", flush=True)
        self.actor = cluster.build_actor_group(
            worker_config=ActorWorkerConfig(model=self.model_config, engine=engine_config, sp_size=self.sp),
            trainer_cfg=t, use_gpu=use_gpu)
        self.global_step = 0
        self._stop_requested = False

    # ------------------------------------------------------------------ steps
    def _plan(self, batch):
        return common.plan_for(batch, dp_size=self.dp, sp_size=self.sp,
                               micro_batch_size=self.cfg.data.micro_batch_size_per_gpu, token_cap=self.token_cap,
                               balance_cfg=self.cfg.balance, workload=self.workload)

    def train_step(self, tensors: dict) -> dict:
        """One optimizer step on one global mini-batch; returns the step's metrics."""
        start = time.perf_counter()
        batch = common.to_batch(tensors)
        plan = self._plan(batch)
        per_rank = self.actor.update_actor(common.dispatch_chunks(batch, plan))
        metrics = {**reduce_rank_metrics(per_rank, prefix="train/"), **plan_metrics(plan)}
        elapsed = time.perf_counter() - start
        tokens = int(batch["attention_mask"].sum())
        metrics.update({"timing_s/step": elapsed, "perf/tokens_per_s": tokens / elapsed,
                        "perf/tokens": tokens, "train/epoch": float(self.loader.epoch)})
        return metrics

    def evaluate(self) -> dict:
        """Loss over the whole validation set as one mini-batch: the exact token/sequence mean."""
        if self.val_set is None:
            return {}
        batch = common.to_batch(self.val_set.collate([self.val_set[i] for i in range(len(self.val_set))]))
        plan = self._plan(batch)
        per_rank = self.actor.eval_loss(common.dispatch_chunks(batch, plan))
        return {"val/loss": float(per_rank[0]["loss"]), "val/valid_tokens": float(per_rank[0]["valid_tokens"])}

    def summarize(self, *, first: dict, last: dict, first_val: dict, last_val: dict) -> dict:
        out = {"first_loss": first.get("train/loss"), "final_loss": last.get("train/loss")}
        if "val/loss" in last_val:
            out["val/loss"] = last_val["val/loss"]
        return out


def format_summary(summary: dict) -> str:
    """The end-of-run lines a user reads: loss first -> last, eval loss, where the files are."""
    lines = ["", "==== SFT summary ===="]
    lines.append(f"steps: {summary['steps']} in {summary['wall_s']:.1f} s")
    if summary.get("first_loss") is not None:
        lines.append(f"train loss: first {summary['first_loss']:.4f} -> final {summary['final_loss']:.4f}")
    if "val/loss" in summary:
        lines.append(f"eval loss: {summary['val/loss']:.4f}")
    lines.append(f"metrics: {summary['metrics']}")
    if summary.get("plot"):
        lines.append(f"plot: {summary['plot']}")
    return "\n".join(lines)


__all__ = ["SFTTrainer", "format_summary"]
