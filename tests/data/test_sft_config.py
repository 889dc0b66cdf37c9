"""SFTDataConfig stays an OmegaConf structured config (the Hydra ``data`` section inherits from it)."""

from dataclasses import dataclass, fields
from typing import Any, Optional

import pytest
from omegaconf import OmegaConf

from verl_balance.data import DataError, SFTDataConfig


@dataclass
class _HydraDataSection(SFTDataConfig):
    """What the trainer's ``data`` section looks like: the dataset keys plus its own."""

    train_files: Optional[Any] = None
    train_batch_size: int = 32


def test_field_names_are_the_agreed_interface():
    names = [f.name for f in fields(SFTDataConfig)]
    assert names == [
        "prompt_key",
        "response_key",
        "messages_key",
        "tools_key",
        "max_length",
        "truncation",
        "on_malformed",
    ]


def test_inherited_section_merges_overrides_and_validates_on_to_object():
    schema = OmegaConf.structured(_HydraDataSection)
    merged = OmegaConf.merge(schema, OmegaConf.from_dotlist(["messages_key=chat", "max_length=64", "train_files=x"]))
    section = OmegaConf.to_object(merged)
    assert isinstance(section, SFTDataConfig) and section.messages_key == "chat" and section.max_length == 64
    with pytest.raises(DataError, match=r"truncation='middle' is invalid; valid values: error, left, right"):
        OmegaConf.to_object(OmegaConf.merge(schema, OmegaConf.from_dotlist(["truncation=middle"])))
    with pytest.raises(DataError, match="on_malformed='drop'"):
        OmegaConf.to_object(OmegaConf.merge(schema, OmegaConf.from_dotlist(["on_malformed=drop"])))
    with pytest.raises(DataError, match="max_length=1 is too small"):
        OmegaConf.to_object(OmegaConf.merge(schema, OmegaConf.from_dotlist(["max_length=1"])))
