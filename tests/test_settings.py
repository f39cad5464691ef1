"""`sparsecnn.settings`: each SPARSECNN_* variable parsed when set, its default when unset, a clear
ValueError for a bad value; no other module reads one; importing the module reads nothing."""
import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sparsecnn import settings

PACKAGE = Path(settings.__file__).resolve().parent
HOME = Path.home()
HALF_THE_CPUS = max(1, min((os.cpu_count() or 1) // 2, settings.MAX_WORKERS))
ALL_THE_CPUS = max(1, min(os.cpu_count() or 1, settings.MAX_WORKERS))

# (setting, accessor, value to set, what the accessor returns for it, what it returns when unset)
CASES = [
    (settings.CACHE_DIR, settings.tuning_cache_dir, "~/tune", HOME / "tune", HOME / ".cache/sparsecnn/autotune"),
    (settings.CACHE, settings.codegen_cache_dir, "/tmp/kernels", Path("/tmp/kernels"),
     HOME / ".cache/sparsecnn/codegen"),
    (settings.CODEGEN_LOADER, settings.codegen_loader, " cupy ", "cupy", None),
    (settings.NVCC, settings.nvcc, "/opt/cuda/bin/nvcc", "/opt/cuda/bin/nvcc", None),
    (settings.PTXAS, settings.ptxas, "/opt/cuda/bin/ptxas", "/opt/cuda/bin/ptxas", None),
    (settings.MAX_PTX_ISA, settings.max_ptx_isa, " 8.7 ", (8, 7), None),
    (settings.FAST_LAUNCH, settings.fast_launch, " 0 ", False, True),
    (settings.PDL, settings.pdl, "0", False, True),
    (settings.UNROLLED_MAX_NNZ, settings.unrolled_max_nnz, "250000", 250_000, settings.UNROLLED_MAX_NNZ_DEFAULT),
    (settings.BLOCKS_WORKERS, settings.blocks_workers, "0", 0, HALF_THE_CPUS),
    (settings.COMPILE_WORKERS, settings.compile_workers, " 5", 5, ALL_THE_CPUS),
    (settings.DLMC, settings.dlmc_dir, "~/dlmc", HOME / "dlmc", None),
    (settings.COMMIT, settings.commit, "abc1234", "abc1234", None),
    (settings.SPUTNIK_LIB, settings.sputnik_lib, "~/peers/libsputnik_spmm.so", HOME / "peers/libsputnik_spmm.so",
     None),
    (settings.SPARSERT_COMPILE, settings.sparsert_compile, "~/peers/sparsert_compile.py",
     HOME / "peers/sparsert_compile.py", None),
]
BAD = [
    (settings.CODEGEN_LOADER, settings.codegen_loader, "nvrtc", "must be one of"),
    (settings.MAX_PTX_ISA, settings.max_ptx_isa, "nine", "must look like 9.0"),
    (settings.UNROLLED_MAX_NNZ, settings.unrolled_max_nnz, "0", "must be a positive int"),
    (settings.UNROLLED_MAX_NNZ, settings.unrolled_max_nnz, "-5", "must be a positive int"),
    (settings.UNROLLED_MAX_NNZ, settings.unrolled_max_nnz, "many", "must be a positive int"),
    (settings.BLOCKS_WORKERS, settings.blocks_workers, "-1", "must be a non-negative int"),
    (settings.COMPILE_WORKERS, settings.compile_workers, "two", "must be a non-negative int"),
    (settings.COMPILE_WORKERS, settings.compile_workers, "1.5", "must be a non-negative int"),
]


def test_every_setting_has_a_case_and_one_row():
    assert sorted(case[0].name for case in CASES) == sorted(row.name for row in settings.describe())
    assert len({row.name for row in settings.describe()}) == len(settings.describe())
    for row in settings.describe():
        assert row.name.startswith("SPARSECNN_") and row.type and row.default and row.meaning
    table = settings.markdown_table().splitlines()
    assert len(table) == 2 + len(settings.describe()) and all(line.count("|") == 5 for line in table)


@pytest.mark.parametrize("setting, accessor, value, parsed, default", CASES, ids=[c[0].name for c in CASES])
def test_a_setting_is_parsed_when_set_and_defaults_when_unset_or_empty(monkeypatch, setting, accessor, value,
                                                                      parsed, default):
    monkeypatch.setenv(setting.name, value)
    assert accessor() == parsed
    monkeypatch.delenv(setting.name)
    assert accessor() == default
    monkeypatch.setenv(setting.name, "")
    assert accessor() == default
    assert setting.name in accessor.__doc__


@pytest.mark.parametrize("setting, accessor, value, expected", BAD, ids=[f"{b[0].name}={b[2]}" for b in BAD])
def test_a_bad_value_raises_naming_the_variable_and_what_it_expects(monkeypatch, setting, accessor, value, expected):
    monkeypatch.setenv(setting.name, value)
    with pytest.raises(ValueError, match=re.escape(setting.name)) as raised:
        accessor()
    assert expected in str(raised.value) and repr(value.strip()) in str(raised.value)


@pytest.mark.parametrize("replaced", ["SPARSECNN_CODEGEN_WORKERS", "SPARSECNN_UNROLLED_WORKERS"])
def test_a_replaced_worker_variable_raises_naming_its_replacement(monkeypatch, replaced):
    monkeypatch.setenv(settings.COMPILE_WORKERS.name, "3")
    monkeypatch.setenv(replaced, "0")
    with pytest.raises(ValueError, match=re.escape(f"${replaced} is replaced by ${settings.COMPILE_WORKERS.name}")):
        settings.compile_workers()


def test_values_set_after_import_take_effect_on_the_next_call(monkeypatch):
    monkeypatch.setenv(settings.FAST_LAUNCH.name, "0")
    assert settings.fast_launch() is False
    monkeypatch.setenv(settings.FAST_LAUNCH.name, "1")
    assert settings.fast_launch() is True


def _environ_reads(tree: ast.AST):
    """(line, key) for each `os.environ[...]`, `os.environ.get(...)`, `os.getenv(...)` and similar;
    key: the literal key, or None when it is not a string literal."""
    def is_environ(node):
        return isinstance(node, ast.Attribute) and node.attr == "environ" or \
            isinstance(node, ast.Name) and node.id == "environ"

    for node in ast.walk(tree):
        target = None
        if isinstance(node, ast.Subscript) and is_environ(node.value):
            target = node.slice
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in ("get", "pop", "setdefault", "__getitem__") \
                    and is_environ(func.value) or \
                    isinstance(func, (ast.Attribute, ast.Name)) and getattr(func, "attr", getattr(func, "id", "")) \
                    in ("getenv", "getenvb"):
                target = node.args[0] if node.args else None
            else:
                continue
        else:
            continue
        key = target.value if isinstance(target, ast.Constant) and isinstance(target.value, str) else None
        yield node.lineno, key


def _offending_reads(path: Path):
    source = path.read_text()
    found = [f"{path.name}:{number}: {line.strip()}" for number, line in enumerate(source.splitlines(), 1)
             if re.search(r"""(environ\s*(\.\w+\s*\(|\[)|getenv\s*\()\s*f?["']SPARSECNN_""", line)]
    found += [f"{path.name}:{line}: environment read of {key or 'a computed name'}"
              for line, key in _environ_reads(ast.parse(source)) if key is None or key.startswith("SPARSECNN_")]
    return found


def test_no_module_but_settings_reads_a_sparsecnn_variable():
    offending = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path != PACKAGE / "settings.py":
            offending += [f"{path.relative_to(PACKAGE)}: {hit}" for hit in _offending_reads(path)]
    assert offending == []


def test_the_contract_catches_reads(tmp_path):
    code = ('"""SPARSECNN_DLMC in a docstring is fine; so is os.environ["CUDA_HOME"]."""\nimport os\n'
            'NAME = "SPARSECNN_DLMC"\n'
            'a = os.environ.get("SPARSECNN_CACHE")\n'
            'b = os.environ[NAME]\n'
            'c = os.getenv(f"SPARSECNN_{NAME}")\n'
            'd = os.environ.get("CUDA_HOME")\n')
    (tmp_path / "bad.py").write_text(code)
    lines = sorted({int(hit.split(":")[1]) for hit in _offending_reads(tmp_path / "bad.py")})
    assert lines == [4, 5, 6]


def test_settings_reads_only_inside_its_functions():
    tree = ast.parse((PACKAGE / "settings.py").read_text())
    module_level = [node for node in tree.body if not isinstance(node, (ast.FunctionDef, ast.ClassDef))]
    assert [line for node in module_level for line, _ in _environ_reads(node)] == []


def test_importing_settings_has_no_side_effects():
    # A fresh interpreter loads settings.py alone, with bad values set and os.environ recording every
    # access: the import reads and writes nothing and imports nothing of sparsecnn or torch.
    code = f"""
import importlib.util, os, sys
class Recording(dict):
    used = []
    def __getitem__(self, key): self.used.append(key); return super().__getitem__(key)
    def get(self, key, default=None): self.used.append(key); return super().get(key, default)
    def __contains__(self, key): self.used.append(key); return super().__contains__(key)
    def __setitem__(self, key, value): self.used.append(key); super().__setitem__(key, value)
before = dict(os.environ)
modules = set(sys.modules)
os.environ = Recording(before)
spec = importlib.util.spec_from_file_location("sparsecnn_settings_alone", {str(PACKAGE / "settings.py")!r})
module = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = module
spec.loader.exec_module(module)
assert Recording.used == [], Recording.used
assert dict(os.environ) == before
new = sorted(name for name in set(sys.modules) - modules
             if name.split(".")[0] in ("sparsecnn", "torch", "numpy", "triton"))
assert new == [], new
assert len(module.describe()) == {len(settings.describe())}
"""
    env = {**os.environ, "SPARSECNN_BLOCKS_WORKERS": "bad", "SPARSECNN_MAX_PTX_ISA": "nine",
           "SPARSECNN_UNROLLED_MAX_NNZ": "0", "SPARSECNN_CODEGEN_LOADER": "nvrtc"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_the_readme_lists_every_setting_as_settings_renders_them():
    from helpers.common import ROOT

    assert settings.markdown_table() in (ROOT / "README.md").read_text()
