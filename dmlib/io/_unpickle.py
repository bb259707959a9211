"""The one restricted unpickler every dmlib reader uses (torch files, DCP metadata).

A pickle is a program: its ``GLOBAL``/``STACK_GLOBAL`` opcodes name any importable
object and ``REDUCE``/``BUILD``/``NEWOBJ`` call it. This module runs that program with
none of Python's own resolution: each caller passes a table of exact
``(module, qualified name)`` pairs, each mapped to an object of dmlib's own making (a
:class:`Func` that validates its arguments, a :class:`Const`, or a :class:`Record`
class). Nothing is imported, no attribute is looked up by name, and a dotted name,
an unknown pair, or a call of anything that is not a :class:`Func` of the table is
refused with one line naming it.

Work is bounded as well: dictionary keys and set items must be plain values (hashing
a crafted nest of tuples can take exponential time), memo indices are capped, and
:func:`check_shape` measures the loaded object without expanding it (a 1 KiB pickle
can reference one list from another 10^7 times; walking that naively takes minutes)
before any caller flattens it.
"""

from __future__ import annotations

import io
import pickle
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from dmlib import _limits
from dmlib.errors import FormatError, UnsafePickleError

__all__ = [
    "Const",
    "Func",
    "NeedsTorch",
    "Record",
    "Limits",
    "check_shape",
    "load",
    "BASE_TABLE",
]


@dataclass(frozen=True)
class Limits:
    """How much a pickle may ask for (each exceeded limit is refused, not truncated).

    ``max_leaves`` and ``max_containers`` default (None) to :func:`dmlib._limits.max_entries`
    and :func:`dmlib._limits.max_containers`, read when a pickle is checked.
    """

    max_depth: int = 1000  # containers inside containers
    max_leaves: int | None = None  # values after expanding shared references
    max_containers: int | None = None  # containers after expanding them, empty ones included
    max_sharing: int = 8  # expanded / stored, once past ``free_leaves``
    free_leaves: int = 100_000
    max_memo: int = 50_000_000  # memo index (the C unpickler preallocates up to it)


LIMITS = Limits()


