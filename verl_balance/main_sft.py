"""``python -m verl_balance.main_sft [key=value ...]``: the SFT recipe entry point (Hydra)."""

from __future__ import annotations

import hydra

from verl_balance.trainer.config import check_known_keys, register_schemas

register_schemas()


@hydra.main(config_path="config", config_name="sft", version_base="1.3")
def main(cfg) -> None:
    """Train with the merged config (config/sft.yaml + command-line overrides)."""
    from verl_balance.trainer.sft_trainer import SFTTrainer, format_summary

    check_known_keys(cfg)
    trainer = SFTTrainer(cfg)
    try:
        summary = trainer.fit()
    finally:
        trainer.close()
    print(format_summary(summary), flush=True)


if __name__ == "__main__":
    main()
