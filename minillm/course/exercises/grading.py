"""Grading out of the answer's reach: the check runs here, the learner's answer in a process of its own.

In a learner's kernel (JupyterLab) an answer and its check share one interpreter, and an answer can rewrite what
runs after it. So when a notebook is graded (``nbgrader autograde`` with the configuration of
``python -m minillm.course.exercises nbgrader``), the kernel that runs the check cells never runs the learner's
code:

1. Before the notebook runs, :class:`~minillm.course.exercises.nbgrader` builds the notebook to execute from the
   teacher's own copy (``source/``), with each answer cell replaced by a call of :func:`answer`, and writes a plan:
   the teacher's code cells and the learner's answers (each answer region: its ``# Exercise N.M:`` cell and the
   learner's cells up to its check), in order. Cells the learner added elsewhere are not run.
2. The first cell calls :func:`start`: the plan is read, the checks are imported, and grading mode is on.
3. Each :func:`answer` lints the answer (:mod:`minillm.course.exercises.lint`) before anything runs, then sends the
   teacher's cells that precede it and the answer to the answer's process (:mod:`~minillm.course.exercises.
   answer_process`), which runs them in one namespace. The names the answer defines come back as proxies: a
   function as :class:`RemoteFunction`, a class as a stand-in class whose methods run there, a value as its value.
4. The check cell runs here as it runs in JupyterLab. Each call of a proxy sends its arguments, runs the answer's
   code there under the tripwire, and brings back the result and the new state of every argument
   (:mod:`minillm.course.exercises.remote`). The reference and the comparison run here, after the reply.

So the verdict is the same function of the answer's outputs as in JupyterLab, and nothing the answer executes can
reach the check, the reference, or this kernel. Three kinds of check need more than calls:

- a check that watches how the answer uses the package (a forward hook on the model: :func:`watch_forward`; the
  calls of a package method: :func:`recording`) has the watch put there, and gets what it saw with each reply;
- a Triton kernel of the answer comes back as its source and is rebuilt here, once it is Triton only
  (:mod:`~minillm.course.exercises.answer_kernels`), so the check can launch and trace it;
- the capstone checks the learner's serving loop on the package's engine there, and the learner's parts as the
  engine here (:func:`~minillm.course.exercises.capstone.check_capstone`).
"""
from __future__ import annotations

import ast
import atexit
import builtins
import contextlib
import importlib
import io
import json
import os
import pickle
import socket
import subprocess
import sys
import threading
import types
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from minillm.course.exercises import answer_kernels, remote

ACTIVE = False  # grading mode is on in this process (set by start())
CALL_TIMEOUT_S = float(os.environ.get("MINILLM_ANSWER_TIMEOUT_S", "600"))

_PLAN: list[dict[str, Any]] = []
_NAMESPACE: dict[str, Any] = {}
_CLIENT: AnswerClient | None = None
_REFUSED: dict[str, BaseException] = {}

# The checks' modules, imported before any answer runs (an answer could change files on disk; a module already
# imported is not read again).
_CHECK_MODULES = ("minillm.course.exercises.check", "minillm.course.exercises.tripwire",
                  "minillm.course.exercises.capstone", "minillm.course.exercises.parts",
                  "minillm.course.exercises.lint", "minillm.course.exercises.ch10",
                  "minillm.course.exercises.ch10.persistent_batch", "minillm.course.exercises.ch10.placeholders",
                  "minillm.course.exercises.ch10.kv_per_rank", "minillm.course.exercises.ch10.tiny")


class AnswerError(Exception):
    """An error the answer raised in its process, of a type that does not exist here (its name is kept)."""


def start(plan_path: str, namespace: dict[str, Any]) -> None:
    """Grading mode for this kernel: read the plan, import the checks, and remember the notebook's namespace
    (``globals()`` of the notebook)."""
    global ACTIVE, _PLAN, _NAMESPACE, _CURRENT
    _CURRENT = -1  # the next cell to run is the plan's first
    _PLAN = json.loads(Path(plan_path).read_text())["cells"]
    _NAMESPACE = namespace
    for name in _CHECK_MODULES:
        importlib.import_module(name)
    for path in sorted(Path(__file__).parent.joinpath("challenges").glob("ch*.py")):
        importlib.import_module(f"minillm.course.exercises.challenges.{path.stem}")
    shell = getattr(sys.modules.get("IPython"), "get_ipython", lambda: None)()
    if shell is not None:  # count the cells as they run: a call first brings the answer's process up to here
        shell.events.register("pre_run_cell", _advance)
    ACTIVE = True


