"""The process a learner's answer runs in when it is graded: ``python -m minillm.course.exercises.answer_process FD``.

The grading process (:mod:`minillm.course.exercises.grading`) starts one per graded notebook and talks to it over the
socket ``FD``. It sends the notebook's own cells (the teacher's: imports, the model, the lesson's setup) and each
answer, which run here in order in one namespace, as they would in the learner's kernel; then the check's calls of
the answer's functions and methods, each with its arguments. Each call runs here under the tripwire
(:func:`minillm.course.exercises.tripwire.building`: the package's own implementation of the part refuses to run),
and the reply is the result, the new state of every object the call was given (:mod:`minillm.course.exercises.
remote`), what the answer printed, or the error it raised.

Nothing here decides a grade. The reference and the comparison run in the grading process after the reply, where
nothing the answer runs can reach them. This process is the answer's: whatever it does to this process only changes
the answer's own outputs.
"""
from __future__ import annotations

import contextlib
import functools
import io
import itertools
import linecache
import pickle
import socket
import sys
import threading
import traceback
import types
from typing import Any

import torch

from minillm.course.exercises import answer_kernels, remote
from minillm.course.exercises.tripwire import DelegationError, building, tripped

_SKIP_MEMBERS = {"__dict__", "__weakref__", "__module__", "__qualname__", "__doc__", "__new__", "__init_subclass__",
                 "__class_getitem__", "__getattribute__", "__getattr__", "__setattr__", "__delattr__", "__reduce__",
                 "__reduce_ex__", "__getstate__", "__setstate__", "__del__", "__slots__", "__annotations__",
                 "__dataclass_fields__", "__dataclass_params__", "__match_args__", "__hash__", "__orig_bases__",
                 "__parameters__", "__abstractmethods__", "_abc_impl"}


class Placeholder:
    """Stands here for an object of the grading process that cannot travel (a lock of the engine, a generator):
    the answer may hold it, and it goes back as the grading process's own object."""

    def __init__(self, key: int, kind: str) -> None:
        self.key, self.kind = key, kind

    def __repr__(self) -> str:
        return f"<{self.kind} of the grading process>"


class _Handle:
    """A callable of this process, named in a reply (it goes back as ``("handle", number, name)``)."""

    def __init__(self, number: int, name: str) -> None:
        self.number, self.name = number, name


