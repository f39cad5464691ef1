"""Layer shapes (`ConvSpec`) and the named benchmark suites from the papers."""
from .spec import ConvSpec
from .suites import SUITES, get_suite, suite_names

__all__ = ["ConvSpec", "SUITES", "get_suite", "suite_names"]
