"""``python -m verl_balance.main_grpo [key=value ...]``: the GRPO recipe entry point (Hydra)."""

from __future__ import annotations

import hydra

from verl_balance.trainer.config import check_known_keys
from verl_balance.trainer.grpo_config import register_grpo_schema

register_grpo_schema()


@hydra.main(config_path="config", config_name="grpo", version_base="1.3")
def main(cfg) -> None:
    """Train with the merged config (config/grpo.yaml + command-line overrides)."""
    from verl_balance.trainer.grpo_trainer import GRPOTrainer, format_summary

    check_known_keys(cfg)
    trainer = GRPOTrainer(cfg)
    try:
        summary = trainer.fit()
    finally:
        trainer.close()
    print(format_summary(summary), flush=True)


if __name__ == "__main__":
    main()
