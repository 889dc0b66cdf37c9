"""Data: tokenizers, synthetic tasks, SFT and RL datasets, and a resumable loader."""

from .io import DataError, MalformedRowError, SequenceTooLongError
from .loader import StatefulDataLoader, StatefulSampler
from .rl_dataset import RLDataConfig, RLPrompt, RLPromptDataset, collate_rl
from .sft_dataset import SFTDataConfig, SFTDataset, collate_sft, tokenize_chat
from .tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, TokenizerError, build_tokenizer

__all__ = [
    "ByteTokenizer",
    "DataError",
    "HFTokenizer",
    "MalformedRowError",
    "RLDataConfig",
    "RLPrompt",
    "RLPromptDataset",
    "SFTDataConfig",
    "SFTDataset",
    "SequenceTooLongError",
    "StatefulDataLoader",
    "StatefulSampler",
    "Tokenizer",
    "TokenizerError",
    "build_tokenizer",
    "collate_rl",
    "collate_sft",
    "tokenize_chat",
]
