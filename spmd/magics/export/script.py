"""``%spmd export PATH``: the cells the ranks ran, as a script a job runs, and its launch.

The script is plain Python, without spmd: at its top the start-up ``%spmd start`` did in every
rank (which process this is, the GPU share, jax's devices and ``jax.distributed.initialize``,
torch's ``init_process_group``), written for the launcher that will run it; then the cells in
the order the ranks ran them since the start or the last restart (``Session.ran``), each as
plain Python (to_python.py). Beside it, the launch: a shell script for local processes, ssh,
mpiexec or torchrun, or an sbatch script. Runs on the main thread, like every magic.
"""

from __future__ import annotations

import ast
import functools
import os
import sys
import textwrap
from dataclasses import dataclass, field

from IPython.core.error import UsageError

from spmd.cluster.records import Ran, Rank, Settings
from spmd.magics.export.launch_file import LaunchFile
from spmd.magics.export.to_python import defined_names, needs_person, plain
from spmd.magics.start.arguments import _Parser

LAUNCHERS = ("local", "ssh", "mpi", "slurm", "torchrun")

# How each launcher tells a process which it is: (rank, process count, rank on its host).
_WHICH = {
    "local": ('os.environ["RANK"]', 'os.environ["WORLD_SIZE"]', 'os.environ["LOCAL_RANK"]'),
    "slurm": ('os.environ["SLURM_PROCID"]', 'os.environ["SLURM_NTASKS"]',
              'os.environ["SLURM_LOCALID"]'),
    "mpi": ('os.environ.get("PMI_RANK") or os.environ["OMPI_COMM_WORLD_RANK"]',
            'os.environ.get("PMI_SIZE") or os.environ["OMPI_COMM_WORLD_SIZE"]',
            'os.environ.get("MPI_LOCALRANKID") or os.environ["OMPI_COMM_WORLD_LOCAL_RANK"]'),
}
_SAYS = {
    "local": "the launch says (RANK, WORLD_SIZE,\n# LOCAL_RANK, as torchrun does)",
    "ssh": "the launch says (RANK, WORLD_SIZE,\n# LOCAL_RANK, as torchrun does)",
    "torchrun": "torchrun says (RANK, WORLD_SIZE, LOCAL_RANK)",
    "slurm": "srun says",
    "mpi": "mpiexec says, in MPICH's names or\n# Open MPI's",
}


@functools.cache
def _parser() -> _Parser:
    p = _Parser(prog="%spmd export", add_help=False)
    p.add_argument("path")
    p.add_argument("--launcher", choices=LAUNCHERS, default=None)
    p.add_argument("--cells", choices=("ok", "all"), default="ok")
    p.add_argument("--raw-output", action="store_true")
    return p


def pushed(names: list[str], namespace: dict) -> str:
    """``%spmd push NAMES`` as Python: ``x = 3`` for a value whose repr is its source, else a
    comment that says to define it."""
    lines = []
    for name in names:
        text = repr(namespace.get(name))
        try:
            same = len(text) < 2000 and ast.literal_eval(text) == namespace.get(name)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            same = False
        lines.append(f"{name} = {text}" if same else
                     f"# {name}: pushed from the notebook ({type(namespace.get(name)).__name__}); "
                     "define it here")
    return "\n".join(lines) + "\n"


