"""Model merging: strategies (``merge.strategies``), plan and checkpoint writer."""