_CURRENT = 0  # the plan's index of the cell running now (the start cell is not in the plan)


def _advance(*_: Any) -> None:
    global _CURRENT
    _CURRENT += 1


def answer(index: int) -> None:
    """The answer cell at ``index`` of the plan: lint it, then run it in the answer's process after the cells
    before it, and bind the names it defines in the notebook's namespace as proxies."""
    from minillm.course.exercises.lint import AnswerRefused, check_answer, top_level_names

    cell = _PLAN[index]
    number, source = cell["exercise"], cell["source"]
    try:
        check_answer(source, number)
    except AnswerRefused as e:
        _REFUSED[number] = e
        for name in top_level_names(source):  # the names the check would look for
            _NAMESPACE[name] = RefusedAnswer(e)
        raise
    except SyntaxError:
        pass  # the learner's own error: it shows when the answer runs, as in JupyterLab
    client = _client()
    client.catch_up(index)
    names = client.request(("answer", f"<Exercise {number}>", source))
    client.bind(names, _NAMESPACE)


def raise_if_refused(numbers: Iterable[str], learner: Any) -> None:
    """The lint's refusal of the answer to one of ``numbers`` (or the one ``learner`` carries), if any."""
    if isinstance(learner, RefusedAnswer):
        raise learner.error
    for n in numbers:
        if n in _REFUSED:
            raise _REFUSED[n]


def _local_callable(obj: Any) -> bool:
    """A function of the check that pickle cannot name (a closure, a lambda, a wrapper, a method bound to one): it
    goes as an opaque placeholder, and comes back as itself."""
    if isinstance(obj, types.MethodType):
        return _local_callable(obj.__func__)
    if not isinstance(obj, types.FunctionType):
        return False
    found: Any = sys.modules.get(getattr(obj, "__module__", None) or "")
    for part in obj.__qualname__.split("."):
        found = getattr(found, part, None)
    return found is not obj


# What the checks watch in the answer's process: (spec, only, sink). A spec is ("methods", module, class qualname,
# names) or ("forward", shared key of an nn.Module); each recorded call ends in sink(name, args) here.
_RECORDERS: list[tuple[tuple[Any, ...], Any, Any]] = []


class Watch:
    """A watch of the answer's calls (:func:`recording`, :func:`watch_forward`); ``remove()`` ends it."""

    def __init__(self, spec: tuple[Any, ...], only: Any, sink: Any) -> None:
        self.entry = (spec, only, sink)
        _RECORDERS.append(self.entry)

    def remove(self) -> None:
        if self.entry in _RECORDERS:
            _RECORDERS.remove(self.entry)


@contextlib.contextmanager
def recording(cls: type, names: Iterable[str], only: Any = None,
              log: list[tuple[str, tuple[Any, ...]]] | None = None) -> Iterator[list[tuple[str, tuple[Any, ...]]]]:
    """The calls of ``cls``'s methods ``names`` the answer makes while it runs in its process (on ``only``, if
    given: the check's own object, as the answer's calls on its copy come back), as ``(name, args)``, in order
    (appended to ``log`` if given). A check that wraps a package method to see how the answer used it does this
    when grading."""
    log = [] if log is None else log
    w = Watch(("methods", cls.__module__, cls.__qualname__, tuple(names)), only,
              lambda name, args: log.append((name, args)))
    try:
        yield log
    finally:
        w.remove()


def watch_forward(module: torch.nn.Module, fn: Any) -> Watch:
    """``fn(args)`` with the positional inputs of each forward call of ``module`` the answer makes in its process
    (``module``: a submodule of the notebook's model, which both processes hold); what a check does with
    ``register_forward_hook`` in a learner's kernel."""
    entry = remote.shared_objects(_NAMESPACE).get(id(module))
    if entry is None or entry[0] is not module:
        raise ValueError(f"{type(module).__name__} is not a module of the notebook's model: it cannot be watched")
    return Watch(("forward", entry[1]), None, lambda name, args: fn(args))


