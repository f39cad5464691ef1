"""Imported at start-up by the scripts the tests run in a fresh interpreter (`helpers.scripts.run_script`
puts this folder first on PYTHONPATH): Triton's interpreter set up as tests/conftest.py sets it for the
suite itself (interpreter_speedups)."""
import interpreter_speedups

interpreter_speedups.apply()
