"""The one skip reason of the tests that need verl (the ``verl`` extra), for every test directory."""

VERL_SKIP_REASON = "verl is not installed; install the extra with: pip install 'verl-balance[verl]'"