class NeedsTorch(Exception):  # noqa: N818  (a signal to the caller, not an error)
    """The pickle names a construct torch's own weights-only loader reads and this one does not."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


class Const:
    """A named constant of the table (a dtype, a device class...); calling it is refused."""

    __slots__ = ("qualname", "value")

    def __init__(self, qualname: str, value: Any = None) -> None:
        self.qualname = qualname
        self.value = value

    def __repr__(self) -> str:
        return f"<{self.qualname}>"


class Func:
    """A callable of the table: ``REDUCE`` calls ``fn(*args)``; ``fn`` validates them."""

    __slots__ = ("qualname", "fn")

    def __init__(self, qualname: str, fn: Callable[..., Any]) -> None:
        self.qualname = qualname
        self.fn = fn

    def __repr__(self) -> str:
        return f"<{self.qualname}>"


class Record:
    """A plain record a table may name as a class: ``NEWOBJ`` makes one, ``BUILD`` fills it.

    Subclasses set ``qualname``; attributes come only from the pickle's state dict (or
    ``fields`` for a state tuple), never from running any other class's code.
    """

    qualname = "record"
    fields: tuple[str, ...] = ()

    def build(self, state: Any) -> None:
        if (
            isinstance(state, tuple)
            and len(state) == 2
            and (state[0] is None or isinstance(state[0], dict))
        ):
            merged = dict(state[0] or {})
            if isinstance(state[1], dict):
                merged.update(state[1])
            state = merged
        if isinstance(state, tuple) and self.fields and len(state) == len(self.fields):
            state = dict(zip(self.fields, state, strict=True))
        if not isinstance(state, dict) or not all(type(k) is str for k in state):
            raise UnsafePickleError(
                f"BUILD of {self.qualname} with a state of type {type(state).__name__}"
            )
        for k, v in state.items():
            object.__setattr__(self, k, v)

    def __repr__(self) -> str:
        return f"<{self.qualname}>"


_ATOMS = (str, int, float, bool, type(None), bytes, complex)


def _safe_key(k: Any) -> bool:
    """Hashing and comparing this key costs O(its size): a plain value, or a flat tuple of them."""
    if isinstance(k, (*_ATOMS, Const, Func, Record)):  # records hash by identity
        return True
    return type(k) is tuple and len(k) <= 64 and all(isinstance(i, _ATOMS) for i in k)


def _decode_bytes(text: Any, encoding: Any = "latin1") -> bytes:
    """``_codecs.encode``: how protocol 2 pickles ``bytes`` (a str, latin-1, one byte a character)."""
    if type(text) is not str or encoding not in ("latin1", "latin-1"):
        raise UnsafePickleError("_codecs.encode used for something other than bytes")
    return text.encode("latin1")


def _ordered_dict(items: Any = ()) -> OrderedDict[Any, Any]:
    out: OrderedDict[Any, Any] = OrderedDict()
    if isinstance(items, Mapping):
        items = list(items.items())
    if not isinstance(items, (list, tuple)):
        raise UnsafePickleError("collections.OrderedDict called with a non-list")
    for pair in items:
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and _safe_key(pair[0])):
            raise UnsafePickleError("collections.OrderedDict called with a malformed item")
        out[pair[0]] = pair[1]
    return out


def _complex(real: Any = 0.0, imag: Any = 0.0) -> complex:
    if not all(type(x) in (int, float) for x in (real, imag)):
        raise UnsafePickleError("builtins.complex called with non-numbers")
    return complex(real, imag)


def _set(items: Any = ()) -> set[Any]:
    if not isinstance(items, (list, tuple)) or not all(_safe_key(i) for i in items):
        raise UnsafePickleError("builtins.set called with unhashable or nested items")
    return set(items)


def _bytearray(data: Any = b"") -> bytearray:
    if type(data) not in (bytes, list) or (
        type(data) is list and not all(type(i) is int for i in data)
    ):
        raise UnsafePickleError("builtins.bytearray called with something other than bytes")
    return bytearray(data)


#: what every table holds: the builtins protocol 2 needs for plain values
BASE_TABLE: dict[tuple[str, str], Any] = {
    ("_codecs", "encode"): Func("_codecs.encode", _decode_bytes),
    ("collections", "OrderedDict"): Func("collections.OrderedDict", _ordered_dict),
    ("builtins", "complex"): Func("builtins.complex", _complex),
    ("builtins", "set"): Func("builtins.set", _set),
    ("builtins", "bytearray"): Func("builtins.bytearray", _bytearray),
}
# protocol 2 (torch.save's) writes Python 2's module names: builtins is ``__builtin__``
BASE_TABLE.update(
    {("__builtin__", n): f for (m, n), f in list(BASE_TABLE.items()) if m == "builtins"}
)

# the pure-Python unpickler: its dispatch table is ours to restrict (typeshed lacks its internals)
_U: Any = pickle._Unpickler
_OP = {name: getattr(pickle, name)[0] for name in dir(pickle) if name.isupper() and isinstance(getattr(pickle, name), bytes) and len(getattr(pickle, name)) == 1}  # fmt: skip
# opcodes of plain data: safe as Python implements them
_PLAIN_OPS = """MARK STOP POP POP_MARK DUP FLOAT INT BININT BININT1 LONG BININT2 NONE STRING
BINSTRING SHORT_BINSTRING UNICODE BINUNICODE APPEND EMPTY_DICT APPENDS GET BINGET LONG_BINGET
LIST EMPTY_LIST TUPLE EMPTY_TUPLE BINFLOAT PROTO TUPLE1 TUPLE2 TUPLE3 NEWTRUE NEWFALSE LONG1
LONG4 BINBYTES SHORT_BINBYTES SHORT_BINUNICODE BINUNICODE8 BINBYTES8 EMPTY_SET
GLOBAL STACK_GLOBAL BINPERSID""".split()
_OPCODE_NAMES = {code: name for name, code in _OP.items()}


class _Restricted(_U):
    """pickle's own state machine with a dispatch table of plain-data opcodes plus ours."""

    dispatch: dict[int, Callable[[Any], None]] = {
        _OP[n]: _U.dispatch[_OP[n]] for n in _PLAIN_OPS if _OP.get(n) in _U.dispatch
    }

    def __init__(
        self,
        data: bytes | memoryview | Any,
        table: Mapping[tuple[str, str], Any],
        torch_only: frozenset[tuple[str, str]],
        persistent_load: Callable[[Any], Any] | None,
        limits: Limits,
    ) -> None:
        super().__init__(
            io.BytesIO(data) if isinstance(data, (bytes, bytearray, memoryview)) else data
        )
        self._table = table
        self._torch_only = torch_only
        self._pload = persistent_load
        self._limits = limits
        self.memo: dict[int, Any] = {}
        self._made = 0  # containers built so far
        self._most = limits.max_containers or _limits.max_containers()

    def load(self) -> Any:
        """pickle's own loop, reading straight from the file: a frame is a length hint
        (``FRAME`` is skipped), the bytes come in the same order either way."""
        self.read, self.readline = self._file_read, self._file_readline
        self.metastack: list[Any] = []
        self.stack: list[Any] = []
        self.append = self.stack.append
        self.proto = 0
        read, dispatch = self.read, self.dispatch
        try:
            while True:
                key = read(1)
                if not key:
                    raise EOFError
                dispatch[key[0]](self)
        except pickle._Stop as stop:  # type: ignore[attr-defined]
            return stop.value

    def _frame(self) -> None:
        self.read(8)

    # -- names
    def find_class(self, module: str, name: str) -> Any:
        what = f"{module}.{name}"
        what = what if len(what) <= 160 else f"{what[:120]}... ({len(what)} characters)"
        if "." in name or "<" in name:
            raise UnsafePickleError(f"names {what} (a dotted qualified name)")
        entry = self._table.get((module, name))
        if entry is not None:
            return entry
        if (module, name) in self._torch_only:
            raise NeedsTorch(what)
        raise UnsafePickleError(f"names {what}, which is not in its table of allowed globals")

    def persistent_load(self, pid: Any) -> Any:
        if self._pload is None:
            raise UnsafePickleError("holds a persistent id where none is expected")
        return self._pload(pid)

    # -- calls
    def _reduce(self) -> None:
        args = self.stack.pop()
        func = self.stack[-1]
        if not isinstance(func, Func):
            raise UnsafePickleError(
                f"REDUCE calls {_what(func)}, which is not a callable of its table"
            )
        if type(args) is not tuple:
            raise UnsafePickleError(
                f"REDUCE of {func.qualname} with arguments that are not a tuple"
            )
        try:
            self.stack[-1] = func.fn(*args)
        except TypeError:
            raise UnsafePickleError(
                f"{func.qualname} called with {len(args)} arguments it does not take"
            ) from None

    def _newobj(self) -> None:
        args = self.stack.pop()
        cls = self.stack.pop()
        if not (isinstance(cls, type) and issubclass(cls, Record)):
            raise UnsafePickleError(
                f"NEWOBJ builds {_what(cls)}, which is not a record class of its table"
            )
        if args != ():
            raise UnsafePickleError(f"NEWOBJ of {cls.qualname} with arguments")
        self.append(cls())

    def _build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        if isinstance(inst, Record):
            inst.build(state)
        elif (
            type(inst) is OrderedDict
            and isinstance(state, dict)
            and all(type(k) is str for k in state)
        ):
            pass  # a state dict's ``_metadata`` attribute: not data dmlib reads
        elif hasattr(inst, "pickle_build"):
            inst.pickle_build(state)
        else:
            raise UnsafePickleError(f"BUILD sets the state of {_what(inst)}")

    # -- hashing: keys and set items are plain values only
    def _setitem(self) -> None:
        value = self.stack.pop()
        key = self.stack.pop()
        self._put(self.stack[-1], [key, value])

    def _setitems(self) -> None:
        items = self.pop_mark()
        self._put(self.stack[-1], items)

    @staticmethod
    def _put(target: Any, items: list[Any]) -> None:
        if type(target) not in (dict, OrderedDict):
            raise UnsafePickleError(f"SETITEM on {_what(target)}")
        for i in range(0, len(items) - 1, 2):
            if not _safe_key(items[i]):
                raise UnsafePickleError(f"a dictionary key of type {type(items[i]).__name__}")
            target[items[i]] = items[i + 1]

    def _dict(self) -> None:
        items = self.pop_mark()
        d: dict[Any, Any] = {}
        self._put(d, items)
        self.append(d)

    def _additems(self) -> None:
        items = self.pop_mark()
        target = self.stack[-1]
        if type(target) is not set or not all(_safe_key(i) for i in items):
            raise UnsafePickleError(f"ADDITEMS on {_what(target)} or of unhashable items")
        target.update(items)

    def _frozenset(self) -> None:
        items = self.pop_mark()
        if not all(_safe_key(i) for i in items):
            raise UnsafePickleError("a frozenset of unhashable items")
        self.append(frozenset(items))

    # -- memo: indices capped (the C unpickler would allocate up to them)
    def _memo_at(self, i: int) -> None:
        if not 0 <= i <= self._limits.max_memo:
            raise UnsafePickleError(f"memo index {i} (at most {self._limits.max_memo})")
        self.memo[i] = self.stack[-1]

    def _binput(self) -> None:
        self.memo[self.read(1)[0]] = self.stack[-1]  # at most 255

    def _long_binput(self) -> None:
        i = int.from_bytes(self.read(4), "little")
        if i > self._limits.max_memo:
            raise UnsafePickleError(f"memo index {i} (at most {self._limits.max_memo})")
        self.memo[i] = self.stack[-1]

    def _memoize(self) -> None:
        self._memo_at(len(self.memo))

    def _put_text(self) -> None:
        self._memo_at(int(self.readline()[:-1]))


