"""ring-flash-attention's test scripts are run by ``tests/test_rfa_suite.py``, not collected."""

collect_ignore_glob = ["test_*.py"]
