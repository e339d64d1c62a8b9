"""On a rank: ``print(x)`` and ``display(x)`` of a jax.Array (or torch DTensor) over several
processes, shown in the notebook as one process of all the devices prints it.

jax prints such an array as a placeholder (``Array(shape=(4, 8), dtype=float32)``): its
``__str__``, ``__format__`` and ``__repr__`` all come down to ``repr``. A DTensor prints the
shard this process holds (``DTensor(local_tensor=...)``), different on every rank. The rank's
own text is left as the library makes it, so ``str(x)`` written to a file, logged or compared is
jax's (or torch's). What changes is only what reaches the notebook: ``repr`` notes each
placeholder it makes (on the thread that made it), and the rank's stdout and stderr
(engine/shell/streams.py), when their text holds such a placeholder, put marks around it
(``wire.PRINTED_BEGIN``, ``wire.PRINTED_MARK``) and take, then and there, the parts of the
array's printed form this rank holds, as a cell's value does (engine/arrays/results.py). ``display(x)``
is the same, its text/plain marked (``display_text``). The parts go to the notebook in the
cell's reply (``wire.PRINTED_ARRAYS``): no collective, no round trip, and nothing for an array
no output shows.

How the notebook knows which parts of each rank belong together: by where the print is, not by
the order the rank printed in (ranks take their own branches). A mark names the print's place
(engine/arrays/print_place.py: the thread; every frame from the cell down to the print, so a
function called from two lines is two places; the values of the ``for`` loops around those
lines, read from a cell's or a module's namespace) and how many placeholders that place marked
before in this cell. So ``if rank == 0: print(a)`` then ``print(b)`` marks b alike on every rank, a rank that skips a step
of a loop pairs no print with another step's, and the n-th print of a DTensor changed in place
is matched with the n-th print of the others. Where no place can be told alike (a pool's
worker, an asyncio task, threads sharing a name), nothing is marked.

An array on the devices of some processes only (a mesh of ``jax.devices()[:4]``), which those
processes print whole (on one process's devices, or copied on each of its devices): the ranks
that hold it print its value, the others jax's placeholder. A holder notes its own text
(``_note_own``) and sends it in the table instead of parts; its output is left as it is. No
search of the written text finds a value and a placeholder alike, so such notes, on every
rank, are taken by the first write on their line after they were made and numbered in the
order made, at a place of their own (``marked``). The notebook shows the others' placeholder
as the holders' text.

The parts are taken when ``repr`` makes the placeholder (the print that writes it comes next,
and an f-string's array, ``f'{x * 2}'``, is gone by then), so an array changed in place prints
as it is at that print. A jax.Array never changes, so its parts are reused while it lives; a
DTensor's are taken at every repr (its version counter misses changes through its local
shard). The same parts are sent once a cell, found by their digest: a loop printing one array
sends it once. At most ``MAX_ARRAYS`` different parts a cell and ``MAX_MARKS`` marks (the rest
stay placeholders, and the notebook says so). Nothing here keeps an array alive (only its
parts, a few corners, and a weak reference), so ``del x`` frees its memory as in plain jax.

The notes and the table are the rank kernel's (``RankKernel.print_marks``, one ``PrintMarks``):
the hooks on ``repr``, the import hook, ``display`` and the rank's streams are given it as they
are installed.

Threads: ``repr`` notes on the thread that calls it (``PrintMarks.noted``, thread-local); the
streams' ``write`` runs on the writer's thread and takes the cell's table (and ``repr``, the
parts taken lately: ``CellTable``) under its lock; the main thread takes the table at the
cell's reply (``into``). ``install`` runs on the main thread, and from its import hook
(``_Installer``) on whichever thread imports jax or torch's DTensor first.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import json
import sys
import threading
import weakref

from spmd import wire
from spmd.engine.arrays import print_place

MAX_ARRAYS = 100  # different parts per cell (each one's corners are copied from its devices)
MAX_MARKS = 10_000  # marked placeholders per cell (a loop printing one array: one part)
MAX_OWN_TEXT = 1 << 16  # characters of a holder's own text of an array, sent for the others
MAX_OWN_BYTES = 1 << 20  # characters of holders' own texts per cell (apart from MAX_ARRAYS)
_MODULES = {"jax": "jax._src.array", "torch": "torch.distributed.tensor"}


class _Parts:
    """The parts of one array's printed form this rank holds, taken at one repr (None: no
    printed form can be made of it)."""

    __slots__ = ("parts", "_digest")

    def __init__(self, parts: dict | None) -> None:
        self.parts = parts
        self._digest = None

    @property
    def digest(self) -> bytes:
        """What the parts hold, in a few bytes: the same parts are sent once a cell, whichever
        repr took them."""
        if self._digest is None:
            said = json.dumps(self.parts, sort_keys=True).encode()
            self._digest = hashlib.blake2b(said, digest_size=16).digest()
        return self._digest


_NONE = _Parts(None)
_OVER = _Parts(None)  # (taken past MAX_ARRAYS: left out, and the notebook says so)


class CellTable:
    """This cell's printed arrays (their parts, each print's place counted), and the parts
    taken lately: all under ``lock``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        # parts taken lately, id(array) -> (the array, weakly; what decided its printed form;
        # the parts), so a repr of one array again and again copies its corners once
        self.taken: dict[int, tuple[weakref.ref, tuple, _Parts]] = {}
        # this cell's:
        self.parts: list[dict] = []  # the parts its marks name
        self.indexes: dict[bytes, int] = {}  # the digest of parts in .parts -> their index there
        self.marks: dict[str, int] = {}  # mark -> its index in .parts
        self.places: dict[str, int] = {}  # a print's place -> how many placeholders it marked
        self.left_out = 0  # placeholders of this cell past MAX_ARRAYS or MAX_MARKS
        self.own_entries = 0  # entries of .parts that are a holder's own text
        self.own_bytes = 0  # their characters

    def parts_of(self, array) -> _Parts:
        """The parts of the array's printed form this rank holds: taken now, or again those of
        an earlier repr of the same array in the same state."""
        state = _state(array)
        with self.lock:
            known = self.taken.get(id(array))
            if known is not None and known[0]() is array and known[1] == state:
                return known[2]
            if len(self.parts) - self.own_entries >= MAX_ARRAYS:  # (full: nothing copied)
                return _OVER
        from spmd.engine.arrays import results

        try:  # (outside the lock: it copies from the devices)
            torch = type(array).__module__.startswith("torch")
            parts = results._torch_parts(array) if torch else results._parts(array)
        except Exception:  # (a kind of array this does not know: jax's placeholder stays)
            parts = None
        taken = _Parts(parts[wire.GLOBAL_ARRAY_MIME] if parts else None)
        if torch:  # (taken anew at every repr: nothing to keep)
            return taken
        with self.lock:
            if len(self.taken) >= 256:  # (keep those of arrays still alive)
                for key in [k for k, (alive, _, _) in self.taken.items() if alive() is None]:
                    del self.taken[key]
                if len(self.taken) >= 256:
                    self.taken.clear()
            self.taken[id(array)] = (weakref.ref(array), state, taken)
        return taken

    def mark_of(self, taken: _Parts, place: str) -> str | None:
        """The mark of this placeholder (its place and its number there), its parts put in the
        cell's table (None: past the caps, or no parts to send)."""
        digest = taken.digest if taken.parts is not None else None  # (outside the lock)
        with self.lock:  # (one section: the count and the table are of one cell)
            count = self.places.get(place, 0)
            self.places[place] = count + 1  # (counted even when left out: numbers stay aligned)
            if digest is None:
                self.left_out += taken is _OVER
                return None
            index = self.indexes.get(digest)
            own = len(taken.parts["own"]) if "own" in taken.parts else None
            # (a holder's own texts have their cap apart: a rank's own arrays, which it prints
            # itself, leave the table's room to the arrays over several processes)
            full = (self.own_bytes + own > MAX_OWN_BYTES) if own is not None else (
                len(self.parts) - self.own_entries >= MAX_ARRAYS)
            if len(self.marks) >= MAX_MARKS or (index is None and full):
                # (a holder's own text left out is no placeholder here: the others say it)
                self.left_out += own is None
                return None
            if index is None:
                self.parts.append(taken.parts)
                index = self.indexes[digest] = len(self.parts) - 1
                if own is not None:
                    self.own_entries, self.own_bytes = self.own_entries + 1, self.own_bytes + own
            mark = f"{place}-{count}"
            self.marks[mark] = index
        return mark

    def into(self, metadata: dict) -> None:
        """(the main thread, at the cell's reply) The cell's printed arrays into its reply's
        metadata; the table starts again for the next cell."""
        with self.lock:
            if self.marks or self.left_out:
                metadata[wire.PRINTED_ARRAYS] = {
                    "marks": dict(self.marks),
                    "parts": {str(i): p for i, p in enumerate(self.parts)},
                    "left_out": self.left_out,
                }
            self.parts.clear()
            self.indexes.clear()
            self.marks.clear()
            self.places.clear()
            self.left_out = self.own_entries = self.own_bytes = 0


