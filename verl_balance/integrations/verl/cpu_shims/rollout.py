"""A CPU rollout server, so ``python -m verl.trainer.main_ppo`` runs end to end on CPU (verl
generates only through vLLM/SGLang/TensorRT-LLM servers, none of which runs without an accelerator).

Loaded through ``VERL_USE_EXTERNAL_MODULES=...cpu_shims.platform,...cpu_shims.rollout``, it registers
the rollout ``verl_balance_cpu``: ``CPURolloutReplica`` (one named ``CPURolloutServer`` actor per
replica) and ``CPUServerAdapter``, each trainer worker's ``BaseRollout`` (weight sync).

Sampling: greedy at ``temperature == 0``, else seeded by ``(rollout.seed, weight version,
request_id)``, so with ``rollout.full_determinism=True`` samples do not depend on request order.
Log-probs are those of the distribution sampled from. A CI aid for tiny models, not a performance path.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import re
from collections.abc import Iterable
from typing import Any

import ray
import torch
from omegaconf import DictConfig
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import HFModelConfig, RolloutConfig
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, RolloutReplicaRegistry, TokenOutput

from verl_balance.integrations.verl.compat import register_rollout_class

logger = logging.getLogger(__name__)

__all__ = [
    "ROLLOUT_NAME",
    "CPURolloutError",
    "CPURolloutReplica",
    "CPURolloutServer",
    "CPUServerAdapter",
    "register",
    "sample_tokens",
]

ROLLOUT_NAME = "verl_balance_cpu"
SUPPORTED_LOAD_FORMATS = ("dummy", "auto", "hf", "safetensors")
SUPPORTED_WIRE_FORMATS = ("named_tensors",)
_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


class CPURolloutError(ValueError):
    """A rollout setting or request this CPU rollout cannot honour; the message names the key."""


def server_name(replica_rank: int, *, name_suffix: str = "") -> str:
    """The Ray actor name of a replica's server (the adapters in the trainer workers look it up)."""
    return f"verl_balance_cpu_server_{replica_rank}{name_suffix}"


def rollout_world_size(config: RolloutConfig) -> int:
    """Trainer workers per replica, as verl's ``LLMServerManager`` and ``RolloutReplica`` count them."""
    return config.tensor_model_parallel_size * config.data_parallel_size * config.pipeline_model_parallel_size


