"""ActorRolloutWorker: the actor rank plus a colocated rollout and an optional frozen reference policy.

Invariants:
- The rollout reads the actor's own weights, all-gathered (a collective over the whole mesh) only
  when the actor stepped since the last gather; a ``streams_weights`` rollout gets them bucket by
  bucket, so no rank holds the gathered model beyond one bucket.
- Generation uses its own mesh, ``"rollout"``: every worker is its own DP rank and returns one
  ``RolloutOutput``, in worker-rank order. Every worker must join each ``generate_sequences`` call,
  even with an empty chunk.
- The reference policy is a never-updated engine on the same (dp, sp) mesh, copied from the actor
  by ``sync_reference_policy``; with LoRA it is the actor with adapters disabled.
- With LoRA the rollout generates with the merged weights W + scaling * B @ A under plain HF names.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor

from verl_balance.batch_keys import LOG_PROBS_KEY, PROMPT_IDS_KEY, REF_LOG_PROB_KEY, SAMPLE_INDEX_KEY
from verl_balance.engine.lora import (
    adapter_names,
    adapters_disabled,
    base_name,
    is_lora_name,
    lora_scaling,
    merged_weight,
)
from verl_balance.engine.train_engine import TrainEngine
from verl_balance.protocol import Batch
from verl_balance.rollout import RolloutEngine, RolloutOutput, build_rollout
from verl_balance.rollout.agent_loop import AGENT_NAME_KEY, MultiTurnConfig, ToolAgentLoop, build_agent_loop
from verl_balance.rollout.vllm_rollout import VLLMRolloutConfig
from verl_balance.single_controller import Dispatch, make_mesh_dispatch, register
from verl_balance.utils import safe_load
from verl_balance.workers.actor import ACTOR_MESH, ActorWorker, ActorWorkerConfig, batch_temperature, cat_padded
from verl_balance.workers.buckets import stream_full_tensors

ROLLOUT_MESH = "rollout"


def sampling_seed(*keys: int) -> int:
    """A 63-bit seed mixed from integer keys, e.g. (trainer seed, step) or (call seed, sample index)."""
    entropy = [int(k) & 0xFFFF_FFFF_FFFF_FFFF for k in keys]
    return int(np.random.SeedSequence(entropy).generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))


class WarmStartError(ValueError):
    """``actor_rollout_ref.model.warm_start_path`` is not a checkpoint this model can load."""


@dataclass
class ActorRolloutWorkerConfig(ActorWorkerConfig):
    """ActorWorkerConfig plus what the rollout and the reference policy need."""

    pad_token_id: int = 0
    """Token id that right-pads responses."""
    stop_token_ids: tuple = ()
    """Token ids that end a response (kept in it, finish reason "stop")."""
    rollout_max_batch_size: int | None = None
    """Sequences decoded together on one worker; None = all of its prompts at once."""
    rollout_backend: str = "auto"
    """The rollout engine (``rollout.factory.ROLLOUT_BACKENDS``; GRPO's actor_rollout_ref.rollout.name)."""
    vllm: VLLMRolloutConfig | None = None
    """The vLLM engine's settings (rollout_backend "vllm"; None = VLLMRolloutConfig's defaults)."""
    use_reference_policy: bool = False
    """Build the frozen reference engine (needed for the KL loss)."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """verl's actor_rollout_ref.rollout.multi_turn: tool conversations (rollout/agent_loop.py)."""
    chat_template: str | None = None
    """The driver tokenizer's chat template, which a multi-turn rollout renders every turn with."""


class ActorRolloutWorker(ActorWorker):
    """ActorWorker + ``generate_sequences``, ``compute_ref_log_prob`` and weight-only warm start."""

    def __init__(self, config: ActorRolloutWorkerConfig) -> None:
        super().__init__(config)
        self.rollout: RolloutEngine | None = None
        self.ref_engine: TrainEngine | None = None
        self._rollout_weights_step: int | None = None
        self._rollout_state: dict[str, torch.Tensor] | None = None  # LoRA: the merged tensors the rollout holds
        self._agent_loop: ToolAgentLoop | None = None  # multi-turn: built on the first rollout

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict:
        """The actor engine, the rollout engine (no weights yet) and, if asked, the reference engine."""
        info = super().init_model()
        self.register_mesh(ROLLOUT_MESH, dp_rank=self.rank, dp_size=self.world_size, is_collect=True)
        # KVCacheRollout for the built-in model, HFRollout for an HF directory (rollout/factory.py).
        self.rollout = build_rollout(
            self.config.model,
            backend=self.config.rollout_backend,
            pad_token_id=self.config.pad_token_id,
            max_batch_size=self.config.rollout_max_batch_size,
            vllm_config=self.config.vllm,
            device=self.layout.device,
        )
        info["rollout_startup_s"] = getattr(self.rollout, "startup_s", None)  # vLLM: the engine's start
        if self.config.use_reference_policy and not self._uses_lora:
            # With LoRA the reference is the actor with its adapters disabled (no second engine).
            self.ref_engine = TrainEngine(
                model_config=self.config.model, engine_config=self.config.engine, layout=self.layout
            )
        return info

    # ------------------------------------------------------------------ weights
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_model_weights(self, path: str) -> None:
        """Load only the model weights of an engine checkpoint (a new run from its weights; the
        worker count may differ). A LoRA checkpoint's adapters load after its base is checked
        (BaseMismatchError otherwise).
        """
        from verl_balance.engine.lora import read_base_fingerprint
        from verl_balance.engine.train_engine import check_checkpoint_base, trainable_state

        adapters_only = read_base_fingerprint(path) is not None
        if adapters_only and not self._uses_lora:
            raise WarmStartError(
                f"actor_rollout_ref.model.warm_start_path={path!r} is a LoRA checkpoint (adapters only); "
                "set actor_rollout_ref.model.lora_rank to warm-start from it"
            )
        if adapters_only:
            check_checkpoint_base(self.engine, path)
        model_sd = get_model_state_dict(self.engine.model)
        state = {"model": trainable_state(self.engine.model, model_sd) if adapters_only else model_sd}
        problems = safe_load.state_mismatch(safe_load.read_dcp_metadata(path), state["model"])
        if problems:  # checked before loading: DCP would drop extra layers silently or fail raw
            raise WarmStartError(
                f"actor_rollout_ref.model.warm_start_path={path!r} does not fit a model of {self.config.model}: "
                f"{'; '.join(problems)}. Warm-start from a checkpoint of the same architecture"
            )
        try:
            safe_load.dcp_load(state, path)
        except safe_load.UnsafeCheckpointError:
            raise
        except Exception as err:  # DCP raises several types (CheckpointException is unwrapped by dcp_load)
            raise WarmStartError(
                f"actor_rollout_ref.model.warm_start_path={path!r} could not be loaded into a model of "
                f"{self.config.model}: {err}"
            ) from err
        set_model_state_dict(self.engine.model, state["model"], options=StateDictOptions(strict=not adapters_only))
        self._rollout_weights_step = None
        self._rollout_state = None  # the base weights may have changed too

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def sync_reference_policy(self) -> None:
        """Copy the actor's current weights into the frozen reference engine (collective)."""
        self._require_reference_policy()
        if self._uses_lora:
            return  # the reference is the frozen base (adapters disabled): nothing to copy
        full = self.engine.full_state_dict()
        set_model_state_dict(
            self.ref_engine.model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
        )

    @property
    def _uses_lora(self) -> bool:
        return bool(self.config.engine.lora_rank)

    def _require_reference_policy(self) -> None:
        if not self.config.use_reference_policy:
            raise RuntimeError("the worker was built without a reference policy (use_reference_policy=False)")

    def _refresh_rollout_weights(self) -> None:
        step = self.engine.global_step
        if self._rollout_weights_step == step:
            return
        device = self.layout.device
        if self._uses_lora:
            self._rollout_state = self._merged_lora_weights(self._rollout_state)
            self.rollout.update_weights(self._rollout_state)
        elif self.rollout.streams_weights:  # vLLM: in place, one bucket unsharded at a time
            self.rollout.load_weights(stream_full_tensors(self.engine.model.state_dict(), device=device))
        else:
            self.rollout.update_weights({k: v.to(device) for k, v in self.engine.full_state_dict().items()})
        self._rollout_weights_step = step

    def _merged_lora_weights(self, previous: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """The plain HF state of the LoRA actor with adapters merged, on the rollout device.
        Collective. With ``previous`` only adapted modules are regathered, written into it in place."""
        model = self.engine.model
        scaling = lora_scaling(model.lora_config)
        params = model.state_dict()
        out = {} if previous is None else previous
        for name, value in params.items():
            pair = adapter_names(name)
            if is_lora_name(name) or (previous is not None and pair is None):
                continue
            tensor = _full_tensor(value)
            if pair is not None and pair[0] in params:
                tensor = merged_weight(
                    tensor, _full_tensor(params[pair[0]]), _full_tensor(params[pair[1]]), scaling=scaling
                ).to(value.dtype)
            if previous is None:
                out[base_name(name)] = tensor.to(self.layout.device, copy=True)
            else:
                out[base_name(name)].copy_(tensor)
        return out

    # ------------------------------------------------------------------ compute
    @register(dispatch_mode=make_mesh_dispatch(ROLLOUT_MESH))
    def generate_sequences(self, prompts: Batch, sampling: dict, seed: int) -> RolloutOutput | None:
        """Sample ``sampling["n"]`` responses for each of this worker's prompts (None for no prompts).

        Prompt i samples with its own seed ``sampling_seed(seed, sample_index[i])``, so the output is
        the same on any worker count (up to last-bit logit differences between batch shapes).
        """
        self._refresh_rollout_weights()  # collective: before any early return
        if len(prompts) == 0:
            return None
        prompt_ids = [list(p) for p in prompts.non_tensors[PROMPT_IDS_KEY]]
        seeds = [sampling_seed(seed, int(index)) for index in prompts.non_tensors[SAMPLE_INDEX_KEY]]
        if self.config.multi_turn.enable:
            return _to_cpu(self._multi_turn(prompts, sampling, seeds))
        return _to_cpu(
            self.rollout.generate(prompt_ids, stop_token_ids=self.config.stop_token_ids, seeds=seeds, **sampling)
        )

    def _multi_turn(self, prompts: Batch, sampling: dict, seeds: list[int]) -> RolloutOutput:
        """Tool conversations of this worker's prompts, generated turn by turn."""
        if self._agent_loop is None:
            self._agent_loop = build_agent_loop(
                engine=self.rollout,
                config=self.config.multi_turn,
                tokenizer_path=self.config.hf_tokenizer_path,
                chat_template=self.config.chat_template,
                eos_token_id=self.config.stop_token_ids[0],
            )
        columns = prompts.non_tensors
        extra_infos = [info or {} for info in columns["extra_info"]]
        result = self._agent_loop.generate(
            [list(chat) for chat in columns["raw_prompt"]],
            tools_kwargs=[info.get("tools_kwargs") or {} for info in extra_infos],
            agent_names=list(columns[AGENT_NAME_KEY]) if AGENT_NAME_KEY in columns else None,
            stop_token_ids=self.config.stop_token_ids,
            seeds=seeds,
            **sampling,
        )
        return result.rollout_output()

    @register(dispatch_mode=make_mesh_dispatch(ACTOR_MESH))
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        """Per-token log-probs (B, L) of this chunk's rows under the reference policy."""
        self._require_reference_policy()
        micro_batches, temperature = self._micro_batches(batch), batch_temperature(batch)
        if self._uses_lora:
            with adapters_disabled(self.engine.model):
                outputs = self.engine.compute_log_prob(micro_batches, temperature=temperature)
        else:
            outputs = self.ref_engine.compute_log_prob(micro_batches, temperature=temperature)
        return Batch.from_dict(tensors={REF_LOG_PROB_KEY: cat_padded([o[LOG_PROBS_KEY] for o in outputs])})


def _full_tensor(value: torch.Tensor) -> torch.Tensor:
    """The unsharded tensor of a (possibly DTensor) parameter, detached (collective for a DTensor)."""
    return (value.full_tensor() if isinstance(value, DTensor) else value).detach()


def _to_cpu(output: RolloutOutput) -> RolloutOutput:
    return dataclasses.replace(
        output,
        responses=output.responses.cpu(),
        response_mask=output.response_mask.cpu(),
        response_lengths=output.response_lengths.cpu(),
        log_probs=None if output.log_probs is None else output.log_probs.cpu(),
    )


__all__ = ["ActorRolloutWorker", "ActorRolloutWorkerConfig", "ROLLOUT_MESH", "WarmStartError", "sampling_seed"]
