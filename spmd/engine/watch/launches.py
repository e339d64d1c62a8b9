"""On a rank: a record of the cross-process programs and collectives each cell launched.

The divergence report says where the ranks wait; this record says why: the ranks launched
different sequences (other shapes, another count, another program at the same place). It is
always on, so it must cost next to nothing:

- jax: ``jax.jit`` and ``jax.pmap`` hand out a thin wrapper of jax's own jitted function. A
  call goes through jax's C++ fast path as before; afterwards, if its result lives on the
  devices of several processes (the same answer on every rank, whichever of them it holds;
  pmap: whenever there are several processes), the wrapper records the program and its
  arguments' shapes and dtypes. (Recording where jax dispatches, in its Python
  path, would take every cross-process program off the C++ fast path: measured 3x the time
  of a small cross-process jit here.) jax's own eager operations (``jnp.sum`` of a global
  array outside any jit) are not recorded.
- torch: the collectives of ``torch.distributed`` (``all_reduce``, ``broadcast``, ...) are
  wrapped the same way: op, shapes and dtypes, recorded before the call (a collective that
  hangs is the last one recorded). A subgroup's collectives are left out (the ranks outside
  it rightly launch none), and so are the shapes of those whose arguments may rightly differ
  (objects, the root's lists, uneven splits).

Each cell's record is run-length encoded (a loop of 1,000 steps is one entry), and the last
cells' records are kept, by the request that ran them. The notebook reads a digest of the
record in the cell's reply (``wire.CENSUS_DIGEST``, compared across ranks after every cell) and
the whole record on the control channel (``wire.CENSUS_REQUEST``, answered by the rank's
kernel, engine/rank_kernel.py) when they differ or a report needs it.

A jax launch is recorded once its call returns (only its result tells whether it spans
processes), and a call can block: the first cross-process program of a job sets up gloo's
context, which waits for every process. So the launch in flight on the main thread is kept
too (``Launches.inside``), and a record read while the cell runs names it (``inside``): the
watchdog tells a rank blocked in a launch the finished ranks never made from one only behind
them.

The records are the rank kernel's (``RankKernel.launches``, one ``Launches``); the wrappers
of jax.jit and of torch's collectives are given it when they are installed, and jax.jit's
wrapper carries it (``_spmd_census``) for a jitted function that copy or pickle rebuilds.

Threads: a ``Launches``' records (``cells``, ``current``, ``last``) are started, appended to
and ended on the rank's main thread only (``main``), where cells run (a thread's launches are
not recorded); the control thread reads copies (``of``), whose last count may be off by one
while a launch is recorded; the digest is made on the main thread, after the cell, when
recording stops. ``inside`` is set and cleared by the main thread, read by the control
thread. ``off`` and jax's names (``install_jax``) are set on the main thread, read by any.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import os
import tempfile
import threading
import types

from spmd import wire

KEPT_CELLS = 20  # cells whose record stays, for %spmd census N
MAX_ENTRIES = 100_000  # distinct runs kept per cell; beyond, only counted
MAX_LEAVES = 16  # argument leaves listed per launch; beyond, only counted
# (README: the census turned off; read once, where this module is imported: in the rank
# server, for the ranks it forks, as in a rank)
_OFF = os.environ.get("SPMD_CENSUS") == "off"
_get_ident = threading.get_ident


class Record:
    """One cell's launches: its programs (kind, name, where) and argument signatures, each
    kept once, and runs [program, signature, times] of small integers: a loop whose shapes
    change at every step costs three integers a launch, not its arguments again."""

    def __init__(self) -> None:
        self.programs: dict[tuple, int] = {}
        self.signatures: dict[tuple, int] = {}
        self.runs: list[list] = []
        self.count = 0
        self.dropped = 0

    def add(self, program: tuple, args: tuple) -> None:
        self.count += 1
        p = self.programs.get(program)
        if p is None:
            p = self.programs[program] = len(self.programs)
        a = self.signatures.get(args)
        if a is None:
            a = self.signatures[args] = len(self.signatures)
        runs = self.runs
        if runs and runs[-1][0] == p and runs[-1][1] == a:
            runs[-1][2] += 1
        elif len(runs) < MAX_ENTRIES:
            runs.append([p, a, 1])
        else:
            self.dropped += 1

    def as_json(self) -> dict:
        runs = [list(run) for run in self.runs]  # (first: what they name is there then)
        programs = sorted(self.programs, key=self.programs.get)
        signatures = sorted(self.signatures, key=self.signatures.get)
        return {
            "programs": [list(p) for p in programs],
            "signatures": [[_aval(a) for a in args] for args in signatures],
            "runs": runs,
            "count": self.count,
            "dropped": self.dropped,
        }

    def digest(self) -> list:
        """[count, a hash of the sequence]: equal on ranks that launched the same."""
        text = repr(self.as_json()).encode()
        return [self.count, hashlib.blake2b(text, digest_size=8).hexdigest()]


# (loops, not generators, in the two below: a generator over a local costs a launch more)
def _signature(leaves, array_type) -> tuple:
    """The leaves' shapes and dtypes (``array_type``: jax's array, once installed), or their
    types, the first MAX_LEAVES of them."""
    shown = []
    for leaf in leaves[:MAX_LEAVES]:
        if type(leaf) is array_type or (hasattr(leaf, "dtype") and hasattr(leaf, "shape")):
            shown.append((leaf.shape, leaf.dtype))
        else:
            shown.append(type(leaf).__name__)
    if len(leaves) > MAX_LEAVES:
        shown.append(f"(+{len(leaves) - MAX_LEAVES} more)")
    return tuple(shown)


def _only_arrays(args, array_type) -> bool:
    for arg in args:
        if type(arg) is not array_type:
            return False
    return True


def _aval(arg) -> str:
    """``float32[2,4]``, or a Python value's type."""
    if isinstance(arg, tuple):
        shape, dtype = arg
        dtype = str(dtype).removeprefix("torch.")
        return f"{dtype}[{','.join(map(str, shape))}]"
    return str(arg)


