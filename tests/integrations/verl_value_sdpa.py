"""Test-only verl patch (imported in every verl process through ``VERL_USE_EXTERNAL_MODULES``): verl
0.9.1's ``load_valuehead_model`` asks for ``attn_implementation="flash_attention_2"``, which a CPU
host without flash-attn cannot load (verl then needs trl). The reference fsdp2 critic of
``verl_critic_pieces_runner.py`` loads the same ``AutoModelForTokenClassification`` with sdpa
instead: only the attention kernel changes, not the model."""

from __future__ import annotations

import verl.utils.model as verl_model


def load_valuehead_model(local_path, torch_dtype, model_config, trust_remote_code):
    from transformers import AutoModelForTokenClassification

    return AutoModelForTokenClassification.from_pretrained(
        pretrained_model_name_or_path=local_path,
        torch_dtype=torch_dtype,
        config=model_config,
        attn_implementation="sdpa",
        trust_remote_code=trust_remote_code,
    )


verl_model.load_valuehead_model = load_valuehead_model
