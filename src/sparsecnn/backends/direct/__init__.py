"""Backend `direct`: see `backend.py`."""
