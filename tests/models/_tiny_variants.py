"""Tiny HF model variants shared by the tests in tests/models (see conftest.tiny_model_dirs)."""

# name -> write_tiny_model keyword arguments; together they cover every family, GQA with one KV
# head, tied and untied embeddings, an explicit head_dim (scaling != (hidden/heads)**-0.5) and
# sliding windows shorter than the test sequences.
TINY_VARIANTS = {
    "llama": dict(family="llama"),
    "llama_kv1_tied": dict(family="llama", num_kv_heads=1, tie_word_embeddings=True),
    "qwen2": dict(family="qwen2"),
    "qwen2_untied_window": dict(family="qwen2", tie_word_embeddings=False, sliding_window=4),
    "qwen3": dict(family="qwen3"),
    "mistral": dict(family="mistral", sliding_window=6),
}
