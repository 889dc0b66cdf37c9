"""``python -m verl_balance.main_grpo [key=value ...]``: the GRPO recipe entry point (Hydra)."""

from __future__ import annotations

import sys

import hydra

from verl_balance.trainer.ray_start import start_embedded_early, stops_at_once_before_the_run


@hydra.main(config_path="config", config_name="grpo", version_base="1.3")
def hydra_main(cfg) -> None:
    """Train with the merged config (config/grpo.yaml + command-line overrides); print the summary."""
    from verl_balance.trainer.config.cli import user_errors
    from verl_balance.trainer.driver import exit_code
    from verl_balance.trainer.grpo.async_trainer import grpo_trainer_class
    from verl_balance.trainer.grpo.trainer import format_summary

    with user_errors():
        summary = grpo_trainer_class(cfg).train(cfg)
    print(format_summary(summary), flush=True)
    if exit_code(summary):  # stopped by SIGINT / SIGTERM after its save: 130 / 143, not 0
        sys.exit(exit_code(summary))


def main() -> None:
    """The command line: the embedded Ray cluster starting in the background while the config's modules import,
    overrides checked against the schema (a typo exits 2), then Hydra."""
    with stops_at_once_before_the_run():
        start_embedded_early(sys.argv[1:])
        from verl_balance.trainer.config.cli import run_recipe
        from verl_balance.trainer.config.grpo import GRPOConfig, register_grpo_schema

        register_grpo_schema()
        run_recipe(hydra_main, recipe="grpo", schema=GRPOConfig)


if __name__ == "__main__":
    main()