@dataclass
class Job:
    """What the export writes, for one cluster and one launcher."""

    settings: Settings
    launcher: str
    ranks: list[Rank]
    path: str
    keep_failed: bool = False
    imports: set[str] = field(default_factory=lambda: {"os"})
    left_out: list[str] = field(default_factory=list)  # 'In [4] (ZeroDivisionError on rank 1)'
    person: list[str] = field(default_factory=list)  # 'In [6] (input() waits ...)'
    cells: int = 0
    pmi: bool = False  # the script says hello and goodbye to MPICH's mpiexec (script())
    master: str = ""  # rank 0's address as the others reached it ('': unknown)
    labels: bool = True  # each line of the job's output begins with its rank
    hash_seed: str = ""  # the ranks' one string-hash secret ('': each rank had its own)
    # what a cell sets up again ("init_process_group", "distributed.initialize"): script()
    joined_again: set[str] = field(default_factory=set)
    # names the script has defined so far (a shell command's $name expands only for these)
    known: set[str] = field(default_factory=lambda: {"os", "rank", "world_size", "local_rank",
                                                     "jax", "torch", "dist"})

    @property
    def backends(self) -> list[str]:
        return [b for b in self.settings.backend.split(",") if b != "none"]

    @property
    def python(self) -> str:
        return self.settings.where.python or sys.executable

    @property
    def launch_path(self) -> str:
        stem = self.path[:-3] if self.path.endswith(".py") else self.path
        return stem + (".sbatch" if self.launcher == "slurm" else ".sh")

    def launch_file(self) -> LaunchFile:
        """The file that launches the script (launch_file.py)."""
        return LaunchFile(self.settings, self.launcher, os.path.abspath(self.path),
                      self.launch_path, self.python, self.gpus, self.master, self.labels,
                      self.hash_seed)

    @property
    def gpus(self) -> int | None:
        """GPUs each rank had (None: the ranks' GPUs were left alone; 0: they were given none)."""
        given = [len(r.gpus) for r in self.ranks if r.gpus is not None]
        return max(given) if given else None

    # -- the script ---------------------------------------------------------------------

    def script(self, ran: list[Ran]) -> str:
        body = [self._cell(i, r) for i, r in enumerate(ran, 1)]
        # (a cell that sets up the job again, as scripts written for torchrun begin: in the
        # notebook it was told the ranks had it and carried on; the script does the same)
        self.joined_again = {name for name in ("init_process_group", "distributed.initialize")
                             if any(name in r.code for r in ran if r.where != "notebook")}
        # (an MPI library in the processes is mpiexec's PMI client itself: no hello of ours)
        self.pmi = self.launcher == "mpi" and not (
            self.settings.torch_backend == "mpi" and "torch" in self.backends
        ) and not any("mpi4py" in r.code for r in ran)
        start = self._startup()
        s = self.settings
        what = f"{s.n} ranks (" + ", ".join(
            ["+".join(self.backends) or "no backend"]
            + ([f"{s.cpu_devices} CPU devices each"] if s.cpu_devices else [])
        ) + ")"
        name = os.path.basename(self.path)
        about = textwrap.fill(
            f"Written by %spmd export from a cluster of {what}: {self.cells} "
            f"{'cell' if self.cells == 1 else 'cells'}, in the order they ran. Every process "
            "runs all of it, as every rank did.", 92)
        head = [f'"""{name}: the cells the ranks ran in the notebook, as one program.', "",
                about, f"Launch: {self.launch_file().command()}", '"""']
        imports = sorted(i for i in self.imports if i)
        end = []
        if "torch" in self.backends:
            # (a process that leaves while a peer's gloo threads still talk to it aborts that
            # peer: "terminate called without an active exception", seen in 4 of 6 runs)
            end += ["if dist.is_initialized():",
                    "    dist.barrier()  # (every process done before any leaves)",
                    "    dist.destroy_process_group()"]
        if "jax" in self.backends or self.pmi:  # (last: a failure above still leaves at once)
            end += ["atexit.unregister(leave_at_once)  # (done: the exit waits for every "
                    "process, as jax's does)" if "jax" in self.backends else
                    "atexit.unregister(leave_at_once)  # (done: a goodbye to mpiexec below)"]
        if self.pmi:
            end += ["if pmi >= 0:  # (a goodbye to mpiexec)",
                    '    os.write(pmi, b"cmd=finalize\\n"), os.read(pmi, 1024)']
        end = ["", "# -- End " + "-" * 72, *end] if end else []
        return "\n".join(
            head + [f"import {i}" for i in imports if " " not in i]
            + [i for i in imports if " " in i] + ["", *start, *body, *end]
        ).rstrip("\n") + "\n"

    def _which(self) -> list[str]:
        rank, size, local = _WHICH.get(self.launcher, _WHICH["local"])
        lines = [
            f"# Which process this is, of how many: {_SAYS[self.launcher]}.",
            f"rank = int({rank})",
            f"world_size = int({size})",
        ]
        if self.gpus is not None or "torch" in self.backends:
            lines.append(f"local_rank = int({local})  # (its place on its host)")
        return lines

    def _startup(self) -> list[str]:
        s, lines = self.settings, ["# -- Start-up: what %spmd start did in every rank " + "-" * 30]
        lines += self._which()
        if self.launcher == "mpi":
            lines += [
                "# mpiexec puts the rank before each piece of output it reads: one write a line,",
                "# even where PYTHONUNBUFFERED is set (print's words would each be a piece).",
                "sys.stdout.reconfigure(line_buffering=True, write_through=False)",
                "sys.stderr.reconfigure(line_buffering=True, write_through=False)",
            ]
            self.imports.add("sys")
        if self.pmi:
            lines += [
                "# MPICH's mpiexec ends the job at once when a process that said hello to it",
                "# leaves without a goodbye (its PMI); a failed process that did not would leave",
                "# the others waiting for it.",
                'pmi = int(os.environ.get("PMI_FD", -1))',
                "if pmi >= 0:",
                '    os.write(pmi, b"cmd=init pmi_version=1 pmi_subversion=1\\n"), '
                "os.read(pmi, 1024)",
            ]
        k = self.gpus
        if k == 0:
            lines += ["# No GPU for any process, as %spmd start gave them (--gpus-per-process 0).",
                      'os.environ["CUDA_VISIBLE_DEVICES"] = ""']
        elif k:
            lines += [
                f"# {k} GPU{'s' if k > 1 else ''} per process, as %spmd start shared out the "
                "host's GPUs (the ones it lets",
                "# this job see); set before jax or torch starts: both read it once.",
                "# (where the launcher showed this process its own already, as Slurm's "
                "--gpus-per-task can, they stay)",
                'host_gpus = os.environ.get("CUDA_VISIBLE_DEVICES")',
                f'if host_gpus is None or len(host_gpus.split(",")) != {k}:',
                f"    host_gpus = host_gpus.split(\",\") if host_gpus else [str(i) for i in "
                f"range((local_rank + 1) * {k})]",
                f'    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(host_gpus[local_rank * {k}:'
                f"(local_rank + 1) * {k}])",
            ]
        both = len(self.backends) == 2
        if "jax" in self.backends:
            lines += ["", "import jax", ""]
            if s.cpu_devices:
                lines.append(f'jax.config.update("jax_num_cpu_devices", {s.cpu_devices})  '
                             f"# -d {s.cpu_devices}")
            if s.cache_dir:
                lines.append(f'jax.config.update("jax_compilation_cache_dir", {s.cache_dir!r})')
            else:
                lines += ["# To keep compiled cells across runs (the notebook's ranks used a "
                          "folder of their own):",
                          '# jax.config.update("jax_compilation_cache_dir", "/shared/jax-cache")']
            lines += self._jax_initialize(both)
            if "distributed.initialize" in self.joined_again:
                lines += _once("jax.distributed", "initialize", "jax.distributed")
        if "jax" in self.backends or self.pmi:  # (after jax's: its atexit runs first)
            lines += _fail_fast("jax" in self.backends, self.pmi)
            self.imports |= {"atexit", "builtins", "sys"} | ({"signal"} if self.pmi else set())
        if "torch" in self.backends:
            if s.check_collectives:
                lines += ["", "# torch's own check of each collective across the processes, as "
                          "%spmd start",
                          "# --check-collectives had it (read when torch.distributed is "
                          "imported).",
                          'os.environ.setdefault("TORCH_DISTRIBUTED_DEBUG", "DETAIL")']
            lines += ["", "import torch", "import torch.distributed as dist", ""]
            lines += self._torch_init()
            if "init_process_group" in self.joined_again:
                lines += _once("dist", "init_process_group", "dist")
        return lines + [""]

    def _jax_initialize(self, beside_torch: bool) -> list[str]:
        if self.launcher == "slurm":
            # (with GPUs: those this process was given above, not the one of its local rank
            # that jax would pick)
            devices = f"local_device_ids=list(range({self.gpus}))" if self.gpus else ""
            return ["# jax reads Slurm's variables: the process count, this rank, and rank "
                    "0's node (the first of the step's nodes).",
                    f"jax.distributed.initialize({devices})"]
        port = "os.environ['MASTER_PORT']"
        why = ""
        if beside_torch or self.launcher == "torchrun":
            port = "int(os.environ['MASTER_PORT']) + 1"
            why = " (MASTER_PORT itself is torch's)"
        return [
            f"# Rank 0's address, where the others join it{why}: the launch gives it.",
            f"coordinator = f\"{{os.environ['MASTER_ADDR']}}:{{{port}}}\"",
            "jax.distributed.initialize(coordinator, num_processes=world_size, "
            "process_id=rank)",
        ]

    def _torch_init(self) -> list[str]:
        s, lines = self.settings, []
        if self.launcher in ("slurm", "mpi"):
            lines += [
                "# torch's own names for them, as every rank had them in the notebook.",
                "os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), "
                "LOCAL_RANK=str(local_rank))",
            ]
        if s.torch_backend == "nccl":
            lines.append(f"torch.cuda.set_device({'0' if self.gpus else 'local_rank'})")
        if s.torch_backend == "mpi":
            return lines + ['dist.init_process_group("mpi")  # (MPI knows rank and size)']
        if self.launcher == "torchrun" or s.init_method == "env":
            method = '"env://"'
            extra = ""
        elif s.init_method == "tcp":
            method = "f\"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}\""
            extra = ", rank=rank, world_size=world_size"
        else:  # a file every process opens (the launch removes one left from a run before)
            store = os.path.abspath(self.path[:-3] + ".torch-store")
            method = repr(f"file://{store}")
            extra = ", rank=rank, world_size=world_size"
        return lines + [f'dist.init_process_group("{s.torch_backend}", '
                        f"init_method={method}{extra})"]

    def _cell(self, number: int, ran: Ran) -> str:
        label = f"In [{ran.count}]" if ran.count is not None else f"cell {number}"
        if ran.where == "notebook":
            self.left_out.append(f"{label} (%%local)")
            return f"# -- {label}: left out, a %%local cell (it ran in the notebook only)\n"
        if ran.where == "debug":
            self.person.append(f"{label} ({ran.code})")
            return (f"# -- {label}: {ran.code}: pdb on a rank's last error, for a person at the "
                    "notebook; in a job, run the script under python -m pdb\n")
        if ran.failed and not self.keep_failed:
            self.left_out.append(f"{label} ({ran.failed})")
            return f"# -- {label}: left out, it failed in the notebook: {ran.failed}\n"
        head = f"# -- {label} " + "-" * max(4, 80 - 7 - len(label))
        if ran.where == "push":
            self.cells += 1
            self.known |= defined_names(ran.code)
            return f"{head}\n# (%spmd push: from the notebook)\n{ran.code}"
        cell = plain(ran.code, self.known)
        if cell.notebook:  # (it would end every process with a NameError)
            self.left_out.append(f"{label} (reads {cell.notebook})")
            return (f"# -- {label}: left out, it reads the notebook's own {cell.notebook}, "
                    "which a script does not have;\n# write here the value it read:\n"
                    + textwrap.indent(ran.code.rstrip("\n") + "\n", "# ", lambda _: True))
        self.cells += 1
        self.known = cell.known  # (with the names this cell defines)
        self.imports |= cell.imports
        code = _printed_value(cell.code) if ran.showed_value else cell.code
        if "display(" in code and "import display" not in code:
            self.imports.add("from IPython.display import display")
        notes = []
        if ran.failed:
            notes.append(f"# (it failed in the notebook: {ran.failed})")
        if cell.person:
            self.person.append(f"{label} ({cell.person.split(':')[0]})")
            notes.append(f"# needs a person: {cell.person}.")
        try:
            compile(code, label, "exec")
        except SyntaxError as exc:  # (a failed cell kept, top-level await: not a script's)
            notes.append(f"# (left as a comment: not Python a script can run: {exc.msg}, "
                         f"line {exc.lineno})")
            code = textwrap.indent(code, "# ", lambda _: True)
        if ran.ranks is not None:
            notes.append(f"# (%%spmd --ranks {','.join(map(str, ran.ranks))}: these ranks only)")
            inside = _inside_strings(code)  # (a string's own lines keep their text)
            body = [line if i in inside else f"    {line}" if line.strip() else ""
                    for i, line in enumerate(code.splitlines(), 1)]
            if not any(line.strip() and not line.strip().startswith("#") for line in body):
                body.append("    pass")
            code = f"if rank in {ran.ranks!r}:\n" + "\n".join(body)
        return "\n".join([head, *notes, code.rstrip("\n"), ""])

