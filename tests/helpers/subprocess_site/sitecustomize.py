"""Imported at start-up by the scripts the tests run in a fresh interpreter (`helpers.scripts.run_script`
puts this folder first on PYTHONPATH): Triton's interpreter without its int32 overflow sanitizer, as
tests/conftest.py sets it for the suite itself (why: there)."""
import os

if os.environ.get("TRITON_INTERPRET") == "1":
    from triton.runtime import interpreter

    interpreter.interpreter_builder.options = interpreter.InterpreterOptions(sanitize_overflow=False)
