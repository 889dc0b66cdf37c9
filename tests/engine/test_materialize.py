"""Sharded construction (engine/materialize.py): meta build -> FSDP2 -> local shard only -> fill.

Checked against a plain full build in this process (the reference): same weights, same buffers,
same log-probs at dp=2 and sp=2; random init identical at every layout; the pretrained loader reads
only each rank's rows; the streamed HF export reloads to the same weights.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import re

import pytest
import torch

from verl_balance.distributed import ParallelLayout
from verl_balance.distributed.launcher import run_on_ranks
from verl_balance.engine import EngineConfig, TrainEngine
from verl_balance.models import ModelConfig, build_model
from verl_balance.models.hf import HFModelConfig
from verl_balance.models.tiny_hf import write_tiny_model

pytestmark = pytest.mark.slow  # spawns process groups

SEED = 7
LAYOUTS = {"dp2": (2, 1), "sp2": (1, 2)}
LENGTHS = [9, 4, 12]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("materialize")
    return {
        "qwen2_tied": write_tiny_model(str(root / "qwen2"), family="qwen2"),
        "llama_untied": write_tiny_model(str(root / "llama"), family="llama", tie_word_embeddings=False),
        # per-expert tensors on disk, fused [E, ...] expert parameters in transformers 5
        "mixtral": write_tiny_model(str(root / "mixtral"), family="mixtral"),
    }


def _configs(dirs):
    return {
        "builtin": ModelConfig.preset("tiny"),
        "qwen2_pretrained": HFModelConfig.from_pretrained(dirs["qwen2_tied"]),
        "llama_pretrained": HFModelConfig.from_pretrained(dirs["llama_untied"]),
        "mixtral_pretrained": HFModelConfig.from_pretrained(dirs["mixtral"]),
        "qwen2_random": HFModelConfig.from_pretrained(dirs["qwen2_tied"], init="random"),
    }


def _micro_batch(vocab_size):
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1, min(vocab_size, 100), (len(LENGTHS), max(LENGTHS)), generator=gen)
    mask = (torch.arange(max(LENGTHS))[None] < torch.tensor(LENGTHS)[:, None]).long()
    return {"input_ids": ids * mask, "attention_mask": mask, "loss_mask": mask.float()}


def _engine(config, dp, sp):
    layout = ParallelLayout(dp=dp, sp=sp, device_type="cpu")
    return TrainEngine(model_config=config, engine_config=EngineConfig(seed=SEED), layout=layout)


def _buffers(model):
    return {n: (b.full_tensor() if hasattr(b, "full_tensor") else b).detach().clone() for n, b in model.named_buffers()}


def _scenarios(rank, *, dirs, export_root):
    """Every layout x config on one spawn of 2 ranks; returns what the parent compares."""
    out = {}
    for cname, config in _configs(dirs).items():
        for lname, (dp, sp) in LAYOUTS.items():
            engine = _engine(config, dp, sp)
            [result] = engine.compute_log_prob([_micro_batch(config.vocab_size)])
            hf = isinstance(config, HFModelConfig)
            out[cname, lname] = {
                "state": engine.full_state_dict(),
                "buffers": _buffers(engine.model),
                "log_probs": result["log_probs"],
                "tied": hf and engine.model.lm_head.weight is engine.model.model.embed_tokens.weight,
            }
            if lname == "dp2" and cname in ("qwen2_pretrained", "builtin"):
                path = os.path.join(export_root, cname)
                from verl_balance.engine.hf_export import save_engine_model_as_hf

                save_engine_model_as_hf(
                    engine.model, model_config=config, out=path, group=engine.layout.world_group, max_shard_bytes=20_000
                )
    return out


@pytest.fixture(scope="module")
def sharded_runs(model_dirs, tmp_path_factory):
    export_root = str(tmp_path_factory.mktemp("exports"))
    results = run_on_ranks(functools.partial(_scenarios, dirs=model_dirs, export_root=export_root), world=2)
    return results, export_root


def _single_rank(rank, *, dirs):
    return {name: _engine(config, 1, 1).full_state_dict() for name, config in _configs(dirs).items()}


def _plain(config):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        return build_model(config)


def _reference_log_probs(model, batch):
    """log p(token t | tokens < t) per row from the plain model, one sequence at a time."""
    out = torch.zeros(batch["input_ids"].shape)
    with torch.no_grad():
        for i, n in enumerate(LENGTHS):
            ids = batch["input_ids"][i, :n]
            logits = model(
                input_ids=ids,
                position_ids=torch.arange(n),
                cu_seqlens=torch.tensor([0, n], dtype=torch.int32),
                max_seqlen=n,
            )
            out[i, 1:n] = torch.log_softmax(logits[:-1].float(), -1).gather(-1, ids[1:, None]).squeeze(-1)
    return out


@pytest.mark.parametrize("cname", ["builtin", "qwen2_pretrained", "llama_pretrained", "mixtral_pretrained"])
@pytest.mark.parametrize("lname", sorted(LAYOUTS))
def test_sharded_build_equals_plain_full_build(sharded_runs, model_dirs, cname, lname):
    results, _ = sharded_runs
    config = _configs(model_dirs)[cname]
    plain = _plain(config)
    reference = {k: v.detach() for k, v in plain.state_dict().items()}
    for rank in range(2):
        got = results[rank][cname, lname]
        assert set(got["state"]) <= set(reference)
        assert all(torch.equal(got["state"][k], reference[k]) for k in got["state"]), cname
        plain_buffers = dict(plain.named_buffers())
        assert set(got["buffers"]) == set(plain_buffers)
        assert all(torch.equal(got["buffers"][k], plain_buffers[k]) for k in plain_buffers)
        if getattr(config, "tie_word_embeddings", False) and cname != "builtin":
            assert got["tied"], "tied embeddings must stay one Parameter"
    batch = _micro_batch(config.vocab_size)
    expected = _reference_log_probs(plain, batch)
    torch.testing.assert_close(results[0][cname, lname]["log_probs"], expected, rtol=1e-5, atol=1e-5)
    if cname != "builtin":
        # Negative control: garbage rotary buffers (the classic meta-init bug) change the log-probs.
        for name, buf in plain.named_buffers():
            if name.endswith("inv_freq"):
                buf.mul_(3.0)
        assert not torch.allclose(_reference_log_probs(plain, batch), expected, atol=1e-3)


def test_random_init_is_the_same_at_every_layout(sharded_runs, model_dirs):
    results, _ = sharded_runs
    single = run_on_ranks(functools.partial(_single_rank, dirs=model_dirs), world=1)[0]
    for cname in ("builtin", "qwen2_random"):
        for lname in LAYOUTS:
            for rank in range(2):
                got = results[rank][cname, lname]["state"]
                assert got.keys() == single[cname].keys()
                assert all(torch.equal(got[k], single[cname][k]) for k in got), (cname, lname, rank)
    # Random HF weights follow HF's init (normal(0, initializer_range), zero biases, unit norms) and
    # are not the pretrained ones (negative control: the seed's weights, not the directory's).
    random_state, pretrained = single["qwen2_random"], single["qwen2_pretrained"]
    q = random_state["model.layers.0.self_attn.q_proj.weight"]
    std = HFModelConfig.from_pretrained(model_dirs["qwen2_tied"]).hf_config().initializer_range
    assert abs(q.std().item() - std) < 0.1 * std
    assert torch.equal(random_state["model.layers.0.self_attn.q_proj.bias"], torch.zeros_like(q[:, 0]))
    assert torch.equal(random_state["model.norm.weight"], torch.ones_like(random_state["model.norm.weight"]))
    assert not torch.equal(q, pretrained["model.layers.0.self_attn.q_proj.weight"])


def test_streamed_hf_export_reloads_the_engine_weights(sharded_runs, model_dirs):
    from transformers import AutoModelForCausalLM

    results, export_root = sharded_runs
    for cname in ("qwen2_pretrained", "builtin"):
        out = os.path.join(export_root, cname)
        files = sorted(glob.glob(os.path.join(out, "*.safetensors")))
        assert len(files) > 1 and os.path.isfile(os.path.join(out, "model.safetensors.index.json"))
        with open(os.path.join(out, "model.safetensors.index.json")) as f:
            weight_map = json.load(f)["weight_map"]
        assert "lm_head.weight" not in weight_map if cname == "qwen2_pretrained" else "lm_head.weight" in weight_map
        reloaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True, dtype=torch.float32).state_dict()
        state = results[0][cname, "dp2"]["state"]
        if cname == "builtin":
            from verl_balance.models.hf_llama import builtin_to_hf_llama

            _, state = builtin_to_hf_llama(state, model_config=_configs(model_dirs)[cname])
        for name, value in state.items():
            assert torch.equal(reloaded[name], value), name


def _count_reads(rank, *, path, full_rows):
    """Elements this rank reads from the safetensors while building at dp=2 (spying on safe_open)."""
    import safetensors

    import verl_balance.engine.materialize as materialize

    reads = []
    real_open = safetensors.safe_open

    class SpySlice:
        def __init__(self, key, real):
            self.key, self.real = key, real

        def get_shape(self):
            return self.real.get_shape()

        def __getitem__(self, index):
            tensor = self.real[index]
            reads.append((self.key, tensor.numel()))
            return tensor

    class SpyOpen:
        def __init__(self, *args, **kwargs):
            self.handle = real_open(*args, **kwargs)

        def __enter__(self):
            self.handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self.handle.__exit__(*exc)

        def keys(self):
            return self.handle.keys()

        def get_slice(self, key):
            return SpySlice(key, self.handle.get_slice(key))

        def get_tensor(self, key):
            tensor = self.handle.get_tensor(key)
            reads.append((key, tensor.numel()))
            return tensor

    safetensors.safe_open = SpyOpen
    if full_rows:  # the known-bad variant: every rank reads whole tensors
        materialize.local_rows = lambda param: (0, param.shape[0])
        materialize.copy_local_rows = lambda *a, **k: None
    engine = _engine(HFModelConfig.from_pretrained(path), 2, 1)
    local = {n: p.to_local().numel() for n, p in engine.model.named_parameters()}
    torch.distributed.barrier()  # no rank tears the group down while another still builds
    return reads, local


@pytest.mark.parametrize("full_rows", [False, True], ids=["local-rows", "negative-control-full-reads"])
def test_pretrained_loader_reads_only_each_ranks_rows(model_dirs, full_rows):
    from safetensors import safe_open

    path = model_dirs["llama_untied"]
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        full = {k: f.get_slice(k).get_shape() for k in f.keys()}
    results = run_on_ranks(functools.partial(_count_reads, path=path, full_rows=full_rows), world=2)
    total = sum(torch.Size(s).numel() for s in full.values())
    for reads, local in results:
        too_big = [(k, n) for k, n in reads if n > local[k]]
        if full_rows:
            assert too_big, "the spy must catch whole-tensor reads"
        else:
            assert not too_big and sum(n for _, n in reads) == sum(local.values()) < total


def test_pretrained_loader_names_a_missing_tensor(model_dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    src = model_dirs["llama_untied"]
    dst = tmp_path / "broken"
    dst.mkdir()
    for name in os.listdir(src):
        if name != "model.safetensors":
            os.symlink(os.path.join(src, name), dst / name)
    state = load_file(os.path.join(src, "model.safetensors"))
    state.pop("lm_head.weight")
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = HFModelConfig.from_pretrained(str(dst))
    # The rank returns its error rather than raising it: a raising rank costs the warm pool's restart.
    error = run_on_ranks(functools.partial(_build_error, config=config), world=1)[0]
    assert error is not None, "building from a checkpoint without lm_head.weight must fail"
    assert re.search("lm_head.weight", error), error


def _build_error(rank, *, config) -> str | None:
    """The build's exception as ``Type: message``, None when the build succeeds."""
    try:
        _engine(config, 1, 1)
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return None
