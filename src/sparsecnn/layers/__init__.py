"""The named benchmark suites from the papers, and suites read off our models."""
from sparsecnn.layers.suites import SUITES, get_suite, suite_names

__all__ = ["SUITES", "get_suite", "suite_names"]
