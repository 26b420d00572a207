"""dlojz_lab.py's library: the sweeps and their states (sweep), the comparison's table, CSV and plots (report)."""
