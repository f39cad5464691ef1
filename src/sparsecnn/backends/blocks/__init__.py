"""Backend `blocks`: see `backend.py`."""
