"""``python -m verl_balance.main_sft [key=value ...]``: the SFT recipe entry point (Hydra)."""

from __future__ import annotations

import hydra

from verl_balance.trainer.cli import run_recipe, user_errors
from verl_balance.trainer.config import register_schemas
from verl_balance.trainer.sft_config import SFTConfig

register_schemas()


@hydra.main(config_path="config", config_name="sft", version_base="1.3")
def hydra_main(cfg) -> None:
    """Train with the merged config (config/sft.yaml + command-line overrides); print the summary."""
    from verl_balance.trainer.sft_trainer import SFTTrainer, format_summary

    with user_errors():
        print(format_summary(SFTTrainer.train(cfg)), flush=True)


def main() -> None:
    """The command line: overrides checked against the schema (a typo exits 2), then Hydra."""
    run_recipe(hydra_main, schema=SFTConfig)


if __name__ == "__main__":
    main()
