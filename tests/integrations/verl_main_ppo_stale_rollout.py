"""Negative control for ``test_verl_main_ppo.py``: a ``verl_balance_cpu`` rollout whose server keeps
the first weights it receives and ignores every later update (a broken trainer -> rollout sync).

Loaded after ``cpu_rollout`` through ``VERL_USE_EXTERNAL_MODULES``; it re-registers the rollout name."""

from __future__ import annotations

from verl.workers.rollout.replica import RolloutReplicaRegistry

from verl_balance.integrations.verl.cpu_shims import rollout as cpu_rollout


class StaleCPURolloutServer(cpu_rollout.CPURolloutServer):
    """Loads the first weights it is sent, then drops every update."""

    def load_weights(self, named_tensors, *, global_steps=None) -> int:
        """The first call loads; later calls are ignored."""
        if self.num_weight_updates:
            return 0
        return super().load_weights(named_tensors, global_steps=global_steps)


class StaleCPURolloutReplica(cpu_rollout.CPURolloutReplica):
    """``CPURolloutReplica`` with the stale server."""

    server_class = StaleCPURolloutServer


RolloutReplicaRegistry.register(cpu_rollout.ROLLOUT_NAME, lambda: StaleCPURolloutReplica)
