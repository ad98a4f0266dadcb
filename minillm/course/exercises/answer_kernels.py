"""The answer's Triton kernels in the grading process: rebuilt from their source, once it is Triton and nothing else.

A check of chapter 03 does more with a learner's ``@triton.jit`` kernel than call it: it launches it itself, traces
every address it loads and stores (:mod:`kernels.trace`), and draws them. So when a notebook is graded
(:mod:`minillm.course.exercises.grading`), a kernel the answer defines comes back from the answer's process as its
source and the values of the names it uses, and is rebuilt here. Rebuilding runs the learner's code in the grading
process, so the source must first be Triton only (:func:`kernel_problems`): one function, whose names are its
parameters, its locals, ``tl``/``triton``/``math`` and a few builtins, plain numbers, and other kernels; attributes
only of ``tl`` (its functions, types and ``tl.math``), of ``triton`` (``cdiv``, ``next_power_of_2``) and of values
(the methods of a Triton tensor: ``.to``, ``.dtype``...). Compiled for a GPU, a kernel can do no more than that; under
``TRITON_INTERPRET=1`` it runs as Python, and these rules keep it to what the compiler would accept.
"""
from __future__ import annotations

import ast
import builtins
import linecache
import math
import os
import textwrap
import types
from typing import Any

# What a kernel may call by name without importing it (the interpreter and the compiler both accept these).
_BUILTINS: dict[str, Any] = {name: getattr(builtins, name) for name in ("range", "min", "max", "len", "int", "float",
                                                                         "bool", "abs", "print", "tuple")}
_MODULES = {"tl": "triton.language", "triton": "triton", "math": "math"}
_TRITON_ATTRIBUTES = {"cdiv", "next_power_of_2", "language", "jit"}


class KernelRefused(AssertionError):
    """A kernel of the answer is not Triton only: it is not rebuilt (an ``AssertionError``, as a failed check)."""


def _tl() -> Any:
    import triton.language as tl

    return tl


def _allowed_attribute(base: Any, name: str) -> bool:
    """An attribute of a module the kernel may use: ``tl.<anything public>`` (``tl.math.<...>`` too),
    ``triton.<cdiv|next_power_of_2|language>``, ``math.<anything public>``."""
    if name.startswith("_"):
        return False
    if base is math:
        return True
    import triton

    if base is triton:
        return name in _TRITON_ATTRIBUTES
    value = getattr(base, name, None)
    if isinstance(value, types.ModuleType):
        return value.__name__.startswith("triton.language")
    return isinstance(base, types.ModuleType) and base.__name__.startswith("triton.language")


def _value_attribute(name: str) -> bool:
    """An attribute of a value inside a kernel (a Triton tensor or pointer): its public methods and properties."""
    tl = _tl()
    return not name.startswith("_") and (hasattr(tl.tensor, name) or name in ("dtype", "shape", "T",
                                                                                 "element_ty", "value"))


def kernel_problems(source: str, globals_: dict[str, Any]) -> list[str]:
    """Why ``source`` (one ``def``, its decorators aside) may not be rebuilt here, with ``globals_`` (name -> value
    of the names it uses that are not its own); ``[]`` when it is Triton only."""
    try:
        tree = ast.parse(textwrap.dedent(source))
    except SyntaxError as e:
        return [f"its source does not parse: {e}"]
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.FunctionDef):
        return ["its source is not one function"]
    fn = tree.body[0]
    problems: list[str] = []
    local = {a.arg for a in [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]}
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            local.add(node.id)
    for node in ast.walk(fn):
        if node is not fn and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef,
                                                ast.Import, ast.ImportFrom, ast.Global, ast.Nonlocal, ast.With,
                                                ast.AsyncWith, ast.Try, ast.Yield, ast.YieldFrom, ast.Await)):
            problems.append(f"line {node.lineno}: a {type(node).__name__} is not Triton")
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id not in local:
            if node.id in _BUILTINS or node.id in _MODULES:
                continue
            if node.id not in globals_:
                problems.append(f"line {node.lineno}: `{node.id}` is neither Triton, a number nor a kernel")
        elif isinstance(node, ast.Attribute):
            if node.attr.startswith("_"):
                problems.append(f"line {node.lineno}: `.{node.attr}` is not Triton")
                continue
            base = _resolve(node.value, local, globals_)
            if base is _VALUE:
                if not _value_attribute(node.attr):
                    problems.append(f"line {node.lineno}: `.{node.attr}` is not a method of a Triton tensor")
            elif base is _UNKNOWN or not _allowed_attribute(base, node.attr):
                problems.append(f"line {node.lineno}: `{ast.unparse(node)}` is not Triton")
    for default in [*fn.args.defaults, *fn.args.kw_defaults]:
        if default is not None and not isinstance(default, ast.Constant):
            problems.append(f"line {default.lineno}: a default that is not a constant")
    return problems


