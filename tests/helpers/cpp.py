"""C++ programs the CPU runners of generated CUDA C compile with the host g++, each source once per
process: the runners take their inputs as files and arguments, so the cases that differ only in
those (epilogue flags, inputs) share one compile (seconds each)."""
import atexit
import hashlib
import shutil
import subprocess
import tempfile
from pathlib import Path

_COMPILED = {}  # sha256 of a source -> its executable


def compiled_cpp(source: str) -> Path:
    """The executable g++ builds from `source` (C++20, -O1, threads, no FMA contraction: the CPU
    runners' products round as the GPU's separate multiply and add would)."""
    key = hashlib.sha256(source.encode()).hexdigest()
    if key not in _COMPILED:
        directory = Path(tempfile.mkdtemp(prefix="sparsecnn-cpu-runner-"))
        atexit.register(shutil.rmtree, directory, True)
        (directory / "run.cpp").write_text(source)
        subprocess.run(["g++", "-std=c++20", "-O1", "-pthread", "-ffp-contract=off", "-w", "run.cpp", "-o", "run"],
                       cwd=directory, check=True)
        _COMPILED[key] = directory / "run"
    return _COMPILED[key]
