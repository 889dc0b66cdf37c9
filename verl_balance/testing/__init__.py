"""Test-only machinery: parity negative controls (``faults``) and the multi-process runner
(``multiprocess``). Production code never imports this package."""
