"""Measurements a stage reports: the exact acceptance simulation over a run's answers, report tables and plots."""