# A process that fails leaves at once, with its status, so that the launch ends the others.
# jax's own exit waits (5 minutes) at a barrier for every process, and the failed process's
# peers never come: they wait for it in their next collective. (atexit runs the last handler
# first: this one, before jax's.) Under MPICH's mpiexec the process says its status (PMI's
# abort): mpiexec then exits with it, where otherwise it may give the signal it killed a
# peer with (9), seen in 1 run of 3.
def _once(module: str, name: str, library: str) -> list[str]:
    """Lines that make a cell's own ``module.name(...)`` (the job's set-up, done above) carry
    on, as it did in the notebook."""
    return [
        f"# A cell calls {module}.{name} too, as the notebook's ranks were told they had it: "
        "here too",
        "# it carries on (the job is set up above).",
        f"_{name} = {module}.{name}",
        "",
        "",
        f"def {name}(*args, **kwargs):",
        f"    if not {library}.is_initialized():",
        f"        return _{name}(*args, **kwargs)",
        "",
        "",
        f"{module}.{name} = {name}",
    ]


def _fail_fast(jax: bool, pmi: bool) -> list[str]:
    why = (["# status, and the launch ends the others: jax's own exit would wait for them at a",
            "# barrier, and they wait for this one in their next collective. (Undone at the end.)"]
           if jax else ["# status, and mpiexec ends the others. (Undone at the end.)"])
    leave = ["    finally:", "        os._exit(exit_status)"]
    if pmi:
        # (mpiexec ends the others' process groups, each its own, but not the group of one
        # that left: what this one started, a `!cmd` or a Popen, is ended here)
        leave = ["        if pmi >= 0 and exit_status:  # (mpiexec's status is then this one's)",
                 "            if os.getpgid(0) == os.getpid():  # (what it started, too)",
                 "                signal.signal(signal.SIGTERM, signal.SIG_IGN)",
                 "                os.killpg(0, signal.SIGTERM)",
                 '            os.write(pmi, b"cmd=abort exitcode=%d\\n" % exit_status)',
                 *leave]
    return [
        "",
        "# A process that fails (an error, or sys.exit before the end) leaves at once, with its",
        *why,
        "exit_status = 1",
        "def on_error(kind, value, trace, show=sys.excepthook):",
        "    global exit_status",
        "    exit_status = 130 if issubclass(kind, KeyboardInterrupt) else 1  # (as Python's own)",
        "    show(kind, value, trace)",
        "def on_exit(code=0, exit=sys.exit):",
        "    global exit_status",
        "    exit_status = code if isinstance(code, int) else int(code is not None)",
        "    exit(code)",
        "def leave_at_once():",
        "    try:",
        "        sys.stdout.flush(), sys.stderr.flush()",
        *leave,
        "sys.excepthook, sys.exit = on_error, on_exit",
        "builtins.exit = builtins.quit = on_exit  # (exit() and quit() too)",
        "atexit.register(leave_at_once)",
    ]