def _torch_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise CPURolloutError(f"actor_rollout_ref.rollout.dtype={name!r}: expected one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def request_seed(*, seed: int, weights_version: Any, request_id: str) -> int:
    """A 63-bit sampling seed that depends only on the rollout seed, the weight version and the request id."""
    digest = hashlib.sha256(f"{seed}:{weights_version}:{request_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _filter_logits(logits: torch.Tensor, *, top_k: int, top_p: float) -> torch.Tensor:
    """``logits`` with everything outside the top-k / nucleus set to ``-inf`` (``top_k <= 0``: off)."""
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop_sorted = cumulative - torch.softmax(sorted_logits, dim=-1) >= top_p  # keeps the token crossing top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


@torch.no_grad()
def sample_tokens(
    model: torch.nn.Module,
    prompt_ids: list[int],
    *,
    max_tokens: int,
    temperature: float,
    top_k: int,
    top_p: float,
    stop_token_ids: Iterable[int],
    generator: torch.Generator | None,
) -> tuple[list[int], list[float]]:
    """(response token ids, their log-probabilities) of one KV-cached decode from ``prompt_ids``;
    stops after a stop token (kept) or ``max_tokens`` tokens. Greedy when ``temperature == 0``."""
    stop = set(stop_token_ids)
    device = next(model.parameters()).device
    input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    past = None
    tokens: list[int] = []
    log_probs: list[float] = []
    for _ in range(max_tokens):
        out = model(input_ids=input_ids, past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits = out.logits[0, -1].float()
        if temperature == 0:
            token = int(torch.argmax(logits))
            log_prob = torch.log_softmax(logits, dim=-1)[token]
        else:
            logits = _filter_logits(logits / temperature, top_k=top_k, top_p=top_p)
            probs = torch.softmax(logits, dim=-1)
            token = int(torch.multinomial(probs, 1, generator=generator))
            log_prob = torch.log_softmax(logits, dim=-1)[token]
        tokens.append(token)
        log_probs.append(float(log_prob))
        if token in stop:
            break
        input_ids = torch.tensor([[token]], dtype=torch.long, device=device)
    return tokens, log_probs


def lora_scaling(peft_config: dict) -> float:
    """peft's factor on B @ A; CPURolloutError for an adapter kind this rollout does not apply."""
    unsupported = [k for k in ("use_dora", "rank_pattern", "alpha_pattern") if peft_config.get(k)]
    if unsupported:
        raise CPURolloutError(
            f"{ROLLOUT_NAME}: LoRA adapters with {unsupported} are not supported (plain LoRA only); set "
            "actor_rollout_ref.model.lora.merge=True to sync merged weights instead"
        )
    rank, alpha = int(peft_config["r"]), float(peft_config["lora_alpha"])
    return alpha / (math.sqrt(rank) if peft_config.get("use_rslora") else rank)


_ADAPTER_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")


def adapter_pairs(named_tensors: dict[str, torch.Tensor], *, rank: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{module name: (lora_A, lora_B)} from peft adapter keys; CPURolloutError for anything else."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named_tensors.items():
        match = _ADAPTER_KEY.match(name)
        if match is None:
            raise CPURolloutError(f"{ROLLOUT_NAME}: {name!r} is not a LoRA adapter key (<module>.lora_A/B.weight)")
        found.setdefault(match["module"], {})[match["which"]] = tensor
    incomplete = sorted(m for m, ab in found.items() if len(ab) != 2)
    if incomplete:
        raise CPURolloutError(f"{ROLLOUT_NAME}: LoRA adapters without both lora_A and lora_B: {incomplete[:8]}")
    ranks = {m: (ab["A"].shape[0], ab["B"].shape[-1]) for m, ab in found.items()}
    wrong = sorted(m for m, r in ranks.items() if r != (rank, rank))
    if wrong:
        raise CPURolloutError(f"{ROLLOUT_NAME}: LoRA adapters of {wrong[:8]} do not have the peft config's r={rank}")
    return {module: (ab["A"], ab["B"]) for module, ab in found.items()}


class CPURolloutServer:
    """One replica's generation server (a Ray actor): a Hugging Face causal LM on CPU.
    ``load_format=dummy`` refuses to generate until the trainer has sent weights."""

    def __init__(self, *, config: RolloutConfig, model_config: HFModelConfig | DictConfig, replica_rank: int):
        from transformers import AutoModelForCausalLM

        self.config: RolloutConfig = omega_conf_to_dataclass(config)
        self.model_config: HFModelConfig = omega_conf_to_dataclass(model_config, dataclass_type=HFModelConfig)
        self.replica_rank = replica_rank
        if self.config.load_format not in SUPPORTED_LOAD_FORMATS:
            raise CPURolloutError(
                f"actor_rollout_ref.rollout.load_format={self.config.load_format!r}: "
                f"the {ROLLOUT_NAME} rollout supports {SUPPORTED_LOAD_FORMATS}"
            )
        dtype = _torch_dtype(self.config.dtype)
        attn = dict(self.model_config.override_config or {}).get("attn_implementation", "sdpa")
        path = self.model_config.local_path
        if self.config.load_format == "dummy":
            self.model = AutoModelForCausalLM.from_config(
                self.model_config.hf_config, dtype=dtype, attn_implementation=attn
            )
            self.has_weights = False  # random init: only the trainer's weights may generate
        else:
            self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn)
            self.has_weights = True
        self.weights_version: Any = "pretrained"  # part of every sampling seed; the trainer's global step
        self.num_weight_updates = 0
        # Un-merged weights of the Linear layers LoRA adapters were merged into since the last full load.
        self.base_weights: dict[str, torch.Tensor] = {}
        self.model.eval()
        self.stop_token_ids = self._stop_token_ids()
        self.max_model_len = self.config.max_model_len or (self.config.prompt_length + self.config.response_length)
        logger.info(
            "%s replica %d: %s (%s, %d parameters) on CPU, stop tokens %s",
            ROLLOUT_NAME,
            replica_rank,
            path,
            dtype,
            sum(p.numel() for p in self.model.parameters()),
            sorted(self.stop_token_ids),
        )

    def _stop_token_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (self.model_config.generation_config, self.model_config.hf_config, self.model_config.tokenizer):
            value = getattr(source, "eos_token_id", None)
            if value is not None:
                ids.update([value] if isinstance(value, int) else value)
        return ids

    def load_weights(self, named_tensors: dict[str, torch.Tensor], *, global_steps: int | None = None) -> int:
        """Copy the trainer's full tensors into the model (every one but a tied output embedding);
        returns how many. Any adapters applied before are gone."""
        named_tensors = {name.replace(".base_layer.", "."): tensor for name, tensor in named_tensors.items()}
        own = self.model.state_dict()
        unknown = sorted(set(named_tensors) - set(own))
        if unknown:
            raise CPURolloutError(f"{ROLLOUT_NAME}: trainer sent weights the rollout model lacks: {unknown[:8]}")
        tied = {"lm_head.weight"} if getattr(self.model.config, "tie_word_embeddings", False) else set()
        missing = sorted(set(own) - set(named_tensors) - tied)
        if missing:
            raise CPURolloutError(f"{ROLLOUT_NAME}: trainer did not send weights for {missing[:8]}")
        with torch.no_grad():
            for name, tensor in named_tensors.items():
                if own[name].shape != tensor.shape:
                    raise CPURolloutError(
                        f"{ROLLOUT_NAME}: weight {name} has shape {tuple(tensor.shape)}, "
                        f"the rollout model's is {tuple(own[name].shape)}"
                    )
                own[name].copy_(tensor)
        self.base_weights = {}  # nothing merged into the model now
        self._new_weights_version(global_steps)
        return len(named_tensors)

    def _new_weights_version(self, global_steps: int | None) -> None:
        self.num_weight_updates += 1
        self.weights_version = global_steps if global_steps is not None else f"update-{self.num_weight_updates}"
        self.has_weights = True

    def load_adapters(
        self, named_tensors: dict[str, torch.Tensor], *, peft_config: dict, global_steps: int | None = None
    ) -> int:
        """Merge LoRA adapters (peft adapter-file keys) into the base weights of the last full load;
        returns the number of adapted modules."""
        if not self.has_weights:
            raise CPURolloutError(
                f"{ROLLOUT_NAME}: LoRA adapters before any base weights (actor_rollout_ref.rollout.load_format=dummy)"
            )
        scaling = lora_scaling(peft_config)
        pairs = adapter_pairs(named_tensors, rank=int(peft_config["r"]))
        own = self.model.state_dict()
        with torch.no_grad():
            for weight_name in sorted(set(self.base_weights) | {f"{m}.weight" for m in pairs}):
                if weight_name not in own:
                    raise CPURolloutError(f"{ROLLOUT_NAME}: LoRA adapter for {weight_name!r}: no such model weight")
                if weight_name not in self.base_weights:  # never merged since the last full load
                    self.base_weights[weight_name] = own[weight_name].detach().clone()
                weight = self.base_weights[weight_name].float()
                pair = pairs.get(weight_name[: -len(".weight")])
                if pair is not None:
                    lora_a, lora_b = (t.float() for t in pair)
                    if (lora_b.shape[0], lora_a.shape[1]) != tuple(own[weight_name].shape):
                        raise CPURolloutError(
                            f"{ROLLOUT_NAME}: LoRA adapter of {weight_name!r} has B @ A of shape "
                            f"{(lora_b.shape[0], lora_a.shape[1])}, the weight's is {tuple(own[weight_name].shape)}"
                        )
                    weight = weight + scaling * (lora_b @ lora_a)
                own[weight_name].copy_(weight)
        self._new_weights_version(global_steps)
        return len(pairs)

    def _checked_params(self, request_id: str, sampling_params: dict[str, Any], *, media: tuple) -> dict[str, Any]:
        """A copy of ``sampling_params``; CPURolloutError for what this rollout cannot do."""
        if any(m is not None for m in media):
            raise CPURolloutError(f"{ROLLOUT_NAME}: multimodal inputs are not supported (request {request_id})")
        if not self.has_weights:
            raise CPURolloutError(
                f"{ROLLOUT_NAME}: generate before any weight update with "
                "actor_rollout_ref.rollout.load_format=dummy (the trainer sends weights first)"
            )
        params = dict(sampling_params)
        repetition_penalty = params.pop("repetition_penalty", 1.0)
        if repetition_penalty != 1.0:
            raise CPURolloutError(f"{ROLLOUT_NAME}: repetition_penalty={repetition_penalty} is not supported (1.0)")
        return params

    def _max_tokens(self, request_id: str, prompt_ids: list[int], params: dict[str, Any]) -> int:
        """Tokens to sample, never past ``max_model_len``; CPURolloutError when that leaves no room."""
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise CPURolloutError(
                f"{ROLLOUT_NAME}: prompt of {len(prompt_ids)} tokens leaves no room within max_model_len "
                f"{self.max_model_len} (actor_rollout_ref.rollout.max_model_len / prompt_length + response_length)"
            )
        if "max_tokens" in params or "max_new_tokens" in params:
            max_tokens = int(params.pop("max_tokens", params.pop("max_new_tokens", 0)))
        else:
            max_tokens = min(
                self.config.response_length, self.config.prompt_length + self.config.response_length - len(prompt_ids)
            )
        max_tokens = min(max_tokens, room)
        if max_tokens < 1:
            raise CPURolloutError(f"{ROLLOUT_NAME}: max_tokens={max_tokens} for request {request_id}: need >= 1")
        return max_tokens

    def generate(
        self,
        request_id: str,
        *,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        image_data: Any = None,
        video_data: Any = None,
        **kwargs: Any,
    ) -> TokenOutput:
        """verl's token-in/token-out call: sample a response to ``prompt_ids`` (see the module doc)."""
        params = self._checked_params(
            request_id, sampling_params, media=(image_data, video_data, kwargs.get("audio_data"))
        )
        prompt_ids = [int(t) for t in prompt_ids]
        max_tokens = self._max_tokens(request_id, prompt_ids, params)
        temperature = float(params.get("temperature", self.config.temperature))
        top_k = int(params.get("top_k", self.config.top_k))
        top_p = float(params.get("top_p", self.config.top_p))
        generator = torch.Generator(device="cpu")
        generator.manual_seed(
            request_seed(seed=self.config.seed, weights_version=self.weights_version, request_id=str(request_id))
        )
        token_ids, log_probs = sample_tokens(
            self.model,
            prompt_ids,
            max_tokens=max_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            stop_token_ids=() if self.config.ignore_eos else self.stop_token_ids,
            generator=generator,
        )
        return TokenOutput(
            token_ids=token_ids,
            log_probs=log_probs if params.get("logprobs") else None,
            stop_reason="completed",
            num_preempted=0,
            # The trainer's step of the weights (None before the trainer sent any), as vLLM reports it.
            extra_fields={"global_steps": self.weights_version if isinstance(self.weights_version, int) else None},
        )

    # The control calls verl's replicas and trainer make; weights and cache stay resident on CPU.
    def wake_up(self) -> None:
        """No-op: the model stays resident."""

    def sleep(self) -> None:
        """No-op: the model stays resident."""

    def clear_kv_cache(self) -> None:
        """No-op: each request builds its own cache."""

    def release_kv_cache(self) -> None:
        """No-op: each request builds its own cache."""

    def resume_kv_cache(self) -> None:
        """No-op: each request builds its own cache."""

    def abort_all_requests(self, reject_request: bool = False) -> None:
        """No-op: requests run one at a time to completion."""

    def resume_generation(self) -> None:
        """No-op (see ``abort_all_requests``)."""

    def start_profile(self, **kwargs) -> None:
        """No-op: profiling is not supported."""

    def stop_profile(self) -> None:
        """No-op: profiling is not supported."""


class CPURolloutReplica(RolloutReplica):
    """verl ``RolloutReplica`` whose ``launch_servers`` starts one ``server_class`` actor."""

    server_class: type = CPURolloutServer

    async def init_colocated(self, resource_pool) -> None:
        """Not supported: the server takes its weights from trainer workers in the same replica."""
        raise CPURolloutError(self._hybrid_only("colocated"))

    async def init_standalone(self) -> None:
        """Not supported: the server takes its weights from trainer workers in the same replica."""
        raise CPURolloutError(self._hybrid_only("standalone"))

    def _hybrid_only(self, mode: str) -> str:
        return (
            f"the {ROLLOUT_NAME} rollout runs only in verl's hybrid mode (actor_rollout_ref.hybrid_engine=True, "
            f"rollout.checkpoint_engine.backend=naive), not {mode} (e.g. reward_model.rollout or distillation)"
        )

    async def launch_servers(self) -> None:
        """Start the replica's server on the node of its first worker (hybrid) or anywhere (otherwise)."""
        options: dict[str, Any] = {
            "name": server_name(self.replica_rank, name_suffix=self._role_suffix()),
            "num_cpus": 0,  # the trainer workers' placement group holds the CPUs; this actor shares them
            "max_concurrency": 1,  # one request at a time: deterministic, and weight loads never overlap
        }
        if self.workers:
            node_id = await self.workers[0].__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id())
            options["scheduling_strategy"] = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
                node_id=node_id, soft=False
            )
        server = (
            ray.remote(self.server_class)
            .options(**options)
            .remote(config=self.config, model_config=self.model_config, replica_rank=self.replica_rank)
        )
        await server.__ray_ready__.remote()
        self.servers = [server]
        self._server_handle = server
        self._server_address = f"{ROLLOUT_NAME}://{options['name']}"  # no HTTP endpoint; verl routes by handle

    def _role_suffix(self) -> str:
        role = "_reward" if self.is_reward_model else "_teacher" if self.is_teacher_model else ""
        return role + self.name_suffix

    def rollout_worker_use_gpu(self) -> bool:
        """The server computes on CPU."""
        return False


class CPUServerAdapter(BaseRollout):
    """The rollout object in each trainer worker: forwards weight updates to the replica's server."""

    def __init__(self, config: RolloutConfig, model_config: HFModelConfig, device_mesh, *args, **kwargs):
        super().__init__(config, model_config, device_mesh)
        world = rollout_world_size(self.config)
        rank = int(os.environ["RANK"])
        self.replica_rank = rank // world
        self.is_replica_leader = rank % world == 0
        self._server = None

    def _server_handle(self):
        if self._server is None:
            self._server = ray.get_actor(server_name(self.replica_rank))
        return self._server

    async def resume(self, tags: list[str]) -> None:
        """No-op: the server keeps weights and cache resident."""

    async def release(self) -> None:
        """No-op: the server keeps weights and cache resident."""

    async def update_weights(self, weights, wire_format: str = "named_tensors", **kwargs) -> None:
        """Send the trainer's weights to the replica's server (its first worker sends; all iterate).
        LoRA adapters (``peft_config`` with ``base_sync_done``) are merged on the base; else the
        tensors replace the model's."""
        if wire_format not in SUPPORTED_WIRE_FORMATS:
            raise CPURolloutError(
                f"{ROLLOUT_NAME}: wire_format={wire_format!r} (actor_rollout_ref.rollout.checkpoint_engine.backend); "
                f"supported: {SUPPORTED_WIRE_FORMATS} with backend=naive"
            )
        named_tensors = {}
        for name, tensor in weights:  # unsharding is a collective: every worker walks the whole generator
            if self.is_replica_leader:
                named_tensors[name] = tensor.detach().to("cpu", copy=True)
        if not self.is_replica_leader:
            return
        server, global_steps = self._server_handle(), kwargs.get("global_steps")
        peft_config = kwargs.get("peft_config")
        if peft_config is not None and kwargs.get("base_sync_done", False):
            await server.load_adapters.remote(named_tensors, peft_config=peft_config, global_steps=global_steps)
        else:
            await server.load_weights.remote(named_tensors, global_steps=global_steps)


def register() -> None:
    """Register ``verl_balance_cpu`` in verl's replica and rollout-class registries (idempotent)."""
    RolloutReplicaRegistry.register(ROLLOUT_NAME, lambda: CPURolloutReplica)
    register_rollout_class(ROLLOUT_NAME, "async", f"{__name__}.CPUServerAdapter")


register()
