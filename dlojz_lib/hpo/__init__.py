"""dlojz_hpo.py's library: the search space file (space), the worker and the search (search), the report's files (report)."""