def _inside_strings(code: str) -> set[int]:
    """The lines of ``code`` (from 1) that continue a string begun on a line before."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return set()
    return {line for node in ast.walk(tree) if isinstance(node, (ast.Constant, ast.JoinedStr))
            for line in range(node.lineno + 1, node.end_lineno + 1)}


def _printed_value(code: str) -> str:
    """The cell's last expression printed as the notebook showed it, the cell's result (its
    repr: ``Array([1., 2.], dtype=float32)``, not ``[1. 2.]``)."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return code
    if not tree.body or not isinstance(tree.body[-1], ast.Expr):
        return code
    last = tree.body[-1]
    before = tree.body[-2] if len(tree.body) > 1 else None
    if last.col_offset or (before is not None and before.end_lineno >= last.lineno):
        return code  # (on a line with another statement: left as it is)
    lines = code.splitlines()
    expression = ast.get_source_segment(code, last.value) or ""
    # (a comment, or a ';'; ast counts a line's columns in UTF-8 bytes, not characters)
    after = lines[last.end_lineno - 1].encode()[last.end_col_offset:].decode()
    after = "" if after.strip() in ("", ";") else "  " + after.strip()
    return "\n".join(lines[: last.lineno - 1] + [f"print(repr({expression})){after}"]) + "\n"


