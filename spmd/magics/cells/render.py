"""Show one cell's per-rank outputs in the notebook, grouped so sameness is visible.

Outputs are aligned by position: the k-th output of every rank is compared with the k-th
output of the others. Ranks whose k-th outputs are identical are shown once, under their rank
set (``[ranks 0-3]``); the others follow, each under its own ranks, in rank order. In SPMD
every rank usually produces the same sequence of outputs, so this lines up what belongs
together without any diffing.

While the cell runs, ``LiveView`` is its observer (records.CellObserver): it shows a long
cell's latest lines, and asks the person a rank's prompt. Main thread only: the cell runner
calls it from its wait, where ipykernel routes output to the running cell.
"""

from __future__ import annotations

import builtins
import getpass
import re
import sys
import time
from collections.abc import Callable
from typing import Any

from IPython.display import clear_output, display

from spmd.cluster.records import Output
from spmd.cluster.session import RankCell, unmarked
from spmd.magics.cells.report import progress_lines, straggler_lines
from spmd.wire import GLOBAL_ARRAY_MIME
from spmd.words import rank_label, rank_set, rank_words

Group = tuple[list[int], Output]

# "Cell In[12]" and the cell's file name count the cells that rank ran: after a %%spmd --ranks
# cell the counts differ, but the error is the same.
_CELL_COUNT = re.compile(r"(Cell\S* \S*In\[)\d+")


def same(out: Output) -> Any:
    """What makes two outputs 'the same' for grouping across ranks."""
    if out.kind in ("stdout", "stderr"):
        return (out.kind, out.text)
    if out.kind == "error":
        text = "\n".join(out.traceback) or f"{out.ename}: {out.evalue}"
        return (out.kind, _CELL_COUNT.sub(r"\1", text))
    return (out.kind, _freeze(out.data))


