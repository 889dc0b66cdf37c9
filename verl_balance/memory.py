"""Per-rank memory model of one TrainEngine training step (FSDP2 + Ulysses SP), pure Python.

    python -m verl_balance.memory qwen2.5-7b --gpus 8 --sp 2 --tokens 16384 --ac --head-chunk 4096

Exact (tests/test_memory.py): parameters, fp32 master weights and gradients, AdamW state, sharded on
dim 0 over W = dp * sp ranks with ``torch.chunk`` rows (rank 0 holds the most). Estimates
(``benchmarks/memory_model_check.py``): FSDP2 in-flight gathers, activations per SP rank (no T x T),
the output head ((b + 12) bytes per token and vocabulary entry). Peak = all of it at the start of the
backward. Not counted: optimizer-step temporaries, allocator caching, CUDA context, NCCL buffers;
keep a margin.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
FP32 = 4
GiB = 1024**3


class MemoryModelError(ValueError):
    """A bad argument of the memory model; ``arg`` names it (the CLI prints ``--<arg>``)."""

    def __init__(self, arg: str, message: str):
        super().__init__(f"{arg}: {message}")
        self.arg, self.message = arg, message


# ---------------------------------------------------------------------------------------- shapes
@dataclass(frozen=True)
class ModelShapes:
    """Every parameter tensor of a causal LM by FSDP2 unit (``root``, one tuple per layer), HF's names."""

    name: str
    family: str
    vocab_size: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    root: tuple[tuple[str, tuple[int, ...]], ...]
    layers: tuple[tuple[tuple[str, tuple[int, ...]], ...], ...]
    moe_layers: tuple[bool, ...] = ()
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    qk_norm: bool = False

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of every parameter tensor, each once (tied embeddings: one tensor)."""
        return [t for layer in self.layers for t in layer] + list(self.root)

    @property
    def num_params(self) -> int:
        return sum(math.prod(s) for _, s in self.tensors())

    @property
    def num_active_params(self) -> int:
        """Parameters that compute for one token: all but the (E - k) idle experts of each MoE layer."""
        idle = 0
        for layer in self.layers:
            for name, shape in layer:
                if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                    idle += math.prod(shape) * (self.num_experts - self.experts_per_token) // self.num_experts
        return self.num_params - idle


def _linear(name: str, out_f: int, in_f: int, *, bias: bool = False) -> list[tuple[str, tuple[int, ...]]]:
    out = [(f"{name}.weight", (out_f, in_f))]
    if bias:
        out.append((f"{name}.bias", (out_f,)))
    return out


def _dense_mlp(prefix: str, h: int, inter: int, *, bias: bool = False) -> list[tuple[str, tuple[int, ...]]]:
    return (
        _linear(f"{prefix}.gate_proj", inter, h, bias=bias)
        + _linear(f"{prefix}.up_proj", inter, h, bias=bias)
        + _linear(f"{prefix}.down_proj", h, inter, bias=bias)
    )


FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "mixtral", "qwen2_moe", "qwen3_moe")
# Families whose config defaults to tied embeddings when the key is absent.
_TIED_BY_DEFAULT = ("gemma", "gemma2", "gemma3_text")


def _get(cfg: dict, key: str, source: str, default=None):
    value = cfg.get(key, default)
    if value is None:
        raise MemoryModelError("model", f"{source}: config.json lacks {key!r}")
    return value


def _is_moe_layer(cfg: dict, family: str, i: int) -> bool:
    if family == "mixtral":
        return True
    if family not in ("qwen2_moe", "qwen3_moe"):
        return False
    if i in (cfg.get("mlp_only_layers") or []):
        return False
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    return int(cfg.get("num_experts", 0) or 0) > 0 and (i + 1) % step == 0


def _layer_tensors(cfg: dict, family: str, i: int, dims: dict) -> list[tuple[str, tuple[int, ...]]]:
    h, nh, nkv, hd = dims["h"], dims["nh"], dims["nkv"], dims["hd"]
    p = f"model.layers.{i}"
    configured_bias = bool(cfg.get("attention_bias", False))
    attn_bias = family in ("qwen2", "qwen2_moe") or configured_bias  # Qwen2: q/k/v biases, none on o_proj
    o_bias = configured_bias and family not in ("qwen2", "qwen2_moe")
    out = (
        _linear(f"{p}.self_attn.q_proj", nh * hd, h, bias=attn_bias)
        + _linear(f"{p}.self_attn.k_proj", nkv * hd, h, bias=attn_bias)
        + _linear(f"{p}.self_attn.v_proj", nkv * hd, h, bias=attn_bias)
        + _linear(f"{p}.self_attn.o_proj", h, nh * hd, bias=o_bias)
    )
    if dims["qk_norm"]:
        out += [(f"{p}.self_attn.q_norm.weight", (hd,)), (f"{p}.self_attn.k_norm.weight", (hd,))]
    if _is_moe_layer(cfg, family, i):
        e, mi = dims["experts"], dims["moe_inter"]
        out += _linear(f"{p}.mlp.gate", e, h)
        out += [(f"{p}.mlp.experts.gate_up_proj", (e, 2 * mi, h)), (f"{p}.mlp.experts.down_proj", (e, h, mi))]
        if dims["shared_inter"]:
            out += _dense_mlp(f"{p}.mlp.shared_expert", h, dims["shared_inter"])
            out += _linear(f"{p}.mlp.shared_expert_gate", 1, h)
    else:
        out += _dense_mlp(f"{p}.mlp", h, dims["inter"], bias=bool(cfg.get("mlp_bias", False)))
    out += [(f"{p}.input_layernorm.weight", (h,)), (f"{p}.post_attention_layernorm.weight", (h,))]
    if family in ("gemma2", "gemma3_text"):
        out += [(f"{p}.pre_feedforward_layernorm.weight", (h,)), (f"{p}.post_feedforward_layernorm.weight", (h,))]
    return out


def shapes_from_hf_config(cfg: dict, *, source: str = "config.json") -> ModelShapes:
    """ModelShapes of a Hugging Face ``config.json`` dict (see FAMILIES)."""
    family = cfg.get("model_type")
    if family not in FAMILIES:
        raise MemoryModelError("model", f"{source}: model_type={family!r} is not supported; valid: {list(FAMILIES)}")
    h = int(_get(cfg, "hidden_size", source))
    nh = int(_get(cfg, "num_attention_heads", source))
    nkv = int(cfg.get("num_key_value_heads") or nh)
    hd = int(cfg.get("head_dim") or h // nh)
    vocab = int(_get(cfg, "vocab_size", source))
    moe = family in ("mixtral", "qwen2_moe", "qwen3_moe")
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0) if moe else 0
    dims = dict(
        h=h,
        nh=nh,
        nkv=nkv,
        hd=hd,
        inter=int(cfg.get("intermediate_size") or 0),
        experts=experts,
        moe_inter=int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or 0),
        shared_inter=int(cfg.get("shared_expert_intermediate_size") or 0) if family == "qwen2_moe" else 0,
        qk_norm=family in ("qwen3", "qwen3_moe", "gemma3_text"),
    )
    num_layers = int(_get(cfg, "num_hidden_layers", source))
    tied = cfg.get("tie_word_embeddings")
    tied = family in _TIED_BY_DEFAULT if tied is None else bool(tied)
    root = [("model.embed_tokens.weight", (vocab, h)), ("model.norm.weight", (h,))]
    if not tied:
        root.append(("lm_head.weight", (vocab, h)))
    return ModelShapes(
        name=str(cfg.get("_name_or_path") or source),
        family=family,
        vocab_size=vocab,
        hidden_size=h,
        num_heads=nh,
        num_kv_heads=nkv,
        head_dim=hd,
        intermediate_size=dims["inter"],
        root=tuple(root),
        layers=tuple(tuple(_layer_tensors(cfg, family, i, dims)) for i in range(num_layers)),
        moe_layers=tuple(_is_moe_layer(cfg, family, i) for i in range(num_layers)),
        num_experts=experts,
        experts_per_token=int(cfg.get("num_experts_per_tok") or 0) if moe else 0,
        moe_intermediate_size=dims["moe_inter"] if moe else 0,
        shared_expert_intermediate_size=dims["shared_inter"],
        qk_norm=dims["qk_norm"],
    )


def _qwen25(vocab, h, inter, layers, heads, kv, tied):
    return dict(
        model_type="qwen2",
        vocab_size=vocab,
        hidden_size=h,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        tie_word_embeddings=tied,
    )


def _llama3(h, inter, layers, heads, kv):
    return dict(
        model_type="llama",
        vocab_size=128256,
        hidden_size=h,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        tie_word_embeddings=False,
    )


# Published config.json dimensions (Hugging Face model cards).
NAMED_SIZES: dict[str, dict] = {
    "qwen2.5-0.5b": _qwen25(151936, 896, 4864, 24, 14, 2, True),
    "qwen2.5-1.5b": _qwen25(151936, 1536, 8960, 28, 12, 2, True),
    "qwen2.5-3b": _qwen25(151936, 2048, 11008, 36, 16, 2, True),
    "qwen2.5-7b": _qwen25(152064, 3584, 18944, 28, 28, 4, False),
    "qwen2.5-14b": _qwen25(152064, 5120, 13824, 48, 40, 8, False),
    "qwen2.5-32b": _qwen25(152064, 5120, 27648, 64, 40, 8, False),
    "qwen2.5-72b": _qwen25(152064, 8192, 29568, 80, 64, 8, False),
    "llama3-8b": _llama3(4096, 14336, 32, 32, 8),
    "llama3-70b": _llama3(8192, 28672, 80, 64, 8),
    "mixtral-8x7b": dict(
        model_type="mixtral",
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_local_experts=8,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    ),
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        tie_word_embeddings=False,
    ),
}


def _preset_shapes(name: str) -> ModelShapes:
    """The built-in decoder's presets (models/config.py) with its own parameter names."""
    from verl_balance.models.config import _PRESETS

    if name not in _PRESETS:
        raise MemoryModelError("model", f"unknown built-in preset {name!r}; valid: {sorted(_PRESETS)}")
    d = _PRESETS[name]
    h, nh, nkv, inter = d["hidden_size"], d["num_heads"], d["num_kv_heads"], d["intermediate_size"]
    hd = h // nh
    layers = []
    for i in range(d["num_layers"]):
        p = f"layers.{i}"
        layers.append(
            tuple(
                [(f"{p}.input_norm.weight", (h,))]
                + _linear(f"{p}.attn.q_proj", nh * hd, h)
                + _linear(f"{p}.attn.k_proj", nkv * hd, h)
                + _linear(f"{p}.attn.v_proj", nkv * hd, h)
                + _linear(f"{p}.attn.o_proj", h, nh * hd)
                + [(f"{p}.post_attn_norm.weight", (h,))]
                + _dense_mlp(f"{p}.mlp", h, inter)
            )
        )
    root = [("embed_tokens.weight", (d["vocab_size"], h)), ("norm.weight", (h,))]
    if not d.get("tie_word_embeddings", False):
        root.append(("lm_head.weight", (d["vocab_size"], h)))
    return ModelShapes(
        name=f"preset:{name}",
        family="builtin",
        vocab_size=d["vocab_size"],
        hidden_size=h,
        num_heads=nh,
        num_kv_heads=nkv,
        head_dim=hd,
        intermediate_size=inter,
        root=tuple(root),
        layers=tuple(layers),
        moe_layers=(False,) * d["num_layers"],
    )


