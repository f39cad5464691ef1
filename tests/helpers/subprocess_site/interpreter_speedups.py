"""Triton's CPU interpreter set up for the test suite: two costs that check nothing on test shapes
are taken out. Applied by tests/conftest.py and, for the scripts the tests run in a fresh interpreter,
by this folder's sitecustomize; only under TRITON_INTERPRET=1, for the pinned triton (3.6)."""
import inspect
import os


def apply() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import triton.language as tl
    from triton.runtime import interpreter

    # The interpreter redoes every int32 add, sub and mul of a kernel in int64 to check it for
    # overflow: a third of an interpreted kernel's time. Test shapes are tiny, so no index comes near
    # 2**31 and the check can find nothing; the large shapes run compiled, in the `gpu` tests.
    interpreter.interpreter_builder.options = interpreter.InterpreterOptions(sanitize_overflow=False)
    _patch_builtins_by_name(interpreter, tl)


def _patch_builtins_by_name(interpreter, tl) -> None:
    """Every call of a @triton.jit helper from inside a kernel re-patches triton.language: the
    interpreter lists each module's members with `inspect.getmembers` (a sort of ~500 names) to find
    its builtins, a quarter of an interpreted kernel's time where helpers run in the loops. The
    builtins' names never change, so they are listed once, from the modules as imported (unpatched),
    and each call patches the same names in the same (sorted) order as the original. A module is
    patched whole or not at all, so one name tells whether it already is (inside a kernel it is)."""
    original = getattr(interpreter, "_patch_builtin", None)
    if original is None or getattr(original, "by_name", False):
        return
    names = {}

    def builtin_names(pkg):
        if id(pkg) not in names:
            names[id(pkg)] = [name for name, member in inspect.getmembers(pkg) if tl.core.is_builtin(member)]
        return names[id(pkg)]

    for pkg in (tl, tl.core, tl.tensor, tl.math, tl.core.tensor_descriptor_base):
        builtin_names(pkg)

    def patched(pkg):
        """Whether `pkg`'s builtins are replaced already (a module without builtins never is)."""
        listed = builtin_names(pkg)
        return bool(listed) and not tl.core.is_builtin(getattr(pkg, listed[0]))

    def patch_builtin(pkg, builder, scope):
        if not builtin_names(pkg) or patched(pkg):
            return
        for name in builtin_names(pkg):
            member = getattr(pkg, name)
            if tl.core.is_builtin(member):
                interpreter._patch_attr(pkg, name, member, builder, scope)

    patch_builtin.by_name = True
    interpreter._patch_builtin = patch_builtin
    _skip_repatching_in_helpers(interpreter, tl, patched)


def _skip_repatching_in_helpers(interpreter, tl, patched) -> None:
    """A jit helper called inside a kernel re-runs the whole patch (builtins, tensor methods, range,
    reduce) over modules the kernel's launch has patched already, with the same state-free
    replacements, and drops the result. When every module the helper sees is patched, that is
    skipped; otherwise (or at a launch) the original runs."""
    original = interpreter._patch_lang
    langs_of = {}
    always = (tl.tensor, tl.core.tensor_descriptor_base)

    def patch_lang(fn):
        if fn not in langs_of:
            langs_of[fn] = [value for value in fn.__globals__.values() if value is tl or value is tl.core]
        langs = langs_of[fn]
        if langs and all(patched(pkg) for pkg in (*langs, *always)):
            return interpreter._LangPatchScope()
        return original(fn)

    interpreter._patch_lang = patch_lang
