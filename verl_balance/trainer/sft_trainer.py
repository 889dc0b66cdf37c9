"""SFT driver: dataloader -> BalancePlan per step -> actor worker group -> metrics/checkpoints.

One optimizer step per global mini-batch of ``data.train_batch_size`` samples; the loss contract
makes the logged loss independent of the layout and the plan.
"""

from __future__ import annotations

import logging
import os
import time

from verl_balance.batch_keys import ATTENTION_MASK_KEY
from verl_balance.data.io import DataError, as_file_list
from verl_balance.data.sft_dataset import DEFAULT_MESSAGES_KEY, SFTDataset, chat_column
from verl_balance.protocol import Batch
from verl_balance.trainer.config.sections import check_profile_steps, resolve_data_files
from verl_balance.trainer.config.sft import validate_sft
from verl_balance.trainer.driver import DriverBase
from verl_balance.trainer.metrics import SFT_TOKENS_KEY, TOKENS_PER_S_KEY, plan_metrics, reduce_rank_metrics
from verl_balance.trainer.plan_dispatch import plan_batch, split_by_plan
from verl_balance.trainer.startup import check_model_files
from verl_balance.workers.actor import ActorWorkerConfig

logger = logging.getLogger(__name__)


def _chat_key(data) -> str | None:
    """The key the chat-template check names when some sample is read as a chat, else None (checked before Ray)."""
    config = data.dataset_config()
    paths = list(dict.fromkeys(_listed_files(data.train_files) + _listed_files(data.val_files)))
    prompt_response = [path for path in paths if chat_column(config, path=path) is None]
    if prompt_response:
        logger.info(
            "data.messages_key is unset and %s %s no %r column: training prompt/response from "
            "data.prompt_key=%r / data.response_key=%r",
            ", ".join(prompt_response),
            "has" if len(prompt_response) == 1 else "have",
            DEFAULT_MESSAGES_KEY,
            config.prompt_key,
            config.response_key,
        )
    # The synthetic task (train_files null) writes a messages column.
    if data.train_files is not None and len(prompt_response) == len(paths):
        return None
    if data.messages_key is not None:
        return "data.messages_key"
    return f"data.messages_key={DEFAULT_MESSAGES_KEY} (verl's default)"


def _listed_files(files) -> list[str]:
    """The readable data files among ``files``; missing or unsupported ones are left to the dataset to name."""
    listed = [] if files is None else [files] if isinstance(files, (str, os.PathLike)) else list(files)
    paths = []
    for file in listed:
        try:
            paths += as_file_list(file)
        except DataError:
            pass
    return paths


class SFTTrainer(DriverBase):
    """Builds data, workers and trackers from a validated config; ``fit()`` trains."""

    def __init__(self, cfg) -> None:
        self.config = config = validate_sft(cfg)
        check_model_files(config.model, chat_key=_chat_key(config.data))
        self.setup_run(cfg, config=config, model=config.model)
        train_files, val_files = resolve_data_files(
            config.data, kind="sft", default_local_dir=config.trainer.default_local_dir
        )
        dataset_config = config.data.dataset_config()
        self.train_set = SFTDataset(files=train_files, tokenizer=self.tokenizer, config=dataset_config)
        self.val_set = (
            SFTDataset(files=val_files, tokenizer=self.tokenizer, config=dataset_config) if val_files else None
        )
        if config.data.use_dynamic_bsz and config.balance.overlong == "error":
            # Every length is known at load time: an over-long sample fails now, naming its file and
            # row, instead of at the step whose plan first meets it.
            for dataset in (self.train_set, self.val_set):
                if dataset is not None:
                    dataset.check_token_cap(
                        config.data.max_token_len_per_gpu, sp_size=self.sp, key="data.max_token_len_per_gpu"
                    )
        self.setup_loader(self.train_set, batch_size=config.data.train_batch_size, shuffle=config.data.shuffle)
        self.token_cap = config.data.max_token_len_per_gpu if config.data.use_dynamic_bsz else None
        check_profile_steps(trainer=config.trainer, total_steps=self.total_steps)
        self.start_workers(
            worker_config=ActorWorkerConfig(
                model=self.model_config,
                engine=config.engine_config(total_steps=self.total_steps),
                sp_size=self.sp,
                **self.export_options(),
            ),
            description=(
                f"{config.model.describe(self.model_config)}; {len(self.train_set)} train samples, "
                f"{self.total_steps} steps"
            ),
        )

    # ------------------------------------------------------------------ steps
    def plan_mini_batch(self, batch: Batch):
        """The BalancePlan of one global mini-batch (DP ranks x micro-batches)."""
        return plan_batch(
            batch,
            dp_size=self.dp,
            sp_size=self.sp,
            micro_batch_size=self.config.data.micro_batch_size_per_gpu,
            token_cap=self.token_cap,
            balance=self.config.balance_enabled,
            workload=self.workload,
            overlong=self.config.balance.overlong,
        )

    def train_step(self, tensors: dict) -> dict:
        """One optimizer step on one global mini-batch; returns the step's metrics."""
        start = time.perf_counter()
        batch = Batch.from_dict(tensors=tensors)
        plan = self.plan_mini_batch(batch)
        per_rank = self.actor.update_actor(split_by_plan(batch, plan))
        metrics = {**reduce_rank_metrics(per_rank, prefix="train/"), **plan_metrics(plan)}
        elapsed = time.perf_counter() - start
        tokens = int(batch[ATTENTION_MASK_KEY].sum())
        metrics.update(
            {
                "timing_s/step": elapsed,
                TOKENS_PER_S_KEY: tokens / elapsed,
                SFT_TOKENS_KEY: tokens,
                "train/epoch": float(self.loader.epoch),
            }
        )
        return metrics

    def evaluate(self) -> dict:
        """Loss over the whole validation set as one mini-batch: the exact token/sequence mean."""
        if self.val_set is None:
            return {}
        batch = Batch.from_dict(tensors=self.val_set.collate([self.val_set[i] for i in range(len(self.val_set))]))
        plan = self.plan_mini_batch(batch)
        per_rank = self.actor.eval_loss(split_by_plan(batch, plan))
        return {"val/loss": float(per_rank[0]["loss"]), "val/valid_tokens": float(per_rank[0]["valid_tokens"])}

    def summarize(self, *, first: dict, last: dict, first_val: dict, last_val: dict) -> dict:
        """First/final train loss and the last validation loss."""
        out = {"first_loss": first.get("train/loss"), "final_loss": last.get("train/loss")}
        if "val/loss" in last_val:
            out["val/loss"] = last_val["val/loss"]
        return out

    summary_title = "SFT"

    @classmethod
    def summary_lines(cls, summary: dict) -> list[str]:
        """Train loss first -> final, and the eval loss."""
        lines = []
        if summary.get("first_loss") is not None:
            lines.append(f"train loss: first {summary['first_loss']:.4f} -> final {summary['final_loss']:.4f}")
        if "val/loss" in summary:
            at = f" (step {summary['val_step']})" if summary.get("val_step") is not None else ""
            lines.append(f"eval loss{at}: {summary['val/loss']:.4f}")
        return lines


format_summary = SFTTrainer.format_summary
"""The end-of-run lines of an SFT run (``DriverBase.format_summary``)."""


__all__ = ["SFTTrainer", "format_summary"]