class AnswerServer:
    """Runs cells and calls for the grading process; see the module's docstring."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        main = types.ModuleType("__main__")
        main.__dict__["__builtins__"] = __builtins__
        sys.modules["__main__"] = main
        self.ns: dict[str, Any] = main.__dict__
        self.spaces: dict[str, dict[str, Any]] = {}  # the capstone's: one namespace per chapter notebook
        self.handles: dict[int, Any] = {}
        self.handle_of: dict[int, int] = {}
        self.classes: dict[int, type] = {}  # key -> a class of the answer (or of the notebook's cells)
        self.class_key: dict[int, int] = {}  # id(class) -> key
        self.composed: dict[int, type] = {}  # a grading-side class (a check's subclass) -> its class here
        self.composed_back: dict[int, int] = {}
        self._keys = itertools.count(1)
        self._memo: dict[int, Any] = {}
        self._shared_back: dict[int, tuple[str, ...]] = {}
        self._opaque_back: dict[int, int] = {}

    # --- reading a request ---------------------------------------------------------------------------------------

    def _persistent_load(self, pid: Any) -> Any:
        kind = pid[0]
        obj: Any
        if kind == "shared":
            obj = remote.resolve_shared(self.ns, pid[1])
            self._shared_back[id(obj)] = pid[1]
            return obj
        if kind == "opaque":
            if pid[2] == "lock":
                obj = threading.Lock()
            elif pid[2] == "rlock":
                obj = threading.RLock()
            else:
                obj = Placeholder(pid[1], pid[2])
            self._opaque_back[id(obj)] = pid[1]
            self._keep.append(obj)
            return obj
        if kind == "handle":
            return self.handles[pid[1]]
        if kind == "class":
            return self._class_here(pid[1])
        raise remote.WireError(f"unknown reference {pid!r}")

    def _class_here(self, ref: Any) -> type:
        if ref[0] == "answer":
            return self.classes[ref[1]]
        if ref[0] == "compose":  # ("compose", grading-side id, name, (base refs...), plain class attributes)
            _, kid, name, bases, attrs, own = ref
            if kid not in self.composed:
                here = tuple(self._class_here(b) if isinstance(b, tuple) else b for b in bases)
                cls = type(name, here, {"__module__": "__main__", **attrs,
                                        **{m: _grading_side_method(name, m) for m in own}})
                self.composed[kid], self.composed_back[id(cls)] = cls, kid
            return self.composed[kid]
        raise remote.WireError(f"unknown class reference {ref!r}")

    def _load(self, data: bytes) -> Any:
        self._keep: list[Any] = []
        remote.begin_request()
        unpickler = pickle.Unpickler(io.BytesIO(data))
        unpickler.persistent_load = self._persistent_load  # type: ignore[method-assign]
        message = unpickler.load()
        memo: dict[int, Any] = unpickler.memo.copy()  # index -> object (typeshed says (index, object) tuples)
        self._memo = memo
        self._versions = {i: o._version for i, o in memo.items() if isinstance(o, torch.Tensor)}
        return message

    # --- writing a reply -------------------------------------------------------------------------------------------

    def _handle(self, obj: Any) -> int:
        if id(obj) not in self.handle_of:
            h = next(self._keys)
            self.handles[h], self.handle_of[id(obj)] = obj, h
        return self.handle_of[id(obj)]

    def class_ref(self, cls: type) -> tuple[Any, ...]:
        """How a class of the answer travels: its key and, for the grading side to build its stand-in, its bases,
        members and plain attributes."""
        if id(cls) in self.composed_back:
            return ("grading", self.composed_back[id(cls)])
        if id(cls) not in self.class_key:
            key = next(self._keys)
            self.classes[key], self.class_key[id(cls)] = cls, key
        key = self.class_key[id(cls)]
        bases = tuple(self.class_ref(b) if b.__module__ == "__main__" else b for b in cls.__bases__)
        members, attrs = [], {}
        for name, value in vars(cls).items():
            if name in _SKIP_MEMBERS:
                continue
            if isinstance(value, types.FunctionType):
                members.append((name, "function"))
            elif isinstance(value, staticmethod):
                members.append((name, "static"))
            elif isinstance(value, classmethod):
                members.append((name, "class"))
            elif isinstance(value, property):
                members.append((name, "property"))
            elif callable(value) and not isinstance(value, type):
                members.append((name, "callable"))
            else:
                try:
                    pickle.dumps(value)
                except Exception:  # noqa: BLE001 - an attribute that cannot travel stays here
                    continue
                attrs[name] = value
        return ("answer", key, cls.__name__, cls.__qualname__, bases, tuple(members), attrs)

    def _reply(self, message: tuple[Any, ...]) -> bytes:
        sent = {id(o): i for i, o in self._memo.items()}
        server = self

        class ReplyPickler(pickle.Pickler):
            def persistent_id(self, obj: Any) -> Any:
                if isinstance(obj, _Handle):
                    return ("handle", obj.number, obj.name)
                if id(obj) in sent:
                    return ("sent", sent[id(obj)])
                if id(obj) in server._shared_back:
                    return ("shared", server._shared_back[id(obj)])
                if id(obj) in server._opaque_back:
                    return ("opaque", server._opaque_back[id(obj)])
                if isinstance(obj, type) and (obj.__module__ == "__main__" or id(obj) in server.composed_back):
                    return ("class", server.class_ref(obj))
                if isinstance(obj, (types.MethodType, functools.partial)) or (
                        isinstance(obj, types.FunctionType) and getattr(obj, "__module__", None) == "__main__"):
                    return ("handle", server._handle(obj), getattr(obj, "__name__", "function"))
                if answer_kernels.is_kernel(obj):  # a Triton kernel: its source, rebuilt there (answer_kernels)
                    module = getattr(obj.fn, "__module__", None)
                    if module == "__main__":
                        source, names = answer_kernels.kernel_spec(obj)
                        return ("kernel", server._handle(obj), obj.fn.__name__, source, names)
                    return ("kernelref", module, obj.fn.__qualname__)
                return None

            def reducer_override(self, obj: Any) -> Any:
                if isinstance(obj, torch.Tensor):
                    return remote.tensor_reduce(obj)
                return remote.reduce_value(obj)

        buf = io.BytesIO()
        ReplyPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(message)
        return buf.getvalue()

    # --- the operations ----------------------------------------------------------------------------------------------

    def _run(self, label: str, source: str, space: str | None = None, fresh: bool = False) -> Any:
        # its lines where inspect finds them: Triton reads a kernel's source, and so does answer_kernels
        linecache.cache[label] = (len(source), None, source.splitlines(keepends=True), label)
        try:
            code = compile(source, label, "exec")
        except SyntaxError:
            # a notebook cell with IPython's magics (%matplotlib inline): they mean nothing here; the rest runs.
            # (An answer with a magic never gets here: the lint refuses it.)
            plain = "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())
            code = compile(plain, label, "exec")
        exec(code, self._space(space, fresh))  # noqa: S102 - the notebook's cells and the answer: this process exists to run them
        return None

    def _space(self, space: str | None, fresh: bool = False) -> dict[str, Any]:
        """The namespace a cell runs in: the notebook's (``__main__``), or one of the capstone's, one per chapter
        notebook (its functions and classes count as the answer's, as in ``__main__``)."""
        if space is None:
            return self.ns
        if fresh or space not in self.spaces:
            self.spaces[space] = {"__name__": "__main__", "__builtins__": __builtins__}
        return self.spaces[space]

    def _answer(self, label: str, source: str, space: str | None = None) -> dict[str, Any]:
        ns = self._space(space)
        before = {k: id(v) for k, v in ns.items()}
        self._run(label, source, space)
        names: dict[str, Any] = {}
        for name, value in ns.items():
            if name.startswith("__") or before.get(name) == id(value):
                continue
            if isinstance(value, type):
                names[name] = ("class", value)
            elif answer_kernels.is_kernel(value):
                names[name] = ("value", value)  # a Triton kernel goes as its source (see _reply)
            elif callable(value) and not isinstance(value, types.ModuleType):
                # every callable travels as a handle (an alias of the package's function too: calling it there
                # meets the tripwire)
                names[name] = ("function", _Handle(self._handle(value), name))
            elif isinstance(value, types.ModuleType):
                names[name] = ("module", value.__name__)
            else:
                names[name] = ("value", value)
        return names

    def _call(self, numbers: list[str], target: tuple[Any, ...], args: tuple[Any, ...],
              kwargs: dict[str, Any], record: tuple[Any, ...] = ()) -> Any:
        if record:  # the check watches calls of package methods (grading.recording): watch them here
            with _recording(record, self.ns) as log:
                result = self._call(numbers, target, args, kwargs)
            return ("recorded", result, log)
        kind = target[0]
        if kind == "handle":
            fn = self.handles[target[1]]
        elif kind == "kernel":
            fn = self.handles[target[1]][target[2]]
        elif kind == "method":
            member = vars(self.classes[target[1]])[target[2]]
            fn = {staticmethod: lambda m: m.__func__, classmethod: lambda m: m.__func__,
                  property: lambda m: m.fget}.get(type(member), lambda m: m)(member)
        else:
            raise remote.WireError(f"unknown call target {target!r}")
        if not numbers:
            return fn(*args, **kwargs)
        with building(numbers, fn) as trip:
            result = fn(*args, **kwargs)
        if trip.target is not None:  # the answer caught the tripwire's error and went on: it still counts
            assert trip.exercise is not None  # set with the target
            raise DelegationError(trip.exercise, trip.target)
        return result

    def serve(self) -> None:
        while True:
            try:
                data = remote.recv(self.sock)
            except EOFError:
                return
            try:
                message = self._load(data)
            except Exception as e:  # noqa: BLE001
                remote.send(self.sock, self._reply(("error", ("WireError", "minillm.course.exercises.remote",
                                                              f"could not read the request: {e}", "", None), [], "")))
                continue
            op = message[0]
            if op == "close":
                return
            out = io.StringIO()
            try:
                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                    if op == "run":
                        result: Any = self._run(*message[1:])
                    elif op == "answer":
                        result = self._answer(*message[1:])
                    elif op == "call":
                        result = self._call(*message[1:])
                    elif op == "get":
                        result = self.ns[message[1]]
                    else:
                        raise remote.WireError(f"unknown operation {op!r}")
                reply: tuple[Any, ...] = ("ok", result, remote.states_of(self._memo, self._versions), out.getvalue())
            except BaseException as e:  # noqa: BLE001 - every error of the answer goes back to the check
                if isinstance(e, KeyboardInterrupt):
                    raise
                trip = (e.exercise, e.target) if isinstance(e, DelegationError) else None
                if trip is None and tripped() is not None:
                    trip = tripped()
                info = (type(e).__name__, type(e).__module__, str(e),
                        "".join(traceback.format_exception(type(e), e, e.__traceback__)), trip)
                try:
                    states = remote.states_of(self._memo, self._versions)
                    reply = ("error", info, states, out.getvalue())
                    data = self._reply(reply)
                except Exception:  # noqa: BLE001 - states that cannot travel: send the error alone
                    data = self._reply(("error", info, [], out.getvalue()))
                remote.send(self.sock, data)
                continue
            try:
                data = self._reply(reply)
            except Exception as e:  # noqa: BLE001 - a result that cannot travel is the answer's error
                info = ("TypeError", "builtins", f"the answer returned something that cannot be checked: "
                        f"{type(e).__name__}: {e}", "", None)
                data = self._reply(("error", info, [], out.getvalue()))
            remote.send(self.sock, data)


def _grading_side_method(cls_name: str, name: str) -> Any:
    """A method of a check's subclass: it runs in the grading process only, never here. (A check whose answer
    calls such a method puts it in a mixin class of a module instead: minillm.course.exercises.ch09.)"""
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{cls_name}.{name} is the check's own method: it runs in the grading process, not "
                           f"where the answer runs (the check must give it to the answer as a mixin of a module)")
    method.__name__ = name
    return method


