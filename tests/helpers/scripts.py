"""Running and importing the scripts under benchmarks/ as a user does: a fresh interpreter on the
CPU with Triton in its interpreter, or the script imported by path (benchmarks/ on sys.path for the
helpers beside it)."""
import importlib.util
import os
import subprocess
import sys

from helpers.common import ROOT, SRC

BENCHMARKS = ROOT / "benchmarks"
SUBPROCESS_SITE = os.path.join(os.path.dirname(__file__), "subprocess_site")  # its sitecustomize


def script_module(name: str):
    """benchmarks/<name>.py imported as module `name`."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


def run_script(name: str, tmp_path, *args, timeout_s: int = 120) -> subprocess.CompletedProcess:
    """`python benchmarks/<name>.py ARGS` in tmp_path on the CPU (TRITON_INTERPRET=1, the suite's
    interpreter set-up: `subprocess_site`); asserts exit 0."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SUBPROCESS_SITE, str(SRC)]), "TRITON_INTERPRET": "1",
           "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, str(BENCHMARKS / f"{name}.py"), *map(str, args)], capture_output=True,
                          text=True, env=env, timeout=timeout_s, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    return done
