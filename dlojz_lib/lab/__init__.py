"""dlojz_lab.py's comparison of a sweep's runs: table, CSV and plots (report)."""