@contextlib.contextmanager
def _recording(specs: tuple[Any, ...], ns: dict[str, Any]) -> Any:
    """While the answer runs, record each call of what ``specs`` name as ``(spec index, self, name, args)``:
    ``("methods", module, class qualname, method names)`` (package classes only), or ``("forward", shared key)``
    (a module of the notebook's model: its forward's positional inputs). Everything is put back afterwards."""
    import importlib

    log: list[tuple[int, Any, str, tuple[Any, ...]]] = []
    originals: list[tuple[type, str, Any]] = []
    hooks: list[Any] = []

    def wrap(k: int, name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def recorded(self: Any, *args: Any, **kwargs: Any) -> Any:
            log.append((k, self, name, args))
            return fn(self, *args, **kwargs)
        return recorded

    try:
        for k, spec in enumerate(specs):
            if spec[0] == "forward":
                target = remote.resolve_shared(ns, spec[1])
                hooks.append(target.register_forward_hook(
                    lambda m, args, out, k=k: log.append((k, None, "forward", tuple(args)))))
                continue
            _, module, qualname, names = spec
            if not remote.package_module(str(module)):
                raise remote.WireError(f"only the package's classes are watched, not {module}")
            cls: Any = importlib.import_module(module)
            for part in str(qualname).split("."):
                cls = getattr(cls, part)
            for name in names:
                originals.append((cls, name, cls.__dict__[name]))
                setattr(cls, name, wrap(k, name, cls.__dict__[name]))
        yield log
    finally:
        for cls, name, fn in reversed(originals):
            setattr(cls, name, fn)
        for h in hooks:
            h.remove()


def _die_with_parent() -> None:
    """Linux: end this process when the grading process ends (its kernel killed, say)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - elsewhere the socket's end stops it
        pass


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    _die_with_parent()
    sock = socket.socket(fileno=int(argv[0]))
    try:
        AnswerServer(sock).serve()
    finally:
        sock.close()


if __name__ == "__main__":
    main()