class Launches:
    """This rank's census: each cell's record of its cross-process launches, the last
    KEPT_CELLS cells' kept by the request that ran them. The rank's kernel owns one
    (``RankKernel.launches``); the wrappers of jax.jit and torch's collectives record into it
    (``install_jax``, ``install_torch``)."""

    def __init__(self) -> None:
        self.cells: collections.OrderedDict[str, Record] = collections.OrderedDict()
        self.current: Record | None = None  # the running cell's (None between cells)
        self.last: Record | None = None
        self.main: int | None = None  # the rank's main thread, where cells run (record_cells)
        # (Launched, args, kwargs): the main thread's jax call in flight
        self.inside: tuple | None = None
        self.off = _OFF
        # jax's names, bound by install_jax (an import in every launch would cost microseconds
        # each): its tree's leaves, its array type, and whether there are several processes
        self.leaves = None
        self.array_type = None
        self.several_processes = False

    def record(self, program: tuple, leaves) -> None:
        """A launch of ``program`` with these argument leaves, in the running cell, from the
        main thread (a thread's launches land in no cell of their own). The dtype object
        itself is kept: its name costs 5 us a launch, made once for the notebook. Past
        MAX_LEAVES the leaves are counted, not listed: a model's thousand parameters are one
        number."""
        current = self.current
        if current is None or self.off or _get_ident() != self.main:
            return
        current.add(program, _signature(leaves, self.array_type))

    def start_cell(self, request_id: str) -> None:
        self.current = self.last = self.cells[request_id] = Record()
        while len(self.cells) > KEPT_CELLS:
            self.cells.popitem(last=False)

    def end_cell(self) -> list | None:
        """The cell has ended: its digest, if it launched anything. (What runs between cells,
        the notebook's own requests and a thread's work, is not recorded.)"""
        ended, self.current = self.current, None
        return ended.digest() if ended is not None and ended.count else None

    def of(self, request_id: str | None) -> dict | None:
        """(control thread) A cell's record (None: the running or last cell's); None if not
        kept. The running cell's names the cross-process launch its main thread is inside
        now, not yet recorded (``inside``: [program, its arguments' signature])."""
        rec = self.last if request_id is None else self.cells.get(request_id)
        if rec is None:
            return None
        said = rec.as_json()
        inside = self.inside
        if rec is self.current and inside is not None and not self.off:
            with contextlib.suppress(Exception):  # (its arguments, read from another thread)
                said["inside"] = inside[0].in_flight(inside[1], inside[2])
        return said

    # -- the rank's side of the notebook's requests --------------------------------------

    def record_cells(self, shell, request_id) -> None:
        """Records start with each cell (``request_id()``: the id of the request that runs
        it). (From the rank's main thread, once joined: the rank's kernel,
        engine/rank_kernel.py.)"""
        self.main = threading.get_ident()

        def pre_run_cell(info=None) -> None:
            self.start_cell(request_id())

        shell.events.register("pre_run_cell", pre_run_cell)

    def digest_into(self, parent: dict, metadata: dict) -> None:
        """(main thread) A cell's reply: its record ends, and its digest goes in the
        metadata."""
        if parent.get("header", {}).get("msg_type") == "execute_request":
            said = self.end_cell()
            if said is not None:
                metadata[wire.CENSUS_DIGEST] = said

    # -- the wrappers, installed once per process ----------------------------------------

    def install_jax(self) -> None:
        """``jax.jit`` and ``jax.pmap`` record here (once per process)."""
        import jax

        try:
            from jax._src.array import ArrayImpl
        except ImportError:  # (moved in a jax to come: no census of jax's launches, and a
            return  # line at the start says so: spmd/internals.py)
        if getattr(jax.jit, "_spmd_census", None) is not None:
            return
        self.leaves, self.array_type = jax.tree_util.tree_leaves, ArrayImpl
        self.several_processes = jax.process_count() > 1
        jit, pmap = jax.jit, jax.pmap

        def recorded(kind: str, make):
            @functools.wraps(make)
            def launcher(*args, **kwargs):
                if not args and "fun" not in kwargs:  # (@jax.jit(static_argnums=...))
                    return functools.partial(launcher, **kwargs)
                fun = args[0] if args else kwargs["fun"]
                return Launched(kind, make(*args, **kwargs), fun, self)

            launcher._spmd_census = self  # (what a copied or unpickled Launched records into)
            return launcher

        jax.jit, jax.pmap = recorded("jit", jit), recorded("pmap", pmap)

    def install_torch(self) -> None:
        """``torch.distributed``'s collectives record here (once per process)."""
        import torch
        import torch.distributed as dist

        compiling = getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)
        for op in TORCH_COLLECTIVES:
            fn = getattr(dist, op, None)
            if fn is None or getattr(fn, "_spmd_census", False):
                continue
            setattr(dist, op, self._torch_recorded(op, fn, compiling))

    def _torch_recorded(self, op: str, fn, compiling):
        @functools.wraps(fn)
        def collective(*args, **kwargs):
            __tracebackhide__ = True  # (IPython's tracebacks on the rank leave this frame out)
            if self.current is not None and not self.off and not compiling():
                group = kwargs.get("group")
                # (a subgroup's collectives are its members' only: the others launch none,
                # and rightly; every rank's sequence is compared, so they are left out)
                if group is None or _group_size(group) == _world_size():
                    shapes = [] if op in TORCH_NO_SHAPES else _first_tensor(args)
                    self.record(("torch", op, ""), shapes)
            return fn(*args, **kwargs)

        collective._spmd_census = True
        return collective


