"""Write a tiny random Hugging Face causal-LM directory (config, safetensors, tokenizer) offline.

    python -m verl_balance.models.tiny_hf --family qwen2 --out /tmp/tiny-qwen2

The tokenizer is a byte-level BPE with a ChatML chat template whose eos is ``<|im_end|>``. Nothing is
downloaded. Weights come from ``torch.manual_seed(seed)``.
"""

from __future__ import annotations

import argparse
import logging
import os

import torch

from verl_balance.models.hf import SUPPORTED_MODEL_TYPES

# Every supported family has a tiny variant (tests check that packed logits equal HF's for each).
SUPPORTED_FAMILIES = SUPPORTED_MODEL_TYPES

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The same ChatML for conversations without tools; with tools (``apply_chat_template(..., tools=...)``) the
# hermes format of Qwen2.5's template: the tools' schemas in the system turn, the assistant's calls as
# ``<tool_call>{"name", "arguments"}</tool_call>``, consecutive tool answers in one user turn as
# ``<tool_response>...</tool_response>``.
TOOL_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and tools %}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ message['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "{% for call in message.get('tool_calls') or [] %}<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

logger = logging.getLogger(__name__)


def _corpus() -> list[str]:
    """Deterministic text covering digits, arithmetic, letters and chat words."""
    lines = []
    for a in range(0, 100, 7):
        for b in range(0, 100, 11):
            lines.append(f"{a}+{b}={a + b}. {a}*{b}={a * b}.")
    words = [
        "reverse",
        "sort",
        "copy",
        "the",
        "answer",
        "is",
        "user",
        "assistant",
        "system",
        "hello",
        "world",
        "abc",
        "xyz",
        "please",
        "compute",
        "what",
        "count",
        "letters",
    ]
    for i, w in enumerate(words):
        lines.append(f"{w} {words[(i * 5) % len(words)]} {w[::-1]} {''.join(sorted(w))}")
    lines.append("abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ 0123456789 \n\t.,;:!?'\"()[]{}+-*/=<>")
    return lines


def build_tokenizer(*, vocab_size: int = 384, chat_template: str = CHAT_TEMPLATE):
    """A PreTrainedTokenizerFast (byte-level BPE) with a ChatML template (tools in the hermes format)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_corpus(), trainer=trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tok.chat_template = chat_template
    return tok


def build_config(
    family: str,
    *,
    vocab_size: int,
    num_kv_heads: int = 2,
    tie_word_embeddings: bool | None = None,
    sliding_window: int | None = None,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int = 128,
    max_position_embeddings: int = 512,
):
    """A transformers config of ``family`` with tiny dimensions, each family's own features switched on
    at values a short test sequence feels."""
    import transformers

    if family not in SUPPORTED_FAMILIES:
        raise ValueError(f"--family {family!r} is not supported; valid: {SUPPORTED_FAMILIES}")
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        initializer_range=0.2,
        pad_token_id=0,
        eos_token_id=2,
        bos_token_id=None,
    )
    family_kwargs = _FAMILY_KWARGS[family](
        hidden_size=hidden_size, num_heads=num_heads, num_layers=num_layers, sliding_window=sliding_window
    )
    tie = family_kwargs.pop("_default_tie", False) if tie_word_embeddings is None else tie_word_embeddings
    config_class = getattr(transformers, _CONFIG_CLASSES[family])
    return config_class(**{**common, **family_kwargs}, tie_word_embeddings=bool(tie))


def _qwen_window(sliding_window: int | None) -> dict:
    return dict(use_sliding_window=sliding_window is not None, sliding_window=sliding_window, max_window_layers=0)


def _window(sliding_window: int | None, default: int) -> int:
    return default if sliding_window is None else sliding_window


def _gemma_layers(num_layers: int) -> list[str]:
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]


_CONFIG_CLASSES = {
    "llama": "LlamaConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
    "mistral": "MistralConfig",
    "gemma2": "Gemma2Config",
    "gemma3_text": "Gemma3TextConfig",
    "phi3": "Phi3Config",
    "olmo2": "Olmo2Config",
    "granite": "GraniteConfig",
    "qwen2_moe": "Qwen2MoeConfig",
    "qwen3_moe": "Qwen3MoeConfig",
    "mixtral": "MixtralConfig",
    "deepseek_v2": "DeepseekV2Config",
}
_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
# family -> f(hidden_size, num_heads, num_layers, sliding_window) -> config kwargs beyond `common`
# ("_default_tie": the family's tie_word_embeddings when the caller gives none).
_FAMILY_KWARGS = {
    "llama": lambda **kw: {},
    "qwen2": lambda *, sliding_window, **kw: dict(_qwen_window(sliding_window), _default_tie=True),
    "qwen3": lambda *, hidden_size, num_heads, sliding_window, **kw: dict(
        _qwen_window(sliding_window), head_dim=2 * hidden_size // num_heads, _default_tie=True
    ),
    "mistral": lambda *, sliding_window, **kw: dict(sliding_window=_window(sliding_window, 8)),
    "gemma2": lambda *, hidden_size, num_heads, num_layers, sliding_window, **kw: dict(
        head_dim=2 * hidden_size // num_heads,
        query_pre_attn_scalar=24,
        sliding_window=_window(sliding_window, 4),
        layer_types=_gemma_layers(num_layers),
        attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0,
        hidden_activation="gelu_pytorch_tanh",
        _default_tie=True,
    ),
    "gemma3_text": lambda *, hidden_size, num_heads, num_layers, sliding_window, **kw: dict(
        head_dim=2 * hidden_size // num_heads,
        query_pre_attn_scalar=24,
        sliding_window=_window(sliding_window, 4),
        layer_types=_gemma_layers(num_layers),
        _default_tie=True,
    ),
    "phi3": lambda *, sliding_window, **kw: dict(sliding_window=_window(sliding_window, 6)),
    "olmo2": lambda **kw: {},
    "granite": lambda **kw: dict(
        embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.3, logits_scaling=4.0
    ),
    "qwen2_moe": lambda *, sliding_window, **kw: dict(
        _qwen_window(sliding_window), num_experts=4, shared_expert_intermediate_size=48, **_MOE
    ),
    "qwen3_moe": lambda *, hidden_size, num_heads, sliding_window, **kw: dict(
        _qwen_window(sliding_window), num_experts=4, head_dim=2 * hidden_size // num_heads, **_MOE
    ),
    "mixtral": lambda *, sliding_window, **kw: dict(
        num_local_experts=4, num_experts_per_tok=2, sliding_window=_window(sliding_window, 6)
    ),
    # DeepSeek-V2-Lite-style: multi-head latent attention (no q LoRA; query/key head 24, value
    # head 12), one dense layer, then 4 routed experts (top-2) and a shared expert.
    "deepseek_v2": lambda *, num_heads, **kw: dict(
        num_key_value_heads=num_heads,
        n_routed_experts=4,
        n_shared_experts=1,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        **_MOE,
    ),
}


def write_tiny_model(
    out: str,
    *,
    family: str,
    seed: int = 0,
    num_kv_heads: int = 2,
    tie_word_embeddings: bool | None = None,
    sliding_window: int | None = None,
    initializer_range: float = 0.2,
    hidden_size: int = 64,
    chat_template: str = CHAT_TEMPLATE,
    max_position_embeddings: int = 512,
) -> str:
    """Write config.json, model.safetensors and the tokenizer files of a tiny random model to ``out``."""
    from transformers import AutoModelForCausalLM

    tokenizer = build_tokenizer(chat_template=chat_template)
    vocab_size = -(-len(tokenizer) // 64) * 64  # padded like real checkpoints (model vocab >= tokenizer's)
    config = build_config(
        family,
        vocab_size=vocab_size,
        num_kv_heads=num_kv_heads,
        tie_word_embeddings=tie_word_embeddings,
        sliding_window=sliding_window,
        hidden_size=hidden_size,
        max_position_embeddings=max_position_embeddings,
    )
    config.initializer_range = initializer_range
    config.pad_token_id = tokenizer.pad_token_id
    config.eos_token_id = tokenizer.eos_token_id
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    logger.info("wrote tiny %s model (%d parameters) to %s", family, sum(p.numel() for p in model.parameters()), out)
    return out


def main(argv: list[str] | None = None) -> None:
    """CLI: ``--family FAMILY --out DIR [--seed N] ...``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", required=True, choices=SUPPORTED_FAMILIES)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-kv-heads", type=int, default=2)
    parser.add_argument("--sliding-window", type=int, default=None)
    parser.add_argument("--initializer-range", type=float, default=0.2)
    parser.add_argument("--hidden-size", type=int, default=64, help="128: qwen3 head_dim 64, vLLM's CPU minimum")
    parser.add_argument("--tie", dest="tie", action="store_true", default=None)
    parser.add_argument("--no-tie", dest="tie", action="store_false")
    parser.add_argument("--tool-chat-template", action="store_true", help="ChatML with hermes tool calls")
    parser.add_argument("--max-position-embeddings", type=int, default=512)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    write_tiny_model(
        args.out,
        family=args.family,
        seed=args.seed,
        num_kv_heads=args.num_kv_heads,
        tie_word_embeddings=args.tie,
        sliding_window=args.sliding_window,
        initializer_range=args.initializer_range,
        hidden_size=args.hidden_size,
        chat_template=TOOL_CHAT_TEMPLATE if args.tool_chat_template else CHAT_TEMPLATE,
        max_position_embeddings=args.max_position_embeddings,
    )
    print(args.out)


if __name__ == "__main__":
    main()
