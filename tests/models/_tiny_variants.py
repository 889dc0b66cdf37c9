"""Tiny HF model variants shared by the tests in tests/models (see conftest.tiny_model_dirs)."""

# name -> write_tiny_model keyword arguments; together they cover every supported family, GQA with
# one KV head, tied and untied embeddings, an explicit head_dim (scaling != (hidden/heads)**-0.5),
# sliding windows shorter than the test sequences (per layer for gemma), attention and final
# logit soft-capping (gemma2), Granite's multipliers and logit scaling, and MoE routing.
TINY_VARIANTS = {
    "llama": dict(family="llama"),
    "llama_kv1_tied": dict(family="llama", num_kv_heads=1, tie_word_embeddings=True),
    "qwen2": dict(family="qwen2"),
    "qwen2_untied_window": dict(family="qwen2", tie_word_embeddings=False, sliding_window=4),
    "qwen3": dict(family="qwen3"),
    "mistral": dict(family="mistral", sliding_window=6),
    "gemma2": dict(family="gemma2"),
    "gemma3_text": dict(family="gemma3_text"),
    "phi3": dict(family="phi3"),
    "olmo2": dict(family="olmo2"),
    "granite": dict(family="granite"),
    "qwen2_moe": dict(family="qwen2_moe"),
    "qwen3_moe": dict(family="qwen3_moe"),
    "mixtral": dict(family="mixtral"),
    "deepseek_v2": dict(family="deepseek_v2"),
}
# The families added for issue 22 (each also gets an SP=2 and a parity row).
NEW_FAMILY_VARIANTS = ("gemma2", "gemma3_text", "phi3", "olmo2", "granite", "qwen3_moe", "mixtral", "deepseek_v2")