# -- jax ------------------------------------------------------------------------------------

def where_defined(fn) -> str:
    """``line 3`` of a cell, or ``module.py:3``: tells apart two programs of one name."""
    fn = getattr(fn, "_fun", fn)
    fn = getattr(fn, "__wrapped__", fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return ""
    name = os.path.basename(code.co_filename)
    # (a cell's file: ipykernel's, or the debugger's cell folder, both in the temp folder)
    cell = name.startswith("<") or code.co_filename.startswith(tempfile.gettempdir())
    return f"line {code.co_firstlineno}" if cell else f"{name}:{code.co_firstlineno}"


class Launched:
    """jax's jitted (or pmapped) function, recording its cross-process calls into
    ``launches``."""

    def __init__(self, kind: str, jitted, fun, launches: Launches) -> None:
        functools.update_wrapper(self, jitted)
        self._jitted = jitted
        self._kind = kind
        self._launches = launches
        name = getattr(fun, "__name__", type(fun).__name__)
        self._program = (kind, name, where_defined(fun))
        # The last result's sharding, and whether it spans processes: a loop's results share
        # one sharding object, and asking it again costs a launch a microsecond.
        self._spanning = (None, False)

    def __call__(self, *args, **kwargs):
        __tracebackhide__ = True  # (IPython's tracebacks on the rank leave this frame out)
        launches = self._launches
        if launches.current is None:  # (between cells)
            return self._jitted(*args, **kwargs)
        main = _get_ident() == launches.main
        if main:  # (a jitted call inside another's trace gives the outer one back after it)
            before, launches.inside = launches.inside, (self, args, kwargs)
        try:
            out = self._jitted(*args, **kwargs)
        finally:
            if main:
                launches.inside = before
        self.recorded(out, args, kwargs)
        return out

    def in_flight(self, args, kwargs) -> list | None:
        """(control thread) This launch, called and not returned, as [program, signature]
        where it spans processes (a pmap over several; a jit whose last result did, or of a
        global array); None where it is this process's own."""
        launches = self._launches
        array_type = launches.array_type
        if self._kind == "pmap":
            spans = launches.several_processes
        else:
            leaves = launches.leaves((args, kwargs))
            spans = self._spanning[1] or any(
                type(leaf) is array_type and _spans(leaf.sharding) for leaf in leaves)
        if not spans:
            return None
        arrays = not kwargs and _only_arrays(args, array_type)
        shown = _signature(args if arrays else launches.leaves((args, kwargs)), array_type)
        return [list(self._program), [_aval(a) for a in shown]]

    def recorded(self, out, args, kwargs) -> None:
        """Record this launch if its result spans processes. (Every step counts: on this
        2-core machine a launch's partner rank waits for it in the collective, and 10 us of
        extra work a launch cost 10-25% of a small one.)"""
        launches = self._launches
        array_type = launches.array_type
        first = out if type(out) is array_type else _first_leaf(launches.leaves, out)
        if type(first) is not array_type:  # (traced inside another jit, or no array out)
            return
        if self._kind == "pmap":
            spans = launches.several_processes
        else:
            sharding = first.sharding
            known, spans = self._spanning  # (one tuple: another thread sees a whole pair)
            if sharding is not known:
                spans = _spans(sharding)
                self._spanning = (sharding, spans)
        if spans:
            arrays = not kwargs and _only_arrays(args, array_type)
            launches.record(self._program, args if arrays else launches.leaves((args, kwargs)))

    def __getattr__(self, name: str):  # (lower, trace, eval_shape, clear_cache, ...)
        jitted = self.__dict__.get("_jitted")  # (absent while copy or pickle rebuilds it)
        if jitted is None:
            raise AttributeError(name)
        return getattr(jitted, name)

    def __get__(self, obj, objtype=None):  # (a jitted method, as jax's own binds)
        return self if obj is None else types.MethodType(self, obj)

    def __reduce__(self):  # (pickled and copied as jax's own, wrapped again)
        return _launched_again, (self._kind, self._jitted,
                                 self.__dict__.get("_fun", self._jitted))

    def __repr__(self) -> str:
        return repr(self._jitted)


def _launched_again(kind: str, jitted, fun) -> Launched:
    """A Launched that copy or pickle rebuilt: recording into the census that jax.jit records
    into in this process (none installed: a census that never starts a cell, so nothing)."""
    import jax

    launches = getattr(jax.jit, "_spmd_census", None)
    if not isinstance(launches, Launches):
        launches = Launches()
    return Launched(kind, jitted, fun, launches)


def _spans(sharding) -> bool:
    """Whether a program with this sharding runs on several processes' devices: the same
    answer on every rank. (Not ``is_fully_addressable``: a mesh of process 0's devices is
    fully addressable on rank 0 only, so rank 0 would count no launch where the others count
    one, and the notebook would warn of launches that differ.)"""
    return len({device.process_index for device in sharding.device_set}) > 1


def _first_leaf(leaves, out):
    found = leaves(out)
    return found[0] if found else None


# -- torch ----------------------------------------------------------------------------------

TORCH_COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather",
                     "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
                     "gather", "scatter", "all_to_all", "all_to_all_single", "barrier",
                     "all_gather_object", "broadcast_object_list")
# Collectives whose arguments may rightly differ between ranks (objects, the root's lists,
# uneven splits): recorded by name only.
TORCH_NO_SHAPES = ("gather", "scatter", "all_to_all", "all_to_all_single",
                   "all_gather_object", "broadcast_object_list")


def _first_tensor(args) -> list:
    """The tensor a collective works on (the first of a list): its shape is every rank's."""
    first = args[0] if args else None
    if isinstance(first, (list, tuple)):
        first = first[0] if first else None
    return [first] if hasattr(first, "shape") else []


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size()


def _group_size(group) -> int | None:
    try:
        return int(group.size())
    except Exception:  # (a group this rank is not in: torch's sentinel)
        return None