class PrintMarks:
    """The placeholders this rank's ``repr`` made, marked where the rank's streams write them,
    and the cell's table of their parts."""

    def __init__(self) -> None:
        # .pending: [(placeholder, its parts taken, form, line, held)] made since this thread's
        # last write (held: ``_held_whole_by_some``); .form: "s" while str() or format() runs
        # (numpy's form), "-" for a format spec of its own, else "r"
        self.noted = threading.local()
        self.table = CellTable()
        self.installed: set[str] = set()  # the libraries whose arrays are noted: "jax", "torch"
        self._process_count: int | None = None  # (jax.process_count(), once it is known)

    def install(self) -> None:
        """Note the placeholders jax's (and torch's DTensor's) ``repr`` makes: now for a
        library imported already, and for one imported later the moment its import ends (a
        cell that imports DTensor and prints one)."""
        installed = self.installed
        if "jax" not in installed and _MODULES["jax"] in sys.modules:
            self._install_jax(sys.modules[_MODULES["jax"]].ArrayImpl)
            installed.add("jax")
        if "torch" not in installed and _MODULES["torch"] in sys.modules:
            self._install_torch(sys.modules[_MODULES["torch"]].DTensor)
            installed.add("torch")
        if installed:
            from spmd.engine.arrays import results

            results.marked_display = self.display_text
        waiting = {name for lib, name in _MODULES.items() if lib not in installed}
        hooks = [f for f in sys.meta_path if isinstance(f, _Installer)]
        if waiting and not hooks:
            sys.meta_path.insert(0, _Installer(self))
        elif not waiting:
            for hook in hooks:
                sys.meta_path.remove(hook)

    def _pending(self) -> list:  # (this thread's notes)
        if getattr(self.noted, "pending", None) is None:
            self.noted.pending = []
        return self.noted.pending

    def _note(self, text: str, array) -> None:
        """(the thread calling repr) ``text`` is the placeholder of ``array``: its parts taken
        now (an f-string's array may be gone by the time it is written: ``f'{x * 2}'``),
        noted for the thread's next write. Nothing keeps the array itself."""
        pending = self._pending()
        # (str() and format() of such an array are its repr: which one asked decides the form
        # one process prints, numpy's str or jax's Array(...))
        line = print_place.cell_line()
        # (outside a cell, a variable inspector's or the debugger's repr: nothing is taken)
        taken = self.table.parts_of(array) if line is not None else _NONE
        form = getattr(self.noted, "form", "r")
        held = self._held_whole_by_some(array)
        if form == "-" and held:  # (its holders' formatted text: shown)
            form = "f"
        pending.append((text, taken, form, line, held))
        del pending[:-64]  # (a repr no output shows is forgotten soon)

    def _note_own(self, text: str, array, form: str) -> None:
        """(the thread calling repr, str or format) ``text`` is what this process prints of
        an array on some processes' devices only, whole here (``_held_whole_by_some``): the
        others print jax's placeholder, which the notebook replaces by this text. Noted as a
        placeholder is, so that its print counts at its place as theirs does; never marked in
        this rank's own output, which is the value already."""
        line = print_place.cell_line()
        form = "F" if form == "-" else form.upper()  # (as the others' placeholder: "f", "s", "r")
        if line is None or len(text) > MAX_OWN_TEXT:
            taken = _NONE  # (counted as the others' placeholder is, never sent)
        else:
            sharding = array.sharding
            taken = _Parts({"own": text, "form": form, "shape": list(array.shape),
                            "dtype": array.dtype.name, "sharding": repr(sharding),
                            "holders": sorted({d.process_index for d in sharding.device_set})})
        pending = self._pending()
        pending.append((text, taken, form, line, True))
        del pending[:-64]

    def _held_whole_by_some(self, array) -> bool:
        """Whether the array lives on the devices of some processes only, and those that
        hold it print it whole (on one process's devices, or the same on each of its): the
        same answer on every rank, from its sharding. An array a process made on its own
        device (uncommitted, like ``jnp.arange(3)``) is each rank's own: no."""
        if not getattr(array, "committed", False):  # (a DTensor has no such thing: no)
            return False
        if self._process_count is None:
            import jax

            self._process_count = jax.process_count()
        sharding = array.sharding
        holders = {device.process_index for device in sharding.device_set}
        return len(holders) < self._process_count and (len(holders) == 1
                                                       or sharding.is_fully_replicated)

    def _install_jax(self, impl) -> None:
        original_repr, original_str, original_format = impl.__repr__, impl.__str__, impl.__format__
        noted = self.noted

        def __repr__(array):
            text = original_repr(array)
            try:
                if text.startswith("Array(shape=") and not _printable_here(array):
                    self._note(text, array)
                elif self._held_whole_by_some(array):  # (this process prints it: its text)
                    self._note_own(text, array, getattr(noted, "form", "r"))
            except Exception:  # (an array being deleted: jax's text, unmarked)
                pass
            return text

        def as_str(call):
            def wrapped(array, *args):
                before = getattr(noted, "form", "r")
                # (a format spec of its own: numpy's would refuse it, so it is left as it is,
                # unless a process prints the array whole: its text is the one to show)
                form = noted.form = "s" if not args or not args[0] else "-"
                try:
                    text = call(array, *args)
                finally:
                    noted.form = before
                try:  # (this process prints it without a repr: numpy's str, or the format's)
                    if self._held_whole_by_some(array) and _printable_here(array):
                        self._note_own(text, array, form)
                except Exception:  # (an array being deleted: jax's text, unmarked)
                    pass
                return text
            return wrapped

        impl.__repr__ = __repr__
        impl.__str__ = as_str(original_str)
        impl.__format__ = as_str(original_format)

    def _install_torch(self, dtensor) -> None:
        original_repr = dtensor.__repr__

        def __repr__(tensor, *args, **kwargs):
            text = original_repr(tensor, *args, **kwargs)
            try:  # (sharded over several processes: Partial has no block to show, as a value)
                if tensor.device_mesh.size() > 1 and any(
                        p.is_shard() for p in tensor.placements) and not any(
                        p.is_partial() for p in tensor.placements):
                    self._note(text, tensor)
            except Exception:  # (a DTensor this does not know: torch's text, unmarked)
                pass
            return text

        dtensor.__repr__ = __repr__

    def display_text(self, array) -> str | None:
        """(the main thread, display(x)) The array's text/plain marked for the notebook, as a
        print of it is (None: not an array over several processes, or past the caps)."""
        text = repr(array)
        pending = getattr(self.noted, "pending", None)
        if not pending or pending[-1][0] is not text:
            return None
        _, taken, form, line, held = pending.pop()
        if line is None:  # (not a cell's display: a variable inspector's, the debugger's)
            return None
        place = print_place.place()
        if place is not None and held:
            place = _held_place(place)
        mark = self.table.mark_of(taken, place) if place is not None else None
        if form.isupper():  # (a holder's own text: the value, shown as it is; None would make
            return text  # jax's formatter repr it again, a note no display consumes)
        if mark is None:
            return None
        return wire.PRINTED_BEGIN + text + wire.PRINTED_MARK.format(f"{mark}r")

    def marked(self, text: str) -> str:
        """(the writer's thread) ``text`` with a mark after each placeholder of an array
        this thread's ``repr`` made on the line that writes it. Each placeholder is paired
        with the repr that made it only where that cannot be wrong: as many reprs as the text
        has placeholders of those words (paired in the order made, which is the order
        written), or reprs of one array only; else none of those is marked
        (``print(f'a {a}', f'b {b}')`` makes both before the first is written; ``str(x)``
        kept from an earlier line).

        An array some processes hold whole (``held``) is counted otherwise: its holders write
        its value where the others write a placeholder, and no search finds the two alike (a
        value's text in the print's own words, ``textwrap.indent``, pprint's second repr). So
        its notes are taken by the first write on their line after they were made, whatever
        it holds, and numbered in the order made, at a place of their own: the same on every
        rank."""
        pending = getattr(self.noted, "pending", None)
        if not pending:
            return text
        here = print_place.cell_line()
        # (a repr made on another line is str(x) for the program's own use, written later)
        made = [note for note in pending if note[3] == here]
        held = [note for note in made if note[4]]
        made = [note for note in made if not note[4]]
        words = {note[0] for note in made}
        if not any(placeholder in text for placeholder in words):
            self.noted.pending = made  # (print('x:', str(x)) writes 'x:' first)
            if not held:
                return text
            made, words = [], set()
        else:
            self.noted.pending = []
        found = []
        shared = words & {note[0] for note in held if note[2].islower()}
        for placeholder in words - shared:  # (a placeholder of both kinds: neither is marked)
            notes = [note for note in made if note[0] == placeholder]
            spots = [at for at in _spots(text, placeholder)]
            if not spots or len(spots) > len(notes):
                continue
            if len(spots) < len(notes):  # (pprint makes a repr twice: one array, or none marked)
                if len({id(note[1]) for note in notes}) > 1 and len(
                        {note[1].digest for note in notes if note[1].parts is not None}) > 1:
                    continue
                notes = notes[-len(spots):]
            found += [(at, placeholder, taken, form)
                      for at, (_, taken, form, _, _) in zip(spots, notes)]
        place = print_place.place() if found or held else None
        if place is None:
            return text
        # (numbered left to right, the order the same print writes them on every rank; put in
        # from the right, so that each one's position still holds)
        found.sort(key=lambda f: f[0])
        mark_of = self.table.mark_of
        marks = [(at, placeholder, mark_of(taken, place) if form != "-" else None, form)
                 for at, placeholder, taken, form in found]
        marks += self._held_marks(text, held, _held_place(place), shared)
        marks.sort(key=lambda m: m[0])
        for at, placeholder, mark, form in reversed(marks):
            if mark is not None and form.islower():  # (a holder's own text: in the table only)
                where = at + len(placeholder)
                text = (text[:at] + wire.PRINTED_BEGIN + text[at:where]
                        + wire.PRINTED_MARK.format(f"{mark}{form}") + text[where:])
        return text

    def _held_marks(self, text: str, held: list, place: str, shared: set) -> list[tuple]:
        """The held notes taken by this write, each counted in the order made; a placeholder
        among them is marked where the text holds as many of its words as it has notes (else
        it stays jax's)."""
        counted = [(note, self.table.mark_of(note[1], place) if note[2] != "-" else None)
                   for note in held]
        marks = []
        for placeholder in {note[0] for note in held if note[2].islower()} - shared:
            mine = [(note, mark) for note, mark in counted if note[0] == placeholder]
            spots = list(_spots(text, placeholder))
            if len(spots) == len(mine):
                marks += [(at, placeholder, mark, note[2]) for at, (note, mark) in zip(spots, mine)]
        return marks