def _counted(op: Callable[[Any], None]) -> Callable[[Any], None]:
    """An opcode that builds a container, counted: a file may not build more containers
    than it may hold (each costs memory long before :func:`check_shape` could refuse it)."""

    def run(self: Any) -> None:
        self._made += 1
        if self._made > self._most:
            raise FormatError(
                f"builds more than {self._most:,} containers, more than one file may hold "
                "on this machine; refusing to read it (set DMLIB_MAX_ENTRIES to read a file "
                "you trust)"
            )
        op(self)

    return run


def _refuser(name: str | None) -> Callable[[Any], None]:
    """The dispatch entry of an opcode dmlib does not run."""

    def refuse(self: Any) -> None:
        raise UnsafePickleError(
            f"uses opcode {name}, which dmlib does not run" if name else "uses an unknown opcode"
        )

    return refuse


for _code in range(256):
    if _code not in _Restricted.dispatch:
        _Restricted.dispatch[_code] = _refuser(_OPCODE_NAMES.get(_code))


for _name, _fn in {
    "REDUCE": _Restricted._reduce,
    "NEWOBJ": _Restricted._newobj,
    "BUILD": _Restricted._build,
    "SETITEM": _Restricted._setitem,
    "SETITEMS": _Restricted._setitems,
    "DICT": _Restricted._dict,
    "ADDITEMS": _Restricted._additems,
    "FROZENSET": _Restricted._frozenset,
    "BINPUT": _Restricted._binput,
    "LONG_BINPUT": _Restricted._long_binput,
    "MEMOIZE": _Restricted._memoize,
    "PUT": _Restricted._put_text,
    "FRAME": _Restricted._frame,
}.items():
    _Restricted.dispatch[_OP[_name]] = _fn
