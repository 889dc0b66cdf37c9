"""Test-only machinery: parity negative controls (``faults``) and the multi-process runner
(``multiprocess``). Only tests and the parity harness (``verl_balance.parity``) import it; the
engine, loss and trainers never do."""