def load_shapes(model: str) -> ModelShapes:
    """ModelShapes of a named size, ``preset:<name>``, or a directory / config.json path."""
    if model in NAMED_SIZES:
        shapes = shapes_from_hf_config(NAMED_SIZES[model], source=model)
        return ModelShapes(**{**shapes.__dict__, "name": model})
    if model.startswith("preset:"):
        return _preset_shapes(model.split(":", 1)[1])
    path = os.path.join(model, "config.json") if os.path.isdir(model) else model
    if not os.path.isfile(path):
        raise MemoryModelError(
            "model",
            f"{model!r} is neither a named size ({sorted(NAMED_SIZES)}), a preset:<name>, "
            "nor a model directory with config.json",
        )
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise MemoryModelError("model", f"{path}: not a readable JSON config ({e})") from e
    if not isinstance(cfg, dict):
        raise MemoryModelError("model", f"{path}: not a JSON object")
    if "text_config" in cfg and "hidden_size" not in cfg:
        cfg = {**cfg["text_config"], "model_type": cfg["text_config"].get("model_type", cfg.get("model_type"))}
    return shapes_from_hf_config(cfg, source=path)


# ---------------------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class MemoryLayout:
    """Parallel layout and step settings the estimate is for (names follow the CLI flags)."""

    dp: int = 1
    sp: int = 1
    param_dtype: str = "bfloat16"
    """Compute dtype of FSDP2 MixedPrecisionPolicy (engine param_dtype); master weights stay fp32."""
    tokens: int = 8192
    """Micro-batch tokens per SP rank (the token cap, e.g. max_token_len_per_gpu)."""
    activation_checkpointing: bool = False
    head_chunk: int | None = None
    """Tokens per output-head chunk; None = the full [T, V] logits at once."""
    prefetch_units: int = 2
    """Decoder-layer units all-gathered at once (the one computing plus the prefetched one)."""

    def __post_init__(self) -> None:
        for key in ("dp", "sp", "tokens", "prefetch_units"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise MemoryModelError(key, f"{key}={value!r} must be a positive int")
        if self.param_dtype not in DTYPE_BYTES:
            raise MemoryModelError("param-dtype", f"{self.param_dtype!r}; valid: {list(DTYPE_BYTES)}")
        if self.head_chunk is not None and (not isinstance(self.head_chunk, int) or self.head_chunk < 1):
            raise MemoryModelError("head-chunk", f"head_chunk={self.head_chunk!r} must be a positive int or None")

    @property
    def world_size(self) -> int:
        return self.dp * self.sp

    @property
    def sharded(self) -> bool:
        """The engine shards (FSDP2) unless it is one fp32 rank (train_engine.py)."""
        return self.world_size > 1 or self.param_dtype != "float32"


def layout_from_gpus(*, gpus: int | None, dp: int | None, sp: int, **kw) -> MemoryLayout:
    """A MemoryLayout from --gpus and/or --dp: dp defaults to gpus / sp, and dp * sp must equal gpus."""
    if not isinstance(sp, int) or sp < 1:
        raise MemoryModelError("sp", f"sp={sp!r} must be a positive int")
    if gpus is not None and (not isinstance(gpus, int) or gpus < 1):
        raise MemoryModelError("gpus", f"gpus={gpus!r} must be a positive int")
    if dp is None:
        if gpus is None:
            dp = 1
        elif gpus % sp:
            raise MemoryModelError("sp", f"sp={sp} does not divide gpus={gpus} (dp = gpus / sp)")
        else:
            dp = gpus // sp
    elif gpus is not None and dp * sp != gpus:
        raise MemoryModelError("dp", f"dp={dp} x sp={sp} = {dp * sp} ranks, but gpus={gpus}")
    return MemoryLayout(dp=dp, sp=sp, **kw)


def check_layout(shapes: ModelShapes, layout: MemoryLayout) -> None:
    """Raise MemoryModelError unless Ulysses can split the heads (attention.check_sequence_parallel_heads)."""
    sp = layout.sp
    if shapes.num_heads % sp:
        raise MemoryModelError("sp", f"sp={sp} must divide num_heads={shapes.num_heads} of {shapes.name}")
    if shapes.num_kv_heads % sp and sp % shapes.num_kv_heads:
        raise MemoryModelError(
            "sp", f"sp={sp} must divide num_kv_heads={shapes.num_kv_heads} of {shapes.name} or be a multiple of it"
        )


# ---------------------------------------------------------------------------------------- bytes
def local_rows(d0: int, *, world: int, rank: int) -> int:
    """Rows of a dim-0 FSDP2 shard on ``rank`` (torch.chunk semantics: ceil-sized chunks)."""
    chunk = -(-d0 // world)
    return max(0, min(chunk, d0 - rank * chunk))


def local_numel(tensors: Iterable[tuple[str, tuple[int, ...]]], *, world: int, rank: int) -> int:
    """Elements of this rank's shards of ``tensors``."""
    total = 0
    for _, shape in tensors:
        rest = math.prod(shape[1:])
        total += local_rows(shape[0], world=world, rank=rank) * rest
    return total


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank by component (see the module docstring for what each holds)."""

    shapes: ModelShapes
    layout: MemoryLayout
    params: int
    grads: int
    optimizer: int
    unsharded_params: int
    unsharded_grads: int
    activations: int
    head: int
    recompute: int
    startup_full: int
    startup_sharded: int
    per_token_layer: int = field(default=0)

    @property
    def state(self) -> int:
        """Sharded parameters + gradients + optimizer state (resident the whole run)."""
        return self.params + self.grads + self.optimizer

    @property
    def step_transient(self) -> int:
        """What a training step adds on top of the resident state at its peak (head or recompute, not both)."""
        return self.unsharded_params + self.unsharded_grads + self.activations + max(self.head, self.recompute)

    @property
    def total(self) -> int:
        return self.state + self.step_transient

    def rows(self) -> list[tuple[str, int]]:
        return [
            ("parameters (fp32 shard)", self.params),
            ("gradients (fp32 shard)", self.grads),
            ("optimizer (AdamW, 2 x fp32)", self.optimizer),
            ("unsharded params in flight", self.unsharded_params),
            ("unsharded grads in flight", self.unsharded_grads),
            ("activations (saved)", self.activations),
            ("layer recompute (AC)", self.recompute),
            ("output head", self.head),
            ("total (step peak)", self.total),
        ]


def state_bytes(shapes: ModelShapes, layout: MemoryLayout, *, rank: int = 0) -> dict[str, int]:
    """Exact sharded parameter, gradient and AdamW state bytes of ``rank``."""
    world = layout.world_size
    if not 0 <= rank < world:
        raise MemoryModelError("rank", f"rank={rank} outside [0, {world})")
    numel = local_numel(shapes.tensors(), world=world, rank=rank)
    num_tensors = len(shapes.tensors())
    return {"params": FP32 * numel, "grads": FP32 * numel, "optimizer": 2 * FP32 * numel + FP32 * num_tensors}


def activation_bytes_per_token(shapes: ModelShapes, *, layer: int, dtype_bytes: int) -> int:
    """Bytes autograd saves per token in decoder layer ``layer`` (MoE: router and the k active experts)."""
    b, h = dtype_bytes, shapes.hidden_size
    q, kv = shapes.num_heads * shapes.head_dim, shapes.num_kv_heads * shapes.head_dim
    norm = (FP32 + b) * h if b != FP32 else 2 * FP32 * h
    attn = norm + b * (3 * q + 2 * kv) + FP32 * shapes.num_heads
    if shapes.qk_norm:
        attn += (FP32 + b) * (q + kv)
    if shapes.moe_layers and shapes.moe_layers[layer]:
        k, mi = shapes.experts_per_token, shapes.moe_intermediate_size
        mlp = norm + FP32 * shapes.num_experts + k * b * (2 * h + 4 * mi)
        if shapes.shared_expert_intermediate_size:
            mlp += 4 * b * shapes.shared_expert_intermediate_size + b
    else:
        mlp = norm + 4 * b * shapes.intermediate_size
    return attn + mlp


def head_bytes_per_position(dtype_bytes: int) -> int:
    """Bytes per (token, vocab entry) of the head at its peak."""
    return dtype_bytes + 3 * FP32


def estimate(shapes: ModelShapes, layout: MemoryLayout, *, rank: int = 0) -> MemoryEstimate:
    """The per-rank memory of one training step (rank 0 holds the largest shards)."""
    check_layout(shapes, layout)
    b = DTYPE_BYTES[layout.param_dtype]
    state = state_bytes(shapes, layout, rank=rank)
    root = sum(math.prod(s) for _, s in shapes.root)
    layer_sizes = sorted((sum(math.prod(s) for _, s in layer) for layer in shapes.layers), reverse=True)
    in_flight = layer_sizes[: layout.prefetch_units]
    unsharded_params = unsharded_grads = 0
    if layout.sharded:
        unsharded_params = b * (root + sum(in_flight))
        reduce_copy = FP32 * layer_sizes[0] if b != FP32 else 0
        unsharded_grads = b * (root + layer_sizes[0]) + reduce_copy
    t = layout.tokens
    per_layer = [activation_bytes_per_token(shapes, layer=i, dtype_bytes=b) for i in range(shapes.num_layers)]
    final_norm = (FP32 + b) * shapes.hidden_size
    if layout.activation_checkpointing:
        activations = t * (b * shapes.hidden_size * shapes.num_layers + final_norm)
        recompute = t * max(per_layer)
    else:
        activations, recompute = t * (sum(per_layer) + final_norm), 0
    head_tokens = min(t, layout.head_chunk) if layout.head_chunk else t
    head = head_tokens * shapes.vocab_size * head_bytes_per_position(b)
    p = shapes.num_params
    return MemoryEstimate(
        shapes=shapes,
        layout=layout,
        params=state["params"],
        grads=state["grads"],
        optimizer=state["optimizer"],
        unsharded_params=unsharded_params,
        unsharded_grads=unsharded_grads,
        activations=activations,
        recompute=recompute,
        head=head,
        startup_full=FP32 * p,
        startup_sharded=state["params"],
        per_token_layer=max(per_layer),
    )


# ---------------------------------------------------------------------------------------- report
def _gib(n: int) -> str:
    return f"{n / GiB:,.2f}"


def format_report(est: MemoryEstimate, *, gpu_mem_gib: float | None = None, headroom: float = 0.1) -> str:
    """A plain-text table of ``est`` (GiB per rank)."""
    s, lay = est.shapes, est.layout
    moe = f", MoE {s.num_experts} experts / {s.experts_per_token} active" if s.num_experts else ""
    lines = [
        f"model {s.name} ({s.family}): {s.num_params:,} parameters ({s.num_active_params:,} active per token)"
        f"{moe}, {s.num_layers} layers, V={s.vocab_size}",
        f"layout dp={lay.dp} sp={lay.sp} (W={lay.world_size}), compute {lay.param_dtype}, "
        f"tokens/SP rank={lay.tokens}, activation checkpointing={'on' if lay.activation_checkpointing else 'off'}, "
        f"head chunk={lay.head_chunk or 'off'}",
        "",
        f"{'component':<32}{'GiB/rank':>12}",
        "-" * 44,
    ]
    for name, value in est.rows():
        if name.startswith("total"):
            lines.append("-" * 44)
        lines.append(f"{name:<32}{_gib(value):>12}")
    lines += [
        "",
        f"start-up, full fp32 model per rank (old path): {_gib(est.startup_full)} GiB",
        f"start-up, sharded loading (fp32 shard):        {_gib(est.startup_sharded)} GiB",
    ]
    if gpu_mem_gib is not None:
        usable = (1 - headroom) * gpu_mem_gib * GiB
        verdict = "yes" if est.total <= usable else "NO"
        lines.append(
            f"fits in {gpu_mem_gib:g} GiB with {headroom:.0%} headroom ({usable / GiB:,.1f} GiB usable): {verdict}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m verl_balance.memory", description=__doc__.splitlines()[0])
    parser.add_argument("model", help=f"HF model dir, config.json, preset:<name> or one of {sorted(NAMED_SIZES)}")
    parser.add_argument("--gpus", type=int, default=None, help="total ranks; dp defaults to gpus / sp")
    parser.add_argument("--dp", type=int, default=None)
    parser.add_argument("--sp", type=int, default=1, help="Ulysses sequence-parallel size")
    parser.add_argument("--param-dtype", default="bfloat16", choices=list(DTYPE_BYTES))
    parser.add_argument("--tokens", type=int, default=8192, help="micro-batch tokens per SP rank (token cap)")
    parser.add_argument("--ac", action="store_true", help="activation checkpointing per decoder layer")
    parser.add_argument("--head-chunk", type=int, default=None, help="tokens per output-head chunk")
    parser.add_argument("--gpu-mem", type=float, default=None, help="device memory in GiB: say whether it fits")
    parser.add_argument(
        "--headroom", type=float, default=0.1, help="fraction of --gpu-mem kept free (CUDA context, NCCL, allocator)"
    )
    args = parser.parse_args(argv)
    try:
        layout = layout_from_gpus(
            gpus=args.gpus,
            dp=args.dp,
            sp=args.sp,
            param_dtype=args.param_dtype,
            tokens=args.tokens,
            activation_checkpointing=args.ac,
            head_chunk=args.head_chunk,
        )
        est = estimate(load_shapes(args.model), layout)
    except MemoryModelError as e:
        parser.error(f"{'MODEL' if e.arg == 'model' else '--' + e.arg}: {e.message}")
    if not 0 <= args.headroom < 1:
        parser.error(f"--headroom: {args.headroom} must be in [0, 1)")
    print(format_report(est, gpu_mem_gib=args.gpu_mem, headroom=args.headroom))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
