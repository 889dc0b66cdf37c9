"""``python -m verl_balance.main_sft [key=value ...]``: the SFT recipe entry point (Hydra)."""

from __future__ import annotations

import sys

import hydra

from verl_balance.trainer.ray_start import start_embedded_early, stops_at_once_before_the_run


@hydra.main(config_path="config", config_name="sft", version_base="1.3")
def hydra_main(cfg) -> None:
    """Train with the merged config (config/sft.yaml + command-line overrides); print the summary."""
    from verl_balance.trainer.config.cli import user_errors
    from verl_balance.trainer.driver import exit_code
    from verl_balance.trainer.sft_trainer import SFTTrainer, format_summary

    with user_errors():
        summary = SFTTrainer.train(cfg)
    print(format_summary(summary), flush=True)
    if exit_code(summary):  # stopped by SIGINT / SIGTERM after its save: 130 / 143, not 0
        sys.exit(exit_code(summary))


def main() -> None:
    """The command line: the embedded Ray cluster starting in the background while the config's modules import,
    overrides checked against the schema (a typo exits 2), then Hydra."""
    with stops_at_once_before_the_run():
        start_embedded_early(sys.argv[1:])
        from verl_balance.trainer.config import register_schemas
        from verl_balance.trainer.config.cli import run_recipe
        from verl_balance.trainer.config.sft import SFTConfig

        register_schemas()
        run_recipe(hydra_main, recipe="sft", schema=SFTConfig)


if __name__ == "__main__":
    main()