class RefusedAnswer:
    """What a name of a refused answer holds: calling it, or handing it to a check, raises the lint's refusal."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise self.error

    def __getitem__(self, item: Any) -> Any:
        raise self.error

    def __getattr__(self, name: str) -> Any:
        raise self.error


def _client() -> AnswerClient:
    global _CLIENT
    if _CLIENT is None or not _CLIENT.alive():
        _CLIENT = AnswerClient(_NAMESPACE, plan=_PLAN)
    return _CLIENT


# --- the client ------------------------------------------------------------------------------------------------------

class RemoteFunction:
    """A function (or a Triton kernel) of the answer, called in the answer's process."""

    def __init__(self, client: AnswerClient, handle: int, name: str) -> None:
        self._client, self._handle, self.__name__ = client, handle, name
        self.__qualname__ = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._client.call(("handle", self._handle), args, kwargs)

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **kwargs: Any) -> Any:
            return self._client.call(("kernel", self._handle, grid), args, kwargs)
        return launch

    def __repr__(self) -> str:
        return f"<answer's function {self.__name__}>"

    def __copy__(self) -> RemoteFunction:
        return self  # a function: a check's copy of a state holding it holds the same one

    def __deepcopy__(self, memo: dict[int, Any]) -> RemoteFunction:
        return self


def _stand_in_of(cls: type) -> type | None:
    """The first stand-in class in ``cls``'s MRO (``None`` if it has none)."""
    return next((c for c in cls.__mro__ if "_minillm_answer_class" in vars(c)), None)