_VALUE, _UNKNOWN = object(), object()


def _resolve(node: ast.expr, local: set[str], globals_: dict[str, Any]) -> Any:
    """What an attribute's base is: a module (``tl``, ``tl.math``), :data:`_VALUE` (a local or an expression's
    value), or :data:`_UNKNOWN`."""
    if isinstance(node, ast.Name):
        if node.id in local:
            return _VALUE
        if node.id in _MODULES:
            import importlib

            return importlib.import_module(_MODULES[node.id])
        value = globals_.get(node.id, _UNKNOWN)
        return value if isinstance(value, types.ModuleType) else _UNKNOWN
    if isinstance(node, ast.Attribute):
        base = _resolve(node.value, local, globals_)
        if isinstance(base, types.ModuleType) and _allowed_attribute(base, node.attr):
            value = getattr(base, node.attr, _UNKNOWN)
            return value if isinstance(value, types.ModuleType) else _VALUE
        return _VALUE if base is _VALUE else _UNKNOWN
    return _VALUE  # a call's result, a subscript, ...: a value inside the kernel


def rebuild_kernel(name: str, source: str, globals_: dict[str, Any]) -> Any:
    """The kernel ``name`` of the answer, rebuilt here from ``source`` with ``globals_`` (plain numbers, other kernels,
    ``tl.constexpr`` values): an ``InterpretedFunction`` under ``TRITON_INTERPRET=1``, else a ``JITFunction``.

    Raises:
        KernelRefused: :func:`kernel_problems` found something that is not Triton.
    """
    import triton

    problems = kernel_problems(source, globals_)
    if problems:
        raise KernelRefused(f"your kernel {name} is graded in the grading process, so it must be Triton only: "
                            + "; ".join(problems[:5]))
    tree = ast.parse(textwrap.dedent(source))
    fn_def = tree.body[0]
    assert isinstance(fn_def, ast.FunctionDef)
    fn_def.decorator_list = []
    text = ast.unparse(tree) + "\n"
    filename = f"<answer kernel {name}>"
    linecache.cache[filename] = (len(text), None, text.splitlines(keepends=True), filename)  # getsource for Triton
    scope: dict[str, Any] = {"__builtins__": dict(_BUILTINS), "__name__": "__main__"}
    for alias, module in _MODULES.items():
        import importlib

        scope[alias] = importlib.import_module(module)
    for key, value in globals_.items():
        if isinstance(value, tuple) and len(value) == 2 and value[0] == "constexpr":
            value = _tl().constexpr(value[1])
        elif not (isinstance(value, (bool, int, float)) or value is None or is_kernel(value)):
            raise KernelRefused(f"your kernel {name} uses `{key}`, a {type(value).__name__}: a kernel may use only "
                                f"numbers, tl.constexpr values and other kernels")
        scope[key] = value
    exec(compile(text, filename, "exec"), scope)  # noqa: S102 - checked above: one Triton function, nothing else
    fn = scope[fn_def.name]
    if os.environ.get("TRITON_INTERPRET") == "1":
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(fn)
    return triton.jit(fn)


def is_kernel(obj: Any) -> bool:
    """A ``@triton.jit`` function (compiled or interpreted)."""
    return type(obj).__name__ in ("JITFunction", "InterpretedFunction") and hasattr(obj, "fn")


def kernel_spec(kernel: Any) -> tuple[str, dict[str, Any]]:
    """(source, globals) of a kernel defined in the answer's process: its source as the answer wrote it, and the
    values of the names it uses that are neither its own nor ``tl``/``triton``/``math``/builtins: numbers and
    ``tl.constexpr`` values, kernels (the answer's travel as kernels too; the package's by name). Names of other
    kinds are left out (the grading side then refuses the kernel, naming them)."""
    import inspect

    fn = kernel.fn
    source = textwrap.dedent(inspect.getsource(fn))
    tree = ast.parse(source)
    wanted = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    tl = _tl()
    out: dict[str, Any] = {}
    for name in sorted(wanted - set(_MODULES) - set(_BUILTINS)):
        if name not in fn.__globals__:
            continue
        value = fn.__globals__[name]
        if isinstance(value, (bool, int, float)) or value is None:
            out[name] = value
        elif isinstance(value, tl.constexpr) and isinstance(value.value, (bool, int, float, type(None))):
            out[name] = ("constexpr", value.value)  # rebuilt as tl.constexpr there (rebuild_kernel)
        elif is_kernel(value):
            out[name] = value
    return source, out
