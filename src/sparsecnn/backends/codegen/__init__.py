"""Backend `codegen`: see `backend.py`."""
