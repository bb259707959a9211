"""Helpers shared by several test modules (imported as ``_support.<module>``; tests/ is on
sys.path under pytest's default import mode)."""
