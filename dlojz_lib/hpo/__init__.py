"""dlojz_hpo.py's search space file (space) and its report (report)."""