def _address(coordinator: str) -> str:
    """The host part of ``host:port`` ('' for '')."""
    return coordinator.rpartition(":")[0].strip("[]")


def export(session, args: list[str]) -> str:
    """Write the script and its launch; what to say in the cell."""
    opts = _parser().parse_args(args)
    s = session.settings
    launcher = opts.launcher or s.where.launcher
    path = os.path.expanduser(opts.path)
    if not path.endswith(".py") or os.path.basename(path) == ".py":
        raise UsageError(f"%spmd export writes a Python script: give a path ending in .py, "
                         f"like {opts.path.removesuffix('.py') or 'train'}.py.")
    if s.torch_backend == "mpi" and "torch" in s.backend and launcher != "mpi":
        raise UsageError(f"torch's mpi backend takes its ranks from mpiexec: export with "
                         f"--launcher mpi, not {launcher}.")
    if launcher == "ssh" and not s.where.hosts:
        raise UsageError("--launcher ssh needs the hosts the ranks ran on, and this cluster ran "
                         "on this machine: export with --launcher local, mpi, slurm or "
                         "torchrun, or start with --hosts.")
    job = Job(s, launcher, list(session.ranks), path, keep_failed=opts.cells == "all",
              master=_address(session.record().coordinator), labels=not opts.raw_output,
              hash_seed=session.record().hash_seed)
    launch_file = job.launch_file()
    script, launch = job.script(list(session.ran)), launch_file.text()
    replaced = [p for p in (job.path, job.launch_path) if os.path.exists(p)]
    for path, text, mode in ((job.path, script, 0o644), (job.launch_path, launch, 0o755)):
        try:
            with open(path, "w") as f:
                f.write(text)
            os.chmod(path, mode)
        except OSError as exc:
            raise UsageError(f"%spmd export cannot write {path} ({exc.strerror}): give a path "
                             "in a folder you can write.") from None
    cells = f"{job.cells} {'cell' if job.cells == 1 else 'cells'}"
    lines = [f"Wrote {job.path} ({cells} the ranks ran since the start, in that order) and "
             f"{job.launch_path} (its launch, {launcher})"
             + (f", replacing the {' and '.join(map(os.path.basename, replaced))} there."
                if replaced else ".")]
    if job.left_out:
        lines.append(f"Left out: {', '.join(job.left_out)}"
                     + (" (--cells all keeps the failed ones)." if not job.keep_failed else "."))
    if job.person:
        count = len(job.person)
        lines.append(f"{count} {'cell needs' if count == 1 else 'cells need'} a person, "
                     f"flagged in the script: {', '.join(job.person)}.")
    lines += [f"Run it with: {launch_file.command()}", "", launch.rstrip("\n")]
    return "\n".join(lines)


__all__ = ["export", "needs_person", "pushed"]