for _name in "EMPTY_LIST LIST EMPTY_DICT DICT EMPTY_TUPLE TUPLE TUPLE1 TUPLE2 TUPLE3 EMPTY_SET FROZENSET".split():
    _Restricted.dispatch[_OP[_name]] = _counted(_Restricted.dispatch[_OP[_name]])


def _what(obj: Any) -> str:
    q = getattr(obj, "qualname", None)
    return q if isinstance(q, str) else f"a {type(obj).__name__}"


def load(
    data: bytes | memoryview | Any,
    table: Mapping[tuple[str, str], Any],
    *,
    what: str,
    path: str | None,
    torch_only: frozenset[tuple[str, str]] = frozenset(),
    persistent_load: Callable[[Any], Any] | None = None,
    limits: Limits = LIMITS,
) -> Any:
    """Unpickle ``data`` (bytes, or a binary file read from its position; ``what`` names it in messages) resolving only ``table``'s names.

    Raises :class:`UnsafePickleError` for anything outside the table (one line naming the
    global or opcode), :class:`FormatError` for a damaged pickle, and :class:`NeedsTorch`
    for a name in ``torch_only``. The result is checked with :func:`check_shape`.
    """
    up = _Restricted(data, table, torch_only, persistent_load, limits)
    try:
        obj = up.load()
    except NeedsTorch:
        raise
    except UnsafePickleError as err:
        raise UnsafePickleError(
            f"{what} {err.message}; refusing to unpickle it", path=path
        ) from None
    except FormatError as err:  # a caller's persistent_load or Func refused a value
        raise type(err)(f"{what}: {err.message}", path=path) from None
    except RecursionError:
        raise FormatError(f"{what} nests too deeply", path=path) from None
    except MemoryError:
        raise FormatError(f"{what} asks for more memory than there is", path=path) from None
    except Exception as err:  # a damaged pickle raises any of a dozen types
        text = " ".join(str(err).split())[:120]
        raise FormatError(
            f"unreadable {what}, not a valid pickle ({type(err).__name__}: {text})", path=path
        ) from None
    check_shape(obj, what=what, path=path, limits=limits)
    return obj


