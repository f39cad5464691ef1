"""Backend `unrolled`: see `backend.py`."""