class AnswerClient:
    """The grading side of one answer's process: starts it, sends it cells and calls, reads its replies."""

    def __init__(self, namespace: dict[str, Any], plan: list[dict[str, Any]] | None = None,
                 timeout_s: float = CALL_TIMEOUT_S) -> None:
        self.namespace, self.plan, self.timeout_s = namespace, plan or [], timeout_s
        self.sent_cells = 0
        self.stand_ins: dict[int, type] = {}  # key there -> stand-in class here
        self.functions: dict[int, RemoteFunction] = {}
        self.local_classes: dict[int, type] = {}  # id -> a class of this side sent as ("compose", ...)
        self._opaque: dict[int, Any] = {}
        self.kernels: dict[int, Any] = {}  # handle -> the answer's kernel, rebuilt here
        self.kernel_handles: dict[int, int] = {}
        mine, theirs = socket.socketpair()
        env = dict(os.environ, MPLBACKEND="Agg")
        env.pop("MINILLM_GRADING_PLAN", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from minillm.course.exercises.answer_process import main; main()",
             str(theirs.fileno())], pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env)
        theirs.close()
        # Reap the process as soon as it exits. At shutdown ipykernel signals the kernel's children and waits until
        # none is left; an unreaped one stays a zombie child, so the kernel waited out jupyter_client's 2.5 s to
        # SIGTERM, on every graded notebook.
        threading.Thread(target=self.proc.wait, name="answer-process-reaper", daemon=True).start()
        self.sock = mine
        self.sock.settimeout(timeout_s)
        self._lock = threading.Lock()
        atexit.register(self.close)

    def __deepcopy__(self, memo: dict[int, Any]) -> AnswerClient:
        return self  # one process per notebook: never copied with a state that refers to it

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                remote.send(self.sock, pickle.dumps(("close",)))
                self.proc.wait(timeout=5)
            except Exception:  # noqa: BLE001 - it is going away in any case
                pass
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self.sock.close()

    # --- sending ----------------------------------------------------------------------------------------------------

    def _class_ref(self, cls: type) -> Any:
        """How a class of this side travels: a stand-in as the answer's class, a subclass of stand-ins (a check's
        guard, the capstone's composed scheduler) as a composition of its bases there."""
        if "_minillm_answer_class" in vars(cls):
            return ("answer", vars(cls)["_minillm_answer_class"])
        own = [k for k, v in vars(cls).items() if isinstance(v, (types.FunctionType, staticmethod, classmethod,
                                                                  property))]
        # its own methods, but not those wrapping the answer's (a guard's subclass): those are the answer's there
        own = [k for k in own if not any(k in vars(b) for b in cls.__mro__[1:] if "_minillm_answer_class" in vars(b))]
        self.local_classes[id(cls)] = cls
        # its own plain class attributes go too (a check's subclass that sets a parameter: C4's watermark)
        attrs = {k: v for k, v in vars(cls).items()
                 if not k.startswith("__") and isinstance(v, (bool, int, float, str, type(None)))}
        return ("compose", id(cls), cls.__name__,
                tuple(self._class_ref(b) if _stand_in_of(b) is not None else b for b in cls.__bases__), attrs,
                tuple(own))

    def _dumps(self, message: Any) -> tuple[bytes, dict[int, Any]]:
        shared = remote.shared_objects(self.namespace)
        client = self
        storages: set[int] = set()

        class RequestPickler(pickle.Pickler):
            def persistent_id(self, obj: Any) -> Any:
                entry = shared.get(id(obj))
                if entry is not None and entry[0] is obj:
                    return ("shared", entry[1])
                if isinstance(obj, RemoteFunction):
                    return ("handle", obj._handle)
                if id(obj) in client.kernel_handles:  # a rebuilt kernel: the answer's own there
                    return ("handle", client.kernel_handles[id(obj)])
                if isinstance(obj, type) and _stand_in_of(obj) is not None:
                    return ("class", client._class_ref(obj))
                if isinstance(obj, remote._LOCK_TYPES) or _local_callable(obj):
                    client._opaque[id(obj)] = obj
                    kind = {type(threading.Lock()): "lock", type(threading.RLock()): "rlock"}.get(type(obj), "opaque")
                    return ("opaque", id(obj), kind)
                return None

            def reducer_override(self, obj: Any) -> Any:
                if isinstance(obj, torch.Tensor):
                    return remote.view_reduce(obj, storages)
                if not isinstance(obj, type) and _stand_in_of(type(obj)) is not None:
                    state = dict(vars(obj)) if hasattr(obj, "__dict__") else None
                    return (object.__new__, (type(obj),), state)
                if isinstance(obj, types.MethodType) and hasattr(obj.__self__, "answer_side") and \
                        type(obj.__self__).__module__.startswith("minillm.course."):
                    side = obj.__self__.answer_side(obj.__func__.__name__)  # a check's part: the learner's there
                    if side is not None:
                        return (remote.part_in_answer, side)
                return remote.reduce_value(obj)

        buf = io.BytesIO()
        pickler = RequestPickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
        pickler.dump(message)
        memo = {i: o for i, o in pickler.memo.copy().values()}
        return buf.getvalue(), memo

    def _persistent_load(self, memo: dict[int, Any]) -> Any:
        shared_by_key = {key: obj for obj, key in remote.shared_objects(self.namespace).values()}

        def load(pid: Any) -> Any:
            if not isinstance(pid, tuple) or not pid:
                raise remote.WireError(f"unknown reference {pid!r}")
            kind = pid[0]
            if kind == "sent":
                if pid[1] not in memo:
                    raise remote.WireError(f"the answer's process named an object it was never sent ({pid[1]})")
                return memo[pid[1]]
            if kind == "shared":
                if pid[1] not in shared_by_key:
                    raise remote.WireError(f"the answer's process named {pid[1]!r}, which this side does not hold")
                return shared_by_key[pid[1]]
            if kind == "opaque":
                return self._opaque[pid[1]]
            if kind == "handle":
                h = pid[1]
                if h not in self.functions:
                    self.functions[h] = RemoteFunction(self, h, str(pid[2]) if len(pid) > 2 else "function")
                return self.functions[h]
            if kind == "class":
                return self._class_from(pid[1])
            if kind == "kernel":  # a Triton kernel of the answer: rebuilt here from its source (answer_kernels)
                _, h, name, source, names = pid
                if h not in self.kernels:
                    if not (isinstance(name, str) and isinstance(source, str) and isinstance(names, dict)):
                        raise remote.WireError("a malformed kernel")
                    try:
                        self.kernels[h] = answer_kernels.rebuild_kernel(name, source, names)
                    except answer_kernels.KernelRefused as e:
                        return RefusedAnswer(e)  # the check that uses it says why
                    self.kernel_handles[id(self.kernels[h])] = h
                return self.kernels[h]
            if kind == "kernelref":  # a kernel of the package, by name
                module, qualname = pid[1], pid[2]
                if not (isinstance(module, str) and remote.package_module(module) and isinstance(qualname, str)
                        and "." not in qualname):
                    raise remote.WireError(f"the answer's process named a kernel {module}.{qualname}")
                kernel = getattr(importlib.import_module(module), qualname, None)
                if not answer_kernels.is_kernel(kernel):
                    raise remote.WireError(f"{module}.{qualname} is not a kernel")
                return kernel
            raise remote.WireError(f"unknown reference {pid!r}")
        return load

    def _class_from(self, ref: Any) -> type:
        if ref[0] == "grading":
            return self.local_classes[ref[1]]
        if ref[0] != "answer":
            raise remote.WireError(f"unknown class reference {ref!r}")
        key = ref[1]
        if key in self.stand_ins:
            return self.stand_ins[key]
        _, key, name, qualname, bases, members, attrs = ref
        for base in bases:
            if not isinstance(base, type):
                raise remote.WireError(f"a base class {base!r} of {name}")
        namespace: dict[str, Any] = {"__module__": "__main__", "__qualname__": qualname, "_minillm_answer_class": key}
        for member, kind in members:
            namespace[member] = self._forward(key, member, kind)
        for attr, value in attrs.items():
            namespace.setdefault(attr, value)
        cls = type(str(name), tuple(bases), namespace)
        self.stand_ins[key] = cls
        return cls

    def _forward(self, key: int, member: str, kind: str) -> Any:
        client = self

        def method(*args: Any, **kwargs: Any) -> Any:
            return client.call(("method", key, member), args, kwargs)

        method.__name__ = method.__qualname__ = member
        if kind == "static":
            return staticmethod(method)
        if kind == "class":
            return classmethod(method)
        if kind == "property":
            return property(method)
        return method

    # --- requests ---------------------------------------------------------------------------------------------------

    def request(self, message: tuple[Any, ...]) -> Any:
        """Send ``message``, wait for the reply (at most the timeout), put the states back, print what the answer
        printed, and return the result or raise the answer's error."""
        with self._lock:
            data, memo = self._dumps(message)
            try:
                remote.send(self.sock, data)
                reply_bytes = remote.recv(self.sock)
            except TimeoutError:
                self.proc.kill()
                raise remote.WireError(f"the answer ran for more than {self.timeout_s:g} s and was stopped") from None
            except (EOFError, OSError) as e:
                code = self.proc.poll()
                raise remote.WireError(f"the answer's process ended (exit status {code}) before it replied: "
                                       f"{type(e).__name__}: {e}") from None
            try:
                reply = remote.SafeUnpickler(reply_bytes, self._persistent_load(memo),
                                             set(self.stand_ins.values())).load()
            except (remote.WireError, answer_kernels.KernelRefused):
                raise
            except Exception as e:  # noqa: BLE001
                raise remote.WireError(f"the answer's reply could not be read: {type(e).__name__}: {e}") from None
            if not (isinstance(reply, tuple) and len(reply) == 4 and reply[0] in ("ok", "error")):
                raise remote.WireError("the answer's process sent a malformed reply")
            status, result, states, printed = reply
            remote.apply_states(memo, states, remote.vehicle_numbers(memo))
            if isinstance(printed, str) and printed:
                print(printed, end="" if printed.endswith("\n") else "\n")
            if status == "error":
                raise _rebuild_error(result)
            return result

    def call(self, target: tuple[Any, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        from minillm.course.exercises.tripwire import active_exercises

        if self.plan and _CURRENT > 0:
            self.catch_up_before(_CURRENT)  # the teacher's cells that ran here since the answer (the model, say)
        watched = list(_RECORDERS)
        if not watched:
            return self.request(("call", active_exercises(), target, tuple(args), dict(kwargs)))
        out = self.request(("call", active_exercises(), target, tuple(args), dict(kwargs),
                            tuple(spec for spec, _, _ in watched)))  # what the checks watch, watched there
        if not (isinstance(out, tuple) and len(out) == 3 and out[0] == "recorded" and isinstance(out[2], list)):
            raise remote.WireError("the answer's process sent no record of the calls it was asked to watch")
        for entry in out[2]:
            if not (isinstance(entry, tuple) and len(entry) == 4 and isinstance(entry[0], int)
                    and 0 <= entry[0] < len(watched) and isinstance(entry[3], tuple)):
                raise remote.WireError("the answer's process sent a malformed record of a call")
            k, obj, name, call_args = entry
            _, only, sink = watched[k]
            if only is None or obj is only:
                sink(name, call_args)
        return out[1]

    def catch_up_before(self, position: int) -> None:
        """Run in the answer's process the teacher's cells of the plan before ``position`` not run there yet."""
        while self.sent_cells < min(position, len(self.plan)):
            cell = self.plan[self.sent_cells]
            self.sent_cells += 1
            if cell["kind"] == "setup":
                try:
                    self.request(("run", f"<cell {self.sent_cells - 1}>", cell["source"]))
                except remote.WireError:
                    raise
                except Exception as e:  # noqa: BLE001 - shown, and the answer goes on as it would in a kernel
                    print(f"(the answer's process: cell {self.sent_cells - 1} raised {type(e).__name__}: {e})")

    def catch_up(self, index: int) -> None:
        """Run in the answer's process the teacher's cells of the plan before ``index`` not run there yet, and count
        the cell at ``index`` (the answer's, whose source :func:`answer` sends itself) as sent."""
        self.catch_up_before(index)
        self.sent_cells = max(self.sent_cells, index + 1)

    def bind(self, names: Any, namespace: dict[str, Any]) -> None:
        """Put the names an answer defined into ``namespace``: functions as proxies, classes as stand-ins."""
        if not isinstance(names, dict):
            raise remote.WireError("the answer's process sent no names")
        for name, entry in names.items():
            if not (isinstance(name, str) and isinstance(entry, tuple) and len(entry) == 2):
                raise remote.WireError("the answer's process sent a malformed name")
            kind, value = entry
            if kind == "module":
                if isinstance(value, str) and value in sys.modules:
                    namespace[name] = sys.modules[value]
            elif kind in ("class", "function", "value"):
                namespace[name] = value
        return None


_BUILTIN_ERRORS = {name: obj for name, obj in vars(builtins).items()
                   if isinstance(obj, type) and issubclass(obj, BaseException)}


def _rebuild_error(info: Any) -> BaseException:
    """The answer's error, as the check would have met it in JupyterLab: the same type (a built-in one, the
    tripwire's, or one of the same name) and message; the answer's traceback is attached as a note."""
    from minillm.course.exercises.tripwire import DelegationError

    try:
        name, module, message, trace, trip = info
    except (TypeError, ValueError):
        return remote.WireError("the answer's process sent a malformed error")
    if trip is not None:
        exercise, target = trip
        err: BaseException = DelegationError(str(exercise), str(target))
    elif name == "WireError":
        err = remote.WireError(str(message))
    elif name in _BUILTIN_ERRORS and module == "builtins" and name not in ("SystemExit", "KeyboardInterrupt",
                                                                            "GeneratorExit"):
        cls = _BUILTIN_ERRORS[name]
        try:
            err = cls(message)
        except Exception:  # noqa: BLE001
            err = AnswerError(message)
    else:
        err = types.new_class(str(name), (AnswerError,))(str(message))
    if isinstance(trace, str) and trace:
        err.add_note("In the answer's process:\n" + trace)
    return err


# --- the capstone: a notebook's answers loaded in a process of their own ---------------------------------------------

def _answer_imports(imports: str) -> str:
    """A notebook's import lines without those of the course's checks (``minillm.course``: its check cells import
    them; an answer may not, and the lint refuses them in an answer's own cells)."""
    try:
        tree = ast.parse(imports)
    except SyntaxError:
        return imports  # the learner's own error: it shows when the lines run
    keep = []
    for node in tree.body:
        modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                   else [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
                   if isinstance(node, ast.ImportFrom) else [])
        if not any(m == "minillm.course" or m.startswith("minillm.course.") for m in modules):
            keep.append(ast.get_source_segment(imports, node) or "")
    return "\n".join(keep)


_CAPSTONE_CLIENT: AnswerClient | None = None


def load_answers(label: str, imports: str, answers: dict[str, str]) -> tuple[dict[str, Any], str | None]:
    """The capstone's loader in grading mode (:func:`minillm.course.exercises.parts.load_learner_parts`): run a
    notebook's import lines and its answers in a new answer process, each answer linted first. Returns the names
    (as proxies) and the first error, or ``None``."""
    from minillm.course.exercises.lint import AnswerRefused, check_answer

    global _CAPSTONE_CLIENT
    namespace: dict[str, Any] = {"__name__": f"learner_{label}"}
    # One answer process for every notebook the capstone reads (a namespace each): its parts call each other (the
    # learner's scheduler calls the learner's block allocation), so they must live where they can.
    if _CAPSTONE_CLIENT is None or not _CAPSTONE_CLIENT.alive():
        _CAPSTONE_CLIENT = AnswerClient({"__name__": "learner_capstone"})
    client = _CAPSTONE_CLIENT
    imports = _answer_imports(imports)
    try:
        client.request(("run", f"{label}:imports", imports, label, True))
    except Exception as e:  # noqa: BLE001
        return namespace, f"its import lines failed: {type(e).__name__}: {e}"
    for number, source in answers.items():
        try:
            check_answer(source, number)
        except AnswerRefused as e:
            return namespace, f"the cell of Exercise {number} was refused: {e}"
        except SyntaxError:
            pass
        try:
            client.bind(client.request(("answer", f"{label}:Exercise {number}", source, label)), namespace)
        except Exception as e:  # noqa: BLE001
            return namespace, f"the cell of Exercise {number} failed to run: {type(e).__name__}: {e}"
    return namespace, None
