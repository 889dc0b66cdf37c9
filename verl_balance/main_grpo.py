"""``python -m verl_balance.main_grpo [key=value ...]``: the GRPO recipe entry point (Hydra)."""

from __future__ import annotations

import hydra

from verl_balance.trainer.grpo_config import register_grpo_schema

register_grpo_schema()


@hydra.main(config_path="config", config_name="grpo", version_base="1.3")
def main(cfg) -> None:
    """Train with the merged config (config/grpo.yaml + command-line overrides); print the summary."""
    from verl_balance.trainer.grpo_trainer import GRPOTrainer, format_summary

    print(format_summary(GRPOTrainer.train(cfg)), flush=True)


if __name__ == "__main__":
    main()
