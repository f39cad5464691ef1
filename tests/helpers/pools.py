"""Stand-ins for a worker pool's process pool (`core.workers.WorkerPool(new_pool=...)`): jobs run
inline, or are held running until the test finishes them."""
from concurrent.futures import Future


class InlinePool:
    """Runs each job at submission; counts them."""

    def __init__(self):
        self.jobs = 0

    def submit(self, fn, *args):
        self.jobs += 1
        future = Future()
        try:
            future.set_result(fn(*args))
        except Exception as error:  # noqa: BLE001
            future.set_exception(error)
        return future

    def shutdown(self, wait=True, cancel_futures=False):
        pass


class HeldPool(InlinePool):
    """Leaves every job running (its future unfinished) until `finish`."""

    def __init__(self):
        super().__init__()
        self.futures = []

    def submit(self, fn, *args):
        self.jobs += 1
        self.futures.append(Future())
        return self.futures[-1]

    def finish(self):
        for future in self.futures:
            future.set_result((0.0, 0.0, None))