class _Installer(importlib.abc.MetaPathFinder):
    """Calls ``marks.install`` once jax's array module or torch's DTensor module has been
    imported: the other finders find it, its loader runs it, then ``install``."""

    def __init__(self, marks: PrintMarks) -> None:
        self.marks = marks

    def find_spec(self, fullname, path, target=None):
        if fullname not in _MODULES.values():
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader, marks = spec.loader, self.marks
        run = getattr(loader, "exec_module", None)
        if run is None:
            return spec

        def exec_module(module):
            run(module)
            marks.install()

        loader.exec_module = exec_module  # (this module's own loader object)
        return spec


def _printable_here(array) -> bool:
    """Whether jax prints the array's value in this process (else its placeholder)."""
    return array.is_fully_addressable or (array.is_fully_replicated
                                          and array.sharding.has_addressable_devices)


def _held_place(place: str) -> str:
    """The place of a print's held arrays, counted apart from its other placeholders (one
    more hex digit: no place of the others has it)."""
    return place + "0"


def _spots(text: str, placeholder: str):
    """Where ``placeholder`` starts in ``text``, left to right."""
    at = text.find(placeholder)
    while at >= 0:
        yield at
        at = text.find(placeholder, at + len(placeholder))


def _state(array) -> tuple:
    """What decides the array's printed form besides the array itself: the print options
    (numpy's for jax, torch's for a DTensor), and a DTensor's version counter (changed in
    place by ``add_``: printed anew)."""
    if type(array).__module__.startswith("torch"):
        from torch._tensor_str import PRINT_OPTS

        # (a DTensor changes in place, and not every change moves its version counter:
        # ``w.to_local().add_(1)``, a checkpoint's load; its parts are taken at every repr)
        return ("torch", object(), tuple(vars(PRINT_OPTS).items()))
    import numpy as np

    return ("jax", tuple(sorted(np.get_printoptions().items(), key=lambda kv: kv[0])))