def _freeze(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


def _shown_outputs(cells: dict[int, RankCell]) -> dict[int, list[Output]]:
    return {
        r: [o for o in c.outputs if o.kind not in ("error", "result")]
        for r, c in sorted(cells.items())
    }


def group_outputs(cells: dict[int, RankCell]) -> list[Group]:
    """Every output but errors and results, as (ranks that produced it identically, output)."""
    return _grouped(_shown_outputs(cells))


def _grouped(per_rank: dict[int, list[Output]]) -> list[Group]:
    depth = max((len(outs) for outs in per_rank.values()), default=0)
    groups: list[Group] = []
    for k in range(depth):
        at_k = {rank: outs[k] for rank, outs in per_rank.items() if k < len(outs)}
        by_key: dict[object, Group] = {}
        for rank, out in _split_common_lines(at_k):
            by_key.setdefault(same(out), ([], out))[0].append(rank)
        groups.extend(by_key.values())  # dicts keep insertion order: lowest rank first
    return groups


def group_results(cells: dict[int, RankCell]) -> list[Group]:
    """Each rank's cell result (its ``Out[n]``), grouped by identical MIME bundle. A result is
    the last thing a cell produces on a rank, so results follow every other output."""
    by_key: dict[object, Group] = {}
    for rank, cell in sorted(cells.items()):
        for out in cell.outputs:
            if out.kind == "result":
                out = _without_parts(out)
                by_key.setdefault(same(out), ([], out))[0].append(rank)
    return list(by_key.values())


def _without_parts(out: Output) -> Output:
    """A result without a global array's parts (spmd.magics.arrays.values puts those together;
    where it cannot, each rank's result is jax's placeholder)."""
    if GLOBAL_ARRAY_MIME not in out.data:
        return out
    data = {k: v for k, v in out.data.items() if k != GLOBAL_ARRAY_MIME}
    return Output(out.kind, data=data, metadata=out.metadata)


class RankResults:
    """The ranks' results as the notebook cell's own result, so the front end shows one
    ``Out[n]`` (an execute_result). When every rank that returned one returned the same, it
    is that value's own MIME bundle (``42``, as a kernel of one process shows it, for the
    tools that read a cell's result: papermill, nbval, ``Out``); which ranks returned it is in
    the message's metadata and on a line of its own above it, never inside the value. When
    they differ, the per-rank texts one under the other, each under its ranks."""

    def __init__(self, groups: list[Group]) -> None:
        self.groups = groups

    @classmethod
    def of(cls, groups: list[Group], ranks: int = 0) -> RankResults | None:
        """None when there is no result, or several rich ones (those are shown one by one).
        ``ranks``: how many ranks ran the cell."""
        if not groups:
            return None
        if len(groups) > 1 and any(_is_rich(out) for _, out in groups):
            for group in groups:
                show_group(*group)
            return None
        if len(groups) == 1 and (_is_rich(groups[0][1]) or len(groups[0][0]) < ranks):
            # (its label, above it: a picture's, and a value only some ranks returned; a text
            # every rank returned is the value alone, as one process shows it)
            write("stdout", rank_label(groups[0][0]) + "\n")
        return cls(groups)

    def _repr_mimebundle_(self, include=None, exclude=None):
        if len(self.groups) == 1:
            ((ranks, out),) = self.groups
            return _bundle(out), {**(out.metadata or {}), "spmd": {"ranks": list(ranks)}}
        text = "".join(
            labelled(rank_label(ranks), out.data.get("text/plain", ""))
            for ranks, out in self.groups
        )
        return {"text/plain": text.rstrip("\n")}, {
            "spmd": {"ranks": sorted(r for ranks, _ in self.groups for r in ranks)}}

    def __repr__(self) -> str:
        return self._repr_mimebundle_()[0]["text/plain"]


def _split_common_lines(at_k: dict[int, Output]) -> list[tuple[int, Output]]:
    """When every rank printed to one stream and the texts differ, split off the lines they
    all begin with, so ``print('same'); print(rank)`` shows 'same' once."""
    outs = list(at_k.values())
    kind = outs[0].kind
    pairs = list(at_k.items())
    if kind not in ("stdout", "stderr") or len(outs) < 2 or any(o.kind != kind for o in outs):
        return pairs
    if len({o.text for o in outs}) == 1:
        return pairs
    split = [o.text.splitlines(keepends=True) for o in outs]
    common = 0
    while all(common < len(lines) for lines in split) and len({ls[common] for ls in split}) == 1:
        common += 1
    if common == 0:
        return pairs
    head = Output(kind, "".join(split[0][:common]))
    heads = [(rank, head) for rank in at_k]
    tails = [(rank, Output(kind, "".join(ls[common:]))) for rank, ls in zip(at_k, split)]
    return heads + [(rank, out) for rank, out in tails if out.text]


def group_errors(cells: dict[int, RankCell], ignore: set[int] = frozenset()) -> list[Group]:
    """Errors grouped by identical traceback; a KeyboardInterrupt on a rank in ``ignore``
    (interrupted by the notebook itself) is left out."""
    by_key: dict[object, Group] = {}
    for rank, cell in sorted(cells.items()):
        err = cell.error
        if err is not None and not (rank in ignore and err.ename == "KeyboardInterrupt"):
            by_key.setdefault(same(cell.error), ([], cell.error))[0].append(rank)
    return list(by_key.values())


def labelled(label: str, text: str) -> str:
    """'[rank 0] 8 2' for one line; the label on a line of its own above several."""
    body = text[:-1] if text.endswith("\n") else text
    return f"{label} {body}\n" if "\n" not in body else f"{label}\n{body}\n"


def write(stream: str, text: str) -> None:
    """``text`` to the notebook's stdout or stderr, now."""
    out = sys.stdout if stream == "stdout" else sys.stderr
    out.write(text)
    out.flush()


def _is_rich(out: Output) -> bool:
    """A picture, HTML or any bundle with more than text."""
    return bool(set(out.data) - {"text/plain"})


def _bundle(out: Output) -> dict:
    """A display's or result's MIME bundle; a rich one gets a text form for saved notebooks."""
    data = dict(out.data)
    if _is_rich(out):
        data.setdefault("text/plain", f"<{', '.join(sorted(data))}>")
    return data


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def widget_id(out: Output) -> str | None:
    """The model id of the widget an output shows (None: not a widget)."""
    view = out.data.get(WIDGET_VIEW) if out.kind in ("display", "result") else None
    return view.get("model_id") if isinstance(view, dict) else None


def show_outputs(cells: dict[int, RankCell], tabs: bool = False, then: bool = False) -> None:
    """The cell's outputs, grouped; with ``tabs``, ranks whose outputs differ get a tab each
    (one per group of ranks with the same outputs), under the text form of the stacked view.

    A last ``clear_output(wait=True)`` clears at the next output: in one process, at the
    cell's value or error, if ``then`` one follows, and never otherwise. So it is a clear now
    where ``then``, and nothing where not: what the notebook shows next of its own (the
    cell's per-rank data, a note) neither clears the outputs nor is cleared by what follows."""
    groups = group_outputs(cells)
    last = groups[-1][1] if groups else None
    pending = last is not None and last.kind == "clear" and last.data["wait"]
    if pending:
        groups = groups[:-1]
    if tabs:
        per_rank = _shown_outputs(cells)
        by_outputs: dict[object, list[int]] = {}
        for rank, outs in per_rank.items():
            by_outputs.setdefault(tuple(same(o) for o in outs), []).append(rank)
        if len(by_outputs) > 1:
            display(_tabs_bundle(list(by_outputs.values()), per_rank, groups), raw=True)
            return
    for group in groups:
        show_group(*group)
    if pending and then:
        clear_output()


def _tabs_bundle(rank_groups: list[list[int]], per_rank: dict, groups: list[Group]) -> dict:
    import ipywidgets

    pages = []
    for ranks in rank_groups:
        page = ipywidgets.Output()
        page.outputs = tuple(_nbformat_output(o) for o in per_rank[ranks[0]])
        pages.append(page)
    tab = ipywidgets.Tab(children=pages)
    tab.titles = tuple(rank_label(ranks)[1:-1] for ranks in rank_groups)
    data = tab._repr_mimebundle_()
    # (saved without a widget front end, the notebook keeps the stacked view's text)
    data["text/plain"] = "".join(_group_text(*group) for group in groups).rstrip("\n")
    return data


def _nbformat_output(out: Output) -> dict:
    if out.kind in ("stdout", "stderr"):
        return {"output_type": "stream", "name": out.kind, "text": out.text}
    return {"output_type": "display_data", "data": out.data, "metadata": out.metadata}


def _group_text(ranks: list[int], out: Output) -> str:
    if out.kind in ("stdout", "stderr"):
        return labelled(rank_label(ranks), out.text)
    if out.kind == "clear":
        return ""
    return labelled(rank_label(ranks), _bundle(out).get("text/plain", ""))


def show_group(ranks: list[int], out: Output) -> None:
    if out.kind == "clear":  # the ranks cleared their output: so does the notebook
        clear_output(wait=out.data["wait"])
        return
    if out.kind in ("stdout", "stderr"):
        write(out.kind, labelled(rank_label(ranks), out.text))
        return
    # (the rank's own bundle, as a kernel of one process shows it; its ranks on a line of
    # their own above it and in its metadata, never inside it)
    write("stdout", rank_label(ranks) + "\n")
    metadata = {**(out.metadata or {}), "spmd": {"ranks": list(ranks)}}
    display(_bundle(out), metadata=metadata, raw=True)


class RankErrors(Exception):
    """A cell failed on some ranks, or did not finish on them; the notebook cell fails.

    ``errors`` are the tracebacks grouped by identical text. ``notes`` say what else happened
    (a divergence, a timeout, a death) and what to do next; ``details`` follow the tracebacks
    (where the busy ranks were, a dead rank's last lines). ``title`` is its message where
    there are notes: a line of its own, as a front end may show it beside the report.
    """

    def __init__(
        self,
        errors: list[Group],
        ranks: list[int],
        notes: list[str] = (),
        details: list[str] = (),
        hints: list[str] = (),
        dead: list[int] = (),
        title: str = "",
    ) -> None:
        self.errors = errors
        self.dead = list(dead)  # ranks that died: the notes, not the error count, come first
        self.ranks = ranks
        self.notes = list(notes)
        self.details = list(details)
        self.hints = list(hints)  # what to do about the errors, under the headline
        self.failed_ranks = sorted(r for rs, _ in errors for r in rs)
        if self.notes:
            # (not notes[0]: front ends that show the message beside the report would say
            # its first sentence twice)
            message = title or "The cell stopped before every rank finished."
        else:
            first = errors[0][1]
            message = f"{rank_label(self.failed_ranks)} {first.ename}: {first.evalue}"
        super().__init__(message)

    def _render_traceback_(self) -> list[str]:
        failed, n = self.failed_ranks, len(self.ranks)
        ok = sorted(set(self.ranks) - set(failed) - set(self.dead))
        lines = list(self.notes) if self.dead else []
        if failed:
            lines.append(
                f"Error on {len(failed)} of {n} ranks ({rank_set(failed)})"
                + (f"; {rank_words(ok)} did not raise." if ok else ".")
            )
        if not self.dead:
            lines.extend(self.notes)
        lines.extend(self.hints)
        for ranks, err in self.errors:
            lines.append("")
            lines.append(f"{rank_label(ranks)} {err.ename}: {err.evalue}")
            lines.extend(err.traceback)
        lines.extend(self.details)
        return lines


# The characters of a line not ended yet that the live view keeps (print('.', end='') in a
# loop makes one line without end)
OPEN_LINE = 2_000


class LiveView:
    """What a long cell is doing, shown while it runs: the last lines of every rank's streams
    and, after ``look_after`` seconds, the line each busy rank is on; at once, the ranks the
    cell waits for after the others finished (the watchdog's stragglers: slower, not diverged),
    and the line they are on.

    Fast cells never show it. When the cell ends, the live view is cleared (with the cell's
    output, so that a saved notebook holds no empty leftover), the lines printed before it are
    printed again, and then the grouped outputs, so a saved notebook keeps the grouped form only.
    """

    delay = 1.0  # seconds a cell runs before its streams are shown live
    every = 0.25  # seconds between updates
    keep = 20  # lines shown
    look_after = 10.0  # seconds a cell runs before the busy ranks' lines are shown
    look_every = 10.0  # seconds between two looks (each is a stack dump of the busy ranks)

    def __init__(self, where: Callable[[list[int]], dict] | None = None, panel=None,
                 sidebar: Callable | None = None) -> None:
        self.started = time.monotonic()
        self.panel = panel  # a Panel, updated on every tick
        self.sidebar = sidebar  # the SPMD kernel's Ranks sidebar's tick(run), on every tick
        self.widgets_shown = False
        self.prompted = False  # a rank asked the person something: its lines were shown
        self._unshown: dict[int, str] = {}  # stream text of each rank since its last prompt
        self.lines: list[str] = []  # whole lines, each with its rank
        # (rank, stream) -> its line begun and not ended yet: print writes its words, and a
        # rank sends what it has every 0.2 s, so a line can come in pieces
        self._open: dict[tuple[int, str], str] = {}
        self.status: list[str] = []
        self.late = ""  # the stragglers' lines ('' while there are none)
        self.handle = None
        self.where = where
        self._shown_at = 0.0
        self._looked_at = 0.0
        self._calls: list = []  # the stragglers' calls of jax or torch, (rank, since when)
        self._dirty = False
        self._before: list[tuple[str, str]] = []  # (stream, text) shown before the live view

    def reprint(self, stream: str, text: str) -> None:
        """Something the cell showed already, to show again if the live view clears it."""
        self._before.append((stream, text))

    def note(self, stream: str, text: str) -> None:
        """Print ``text`` now, and again if the live view clears it."""
        write(stream, text)
        self.reprint(stream, text)

    # -- the cell's observer (records.CellObserver): the cell runner calls these while it runs

    def output(self, rank: int, out: Output) -> None:
        """One output of ``rank``: a widget at once, stream lines into the view."""
        if widget_id(out) is not None:
            # at once, so that a progress bar moves while the cell runs (its model is the
            # rank's; the comm messages that change it are relayed as they come)
            show_group([rank], out)
            self.widgets_shown = True
            return
        if out.kind not in ("stdout", "stderr") or not out.text:
            return
        text = unmarked(out.text)  # (the grouped view puts printed arrays together)
        self._unshown[rank] = (self._unshown.get(rank, "") + text)[-20_000:]
        lines = (self._open.pop((rank, out.kind), "") + text).splitlines(keepends=True)
        if lines and lines[-1].splitlines()[0] == lines[-1]:  # (not ended yet)
            self._open[(rank, out.kind)] = lines.pop()[-OPEN_LINE:]
        self.lines.extend(f"[rank {rank}] {ln.splitlines()[0]}" for ln in lines)
        del self.lines[: -self.keep]
        self._dirty = True

    def show_rank(self, rank: int) -> None:
        """Print what ``rank`` printed since its last prompt, now (before its next prompt)."""
        text = self._unshown.pop(rank, "")
        self._unshown.clear()  # (the other ranks' lines wait for the grouped view)
        if text:
            write("stdout", text)
        self.prompted = True

    def prompt(self, rank: int, request: dict, run) -> dict:
        """``rank``'s ``input()``, ``getpass`` or pdb prompt, asked of the person with the
        rank in the prompt (``[rank 1] (Pdb) ``), after what the rank printed since its last
        one. It is the notebook's own ``input``/``getpass``, so it goes to the front end's
        stdin like any prompt of the notebook; where the front end has none (nbclient,
        papermill), that raises StdinNotImplementedError at once, and the rank raises the
        same. A KeyboardInterrupt goes up: the cell run ends every rank's prompt."""
        if self.panel is not None:  # (it cannot update while the person types)
            self.panel.show_now(run)
        self.show_rank(rank)  # what it printed since: pdb's lines come before its prompt
        label = f"[rank {rank}] {request.get('prompt', '')}"
        try:
            if request.get("password"):
                text = getpass.getpass(label)
            else:
                text = builtins.input(label)
        except EOFError:
            text = "\x04"
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # StdinNotImplementedError: no stdin in this front end
            return {"error": str(exc) or type(exc).__name__}
        return {"text": text}

    def tick(self, run=None) -> None:
        """The cell still runs: the panel, the stragglers' lines, the busy ranks' lines after
        ``look_after``, and the view itself at most every ``every`` seconds."""
        now = time.monotonic()
        if self.panel is not None and run is not None:
            self.panel.tick(run)
        if self.sidebar is not None and run is not None:
            self.sidebar(run)
        late = _late(run, now) if run is not None else ""
        if late != self.late:
            self.late, self._dirty = late, True
        calls = sorted((r, since) for r, (_, since) in getattr(run, "inside", {}).items())
        if calls != self._calls:  # (a straggler went into a call of jax: its line, at once)
            self._calls, self._looked_at = calls, 0.0
        if (
            self.where is not None
            and run is not None
            and (now - self.started >= self.look_after or late)
            and now - self._looked_at >= self.look_every
            and run.busy_ranks
        ):
            self._looked_at = now
            self.status = progress_lines(self.where(run.busy_ranks), now - self.started,
                                         run.debugger_paused())
            self._dirty = True
        if not self._dirty or now - self.started < self.delay or now - self._shown_at < self.every:
            return
        begun = [f"[rank {rank}] {text}" for (rank, _), text in self._open.items()]
        late = [self.late] if self.late else []
        bundle = {"text/plain": "\n".join(late + self.status + (self.lines + begun)[-self.keep :])}
        if self.handle is None:
            self.handle = display(bundle, raw=True, display_id=True)
        else:
            self.handle.update(bundle, raw=True)
        self._shown_at, self._dirty = now, False

    def close(self) -> None:
        if self.handle is None and not (self.widgets_shown or self.prompted):
            return
        self.handle = None
        clear_output()
        if self.panel is not None:
            self.panel.forget()
        for stream, text in self._before:
            write(stream, text)


def _late(run, now: float) -> str:
    """The live view's lines on the stragglers of ``run`` now ('' when it waits for none):
    slower, or inside jax or torch (the watchdog's last look)."""
    busy = set(run.busy_ranks)
    late = [r for r in getattr(run, "stragglers", ()) if r in busy]
    if not late or run.first_done is None:
        return ""
    finished = sorted(r for r, cell in run.cells.items() if cell.done)
    inside = {r: stack for r, (stack, _) in getattr(run, "inside", {}).items()}
    return "\n".join(straggler_lines(late, finished, now - run.first_done, inside))