def _children(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return obj.values()
    if isinstance(obj, (list, tuple)):
        return obj
    if isinstance(obj, (set, frozenset)):
        return ()  # items are plain values (checked when the set was built)
    return None


def check_shape(obj: Any, *, what: str, path: str | None, limits: Limits = LIMITS) -> int:
    """The number of leaves ``obj`` flattens to, refusing cycles, deep nests and bombs.

    Each container is visited once (shared ones are counted by reference, not walked
    again), so the cost is the size of the pickle, whatever it expands to. What is
    bounded is the work of the walk that later flattens ``obj``: its leaves and its
    containers (empty ones too: ``[x, x]`` nested 40 times over ``[]`` holds no leaf but
    2**41 lists once expanded), each after shared references are expanded.
    """
    bounds = (
        limits.max_leaves or _limits.max_entries(),
        limits.max_containers or _limits.max_containers(),
    )
    done: dict[int, tuple[int, int, int]] = {}  # id -> (leaves, containers, depth) expanded
    on_path: set[int] = set()
    stored = [0]  # items and containers as stored in the pickle
    stack: list[tuple[Any, int]] = [(obj, 0)]  # (container, state: 0 enter, 1 leave)
    keep: list[Any] = []  # keeps visited containers alive, so their ids stay theirs
    while stack:
        node, state = stack.pop()
        kids = _children(node)
        if kids is None:
            continue
        key = id(node)
        if state == 1:
            on_path.discard(key)
            done[key] = _measured(kids, done, stored[0], bounds, limits, what, path)
            continue
        if key in done:
            continue
        if key in on_path:
            raise FormatError(f"{what} holds a container that contains itself", path=path)
        on_path.add(key)
        keep.append(node)
        stored[0] += len(kids) + 1
        if len(on_path) > limits.max_depth:
            raise FormatError(
                f"{what} nests containers more than {limits.max_depth} deep", path=path
            )
        stack.append((node, 1))
        for k in kids:
            if _children(k) is not None and id(k) not in done:
                stack.append((k, 0))
    top = _children(obj)
    if top is None:
        _measured((obj,), done, 1, bounds, limits, what, path)  # one plain value
        return 1
    return done[id(obj)][0]


def _measured(
    kids: Any,
    done: dict[int, tuple[int, int, int]],
    stored: int,
    bounds: tuple[int, int],
    limits: Limits,
    what: str,
    path: str | None,
) -> tuple[int, int, int]:
    """(leaves, containers, depth) of a container whose children are measured, refused
    past the bounds: more leaves or containers than one file may hold, or more expanded
    from fewer stored ones than honest sharing explains."""
    leaves, nodes, deep = 0, 1, 0
    for k in kids:
        if _children(k) is None:
            leaves += 1
            if type(k) is int and k.bit_length() > _limits.MAX_INT_BITS:
                raise FormatError(
                    f"{what} holds an integer of {k.bit_length():,} bits, more than the "
                    f"{_limits.MAX_INT_BITS:,} a plain value may have",
                    path=path,
                )
        else:
            n_leaves, n_nodes, n_deep = done[id(k)]
            leaves, nodes, deep = leaves + n_leaves, nodes + n_nodes, max(deep, n_deep)
    if leaves > bounds[0]:
        raise FormatError(
            f"{what} flattens to at least {leaves:,} entries (shared references expanded), "
            f"more than the {bounds[0]:,} one file may hold on this machine; refusing to "
            "expand it (set DMLIB_MAX_ENTRIES to read a file you trust)",
            path=path,
        )
    if nodes > bounds[1]:
        raise FormatError(
            f"{what} holds at least {nodes:,} containers once shared references are "
            f"expanded (empty ones included), more than the {bounds[1]:,} one file may "
            "hold on this machine; refusing to expand it",
            path=path,
        )
    work = leaves + nodes
    if work > limits.free_leaves and work > limits.max_sharing * stored:
        raise FormatError(
            f"{what} refers to the same containers so often that it expands to at least "
            f"{work:,} entries and containers from {stored:,} stored ones; refusing to "
            "expand it",
            path=path,
        )
    if deep + 1 > limits.max_depth:
        raise FormatError(f"{what} nests containers more than {limits.max_depth} deep", path=path)
    return leaves, nodes, deep + 1


def vet_globals(
    f: Any,
    table: Mapping[tuple[str, str], Any],
    torch_only: frozenset[tuple[str, str]],
    *,
    what: str,
    path: str | None,
    count: int = 1,
) -> None:
    """Before a pickle is handed to torch's own loader: every global it names is in
    ``table`` or ``torch_only`` (exact pairs), and it uses no opcode that builds an object
    of a class it names in its own way (INST, OBJ, EXT*) or computes a name (STACK_GLOBAL).

    ``f`` is a binary file positioned at the first of ``count`` pickles back to back.
    """
    import pickletools

    try:
        for _ in range(count):
            for op, arg, _pos in pickletools.genops(f):
                if op.name == "GLOBAL":
                    module, _, name = str(arg).partition(" ")
                    if "." in name or (
                        (module, name) not in table and (module, name) not in torch_only
                    ):
                        raise UnsafePickleError(
                            f"names {module}.{name}, which is not in its table of allowed globals"
                        )
                elif op.name in (
                    "INST",
                    "OBJ",
                    "EXT1",
                    "EXT2",
                    "EXT4",
                    "STACK_GLOBAL",
                    "NEXT_BUFFER",
                    "READONLY_BUFFER",
                ):
                    raise UnsafePickleError(
                        f"uses opcode {op.name}, which dmlib does not hand to torch"
                    )
                elif op.name == "STOP":
                    break
    except UnsafePickleError as err:
        raise UnsafePickleError(
            f"{what} {err.message}; refusing to unpickle it", path=path
        ) from None
    except Exception as err:  # a damaged pickle: torch would refuse it as well
        text = " ".join(str(err).split())[:120]
        raise FormatError(
            f"unreadable {what}, not a valid pickle ({type(err).__name__}: {text})", path=path
        ) from None
