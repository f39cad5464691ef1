"""Backend `dense`: see `backend.py`."""
