"""RolloutWorker: a rollout engine on its own worker, holding its own copy of the policy.

Placed on its own resource pool (``trainer_mode=separate_async``); never joins a torch.distributed
group. Each worker is its own DP rank of mesh ``"rollout"`` and generates with the weights the
driver last sent (``receive_weights``).

Invariants:
- Calls run in submission order, so a batch's policy version is fixed when it is submitted.
- The engine switches to new weights only after a version's last bucket, so a generation never
  sees a half-updated model.
- Prompt ``i`` samples with ``sampling_seed(seed, sample_index[i])`` as the colocated rollout does,
  so a sample does not depend on which worker drew it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from verl_balance.batch_keys import PROMPT_IDS_KEY, SAMPLE_INDEX_KEY
from verl_balance.engine.lora import adapter_names, base_name, is_lora_name, merged_weight
from verl_balance.models.config import ModelConfig
from verl_balance.models.hf import HFModelConfig
from verl_balance.protocol import Batch
from verl_balance.rollout import RolloutEngine, RolloutOutput, build_rollout
from verl_balance.rollout.vllm_rollout import VLLMRolloutConfig
from verl_balance.single_controller import Dispatch, Worker, make_mesh_dispatch, register
from verl_balance.workers.actor_rollout import ROLLOUT_MESH, _to_cpu, sampling_seed


@dataclass
class RolloutWorkerConfig:
    """What a separate rollout worker needs: the model's shape and the rollout's settings."""

    model: ModelConfig | HFModelConfig
    """The policy's architecture (the weights come from the actor group)."""
    pad_token_id: int = 0
    """Token id that right-pads responses."""
    stop_token_ids: tuple = ()
    """Token ids that end a response."""
    rollout_max_batch_size: int | None = None
    """Sequences decoded together (actor_rollout_ref.rollout.max_num_seqs); None = all at once."""
    rollout_backend: str = "auto"
    """The rollout engine (``rollout.factory.ROLLOUT_BACKENDS``)."""
    vllm: VLLMRolloutConfig | None = None
    """The vLLM engine's settings (rollout_backend "vllm"; None = VLLMRolloutConfig's defaults)."""
    lora_scaling: float | None = None
    """peft's factor on B @ A when the actor trains LoRA adapters (None: full weights); the worker
    then generates with the merged weights."""


class RolloutWorker(Worker):
    """One rollout worker of a separate rollout group."""

    def __init__(self, config: RolloutWorkerConfig) -> None:
        super().__init__()
        self.config = config
        self.rollout: RolloutEngine | None = None
        self._state: dict[str, torch.Tensor] = {}
        self._weights: dict[str, torch.Tensor] = {}
        """What the rollout generates with: ``_state``, or with LoRA its merged plain tensors."""
        self.version: int | None = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict:
        """The rollout engine (no weights until the first ``receive_weights(last=True)``)."""
        self.register_mesh(ROLLOUT_MESH, dp_rank=self.rank, dp_size=self.world_size, is_collect=True)
        self.rollout = build_rollout(
            self.config.model,
            backend=self.config.rollout_backend,
            pad_token_id=self.config.pad_token_id,
            max_batch_size=self.config.rollout_max_batch_size,
            vllm_config=self.config.vllm,
            device=self.device,
        )
        return {
            "rank": self.rank,
            "device": str(self.device),
            "rollout_startup_s": getattr(self.rollout, "startup_s", None),
        }

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def receive_weights(self, bucket: dict[str, torch.Tensor], version: int, last: bool) -> None:
        """Copy one bucket of unsharded tensors into this worker's copy; with ``last`` the rollout
        generates with policy ``version`` from the next call on."""
        for name, tensor in bucket.items():
            own = self._state.get(name)
            if own is None or own.shape != tensor.shape or own.dtype != tensor.dtype:
                self._state[name] = tensor.to(self.device, copy=True)
            else:
                own.copy_(tensor)
        if last:
            self._weights = self._state if self.config.lora_scaling is None else self._merged_lora_weights()
            self.rollout.update_weights(self._weights)
            self.version = int(version)

    def _merged_lora_weights(self) -> dict[str, torch.Tensor]:
        """The plain model's tensors, each adapted base weight with its adapters merged."""
        out = {}
        for name, tensor in self._state.items():
            if is_lora_name(name):
                continue
            pair = adapter_names(name)
            if pair is not None and pair[0] in self._state:
                a, b = self._state[pair[0]], self._state[pair[1]]
                tensor = merged_weight(tensor, a, b, scaling=self.config.lora_scaling).to(tensor.dtype)
            out[base_name(name)] = tensor
        return out

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def weights_checksum(self) -> dict:
        """{"version", "sum" (float64), "names", "sums": per tensor} of the weights it generates with."""
        sums = {name: float(t.double().sum()) for name, t in self._weights.items()}
        return {"version": self.version, "sum": sum(sums.values()), "names": sorted(sums), "sums": sums}

    @register(dispatch_mode=make_mesh_dispatch(ROLLOUT_MESH))
    def generate_sequences(self, prompts: Batch, sampling: dict, seed: int) -> dict:
        """Sample ``sampling["n"]`` responses per prompt of this worker's chunk with the current weights:
        {"output": RolloutOutput or None (no prompts), "version": policy version, "busy_s": seconds}."""
        if self.version is None:
            raise RuntimeError("rollout worker has no weights yet: receive_weights(last=True) must come first")
        start = time.perf_counter()
        output: RolloutOutput | None = None
        if len(prompts):
            prompt_ids = [list(p) for p in prompts.non_tensors[PROMPT_IDS_KEY]]
            seeds = [sampling_seed(seed, int(index)) for index in prompts.non_tensors[SAMPLE_INDEX_KEY]]
            output = _to_cpu(
                self.rollout.generate(prompt_ids, stop_token_ids=self.config.stop_token_ids, seeds=seeds, **sampling)
            )
        return {"output": output, "version": self.version, "busy_s": time.perf_counter() - start}


__all__ = ["RolloutWorker", "RolloutWorkerConfig"]
