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
import shlex
import sys
import textwrap
from dataclasses import dataclass, field

from IPython.core.error import UsageError

from spmd.cluster.ranks import Ran, Rank, Settings
from spmd.magics.arguments import _Parser
from spmd.magics.to_python import defined_names, needs_person, plain

LAUNCHERS = ("local", "ssh", "mpi", "slurm", "torchrun")
DEFAULT_PORT = 29500  # torch's own default MASTER_PORT

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
    notebook: list[str] = field(default_factory=list)  # 'In [7] (Out)'
    cells: int = 0
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

    @property
    def gpus(self) -> int | None:
        """GPUs each rank had (None: the ranks' GPUs were left alone; 0: they were given none)."""
        given = [len(r.gpus) for r in self.ranks if r.gpus is not None]
        return max(given) if given else None

    # -- the script ---------------------------------------------------------------------

    def script(self, ran: list[Ran]) -> str:
        body = [self._cell(i, r) for i, r in enumerate(ran, 1)]
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
                about, f"Launch: {self.command()}", '"""']
        imports = sorted(i for i in self.imports if i)
        end = []
        if "torch" in self.backends:
            # (a process that leaves while a peer's gloo threads still talk to it aborts that
            # peer: "terminate called without an active exception", seen in 4 of 6 runs)
            end = ["", "# -- End " + "-" * 72,
                   "if dist.is_initialized():",
                   "    dist.barrier()  # (every process done before any leaves)",
                   "    dist.destroy_process_group()"]
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
        if "torch" in self.backends:
            lines += ["", "import torch", "import torch.distributed as dist", ""]
            lines += self._torch_init()
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
        self.cells += 1
        head = f"# -- {label} " + "-" * max(4, 80 - 7 - len(label))
        if ran.where == "push":
            self.known |= defined_names(ran.code)
            return f"{head}\n# (%spmd push: from the notebook)\n{ran.code}"
        cell = plain(ran.code, self.known)
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
        if cell.notebook:
            self.notebook.append(f"{label} ({cell.notebook})")
            notes.append(f"# needs the notebook: {cell.notebook} (a script has no IPython): "
                         "write the value it reads here.")
        try:
            compile(code, label, "exec")
        except SyntaxError as exc:  # (a failed cell kept, top-level await: not a script's)
            notes.append(f"# (left as a comment: not Python a script can run: {exc.msg}, "
                         f"line {exc.lineno})")
            code = textwrap.indent(code, "# ", lambda _: True)
        if ran.ranks is not None:
            notes.append(f"# (%%spmd --ranks {','.join(map(str, ran.ranks))}: these ranks only)")
            body = [f"    {line}" if line.strip() else "" for line in code.splitlines()]
            if not any(line.strip() and not line.strip().startswith("#") for line in body):
                body.append("    pass")
            code = f"if rank in {ran.ranks!r}:\n" + "\n".join(body)
        return "\n".join([head, *notes, code.rstrip("\n"), ""])

    # -- the launch ---------------------------------------------------------------------

    def command(self) -> str:
        name = os.path.basename(self.launch_path)
        return f"sbatch {name}" if self.launcher == "slurm" else f"bash {name}"

    def launch(self) -> str:
        s, n = self.settings, self.settings.n
        script = os.path.abspath(self.path)
        py_dir = os.path.dirname(self.python) if os.path.isabs(self.python) else ""
        path_line = [f'export PATH="{py_dir}:$PATH"  # the Python the ranks ran, with its '
                     "packages"] if py_dir else []
        here = '"$(dirname "$0")"/' + shlex.quote(os.path.basename(script))
        store = ([f"rm -f {shlex.quote(script[:-3] + '.torch-store')}  # (torch's file store, "
                  "fresh for each run)"]
                 if "torch" in self.backends and s.init_method not in ("tcp", "env")
                 and self.launcher != "torchrun" else [])
        port = f"${{MASTER_PORT:-{DEFAULT_PORT}}}"
        if self.launcher == "slurm":
            return self._sbatch(path_line + store, script)
        if self.launcher == "mpi":
            line = ["mpiexec", "-n", str(n), *self._mpi_hosts(),
                    "-genv", "MASTER_ADDR", self._master(), "-genv", "MASTER_PORT", port,
                    "python", here]
            return _bash(
                [f"# {os.path.basename(script)} as {n} MPI processes, with MPICH's mpiexec.",
                 f"# (Open MPI: mpirun -n {n} -x MASTER_ADDR={self._master()} "
                 f"-x MASTER_PORT={DEFAULT_PORT} python {os.path.basename(script)})"]
                + path_line + store + [" ".join(line)])
        if self.launcher == "torchrun":
            hosts = s.where.hosts
            lines = path_line + store
            if len(hosts) > 1:
                per = hosts[0][1]
                lines = [f"# On each of {', '.join(h for h, _ in hosts)} (run this file on "
                         "every host):"] + lines + [
                    f"torchrun --nnodes {len(hosts)} --nproc-per-node {per} --rdzv-backend c10d "
                    f"--rdzv-endpoint {self._master()}:{port} {here}"]
            else:
                lines = [f"# {os.path.basename(script)} as {n} processes on this machine."] + \
                    lines + [f"torchrun --standalone --nproc-per-node {n} {here}"]
            return _bash(lines)
        if self.launcher == "ssh":
            return self._ssh_loop(path_line + store, script, port)
        return _bash(
            [f"# {os.path.basename(script)} as {n} processes on this machine, as %spmd start "
             f"-n {n} ran them.", "# (MASTER_PORT: rank 0's port, where the others join it)"]
            + path_line + store
            + [f"export WORLD_SIZE={n} MASTER_ADDR=127.0.0.1 MASTER_PORT={port}",
               "pids=()",
               f"for rank in $(seq 0 {n - 1}); do",
               f"  RANK=$rank LOCAL_RANK=$rank python {here} &",
               "  pids+=($!)",
               "done", *_WAIT])

    def _master(self) -> str:
        hosts = self.settings.where.hosts
        return hosts[0][0].rpartition("@")[2] if hosts else "127.0.0.1"

    def _mpi_hosts(self) -> list[str]:
        hosts = self.settings.where.hosts
        args = dict(self.settings.where.launcher_args).get("mpi_args", "")
        spec = ",".join(f"{h.rpartition('@')[2]}:{c}" for h, c in hosts)
        return (["-hosts", spec] if hosts else []) + ([args] if args else [])

    def _ssh_loop(self, before: list[str], script: str, port: str) -> str:
        w, n = self.settings.where, self.settings.n
        user_args = dict(w.launcher_args)
        ssh = shlex.join([*(shlex.split(user_args.get("ssh_cmd", "")) or ["ssh"]),
                          *shlex.split(user_args.get("ssh_args", "")), "-o", "BatchMode=yes"])
        spread = " ".join(f"{h}:{c}" for h, c in w.hosts)
        # There, the process runs beside a watcher of the ssh connection's input: without a
        # terminal, a process whose ssh ended (^C here, or a failed rank) would run on; its
        # input ends with the connection, and the watcher ends it (SIGKILL after 3 s: jax's
        # own SIGTERM handler only notes a preemption). (The watcher reads a copy, fd 4: a
        # background command's own input is /dev/null. The process becomes the shell, $$.)
        remote = ("cd $(printf %q \"$PWD\") || exit; exec 4<&0; "
                  "(cat <&4; kill \\$\\$ && sleep 3 && kill -9 \\$\\$) >/dev/null 2>&1 & "
                  f"RANK=$rank LOCAL_RANK=$local_rank WORLD_SIZE={n} MASTER_ADDR=$MASTER_ADDR "
                  f"MASTER_PORT=$MASTER_PORT exec {shlex.quote(self.python)} "
                  f"{shlex.quote(script)} </dev/null 4<&-")
        return _bash(
            [f"# {os.path.basename(script)} as {n} processes over ssh ({spread}), as %spmd start "
             "placed them.",
             "# Every host needs the script and the Python at the same paths (shared storage)."]
            + before
            + [f"export MASTER_ADDR={self._master()} MASTER_PORT={port}",
               "# (each ssh reads a pipe nobody writes, which ends only with the ssh: a",
               "# background command's own input is /dev/null, which ends at once)",
               'pipe=$(mktemp -u) && mkfifo -m 600 "$pipe" && exec 3<>"$pipe" && rm -f "$pipe"',
               "pids=()",
               "rank=0",
               f"for host_count in {spread}; do",
               "  host=${host_count%:*}",
               "  for ((local_rank = 0; local_rank < ${host_count##*:}; local_rank++)); do",
               f'    {ssh} "$host" "{remote}" <&3 &',
               "    pids+=($!)",
               "    rank=$((rank + 1))",
               "  done",
               "done", *_WAIT])

    def _sbatch(self, before: list[str], script: str) -> str:
        s = self.settings
        name = os.path.basename(script)[:-3]
        options = [f"#SBATCH --job-name={name}", f"#SBATCH --ntasks={s.n}",
                   f"#SBATCH --output={name}-%j.out"]
        if self.gpus:
            options.append(f"#SBATCH --gpus-per-task={self.gpus}")
        # (the cluster's --launcher-arg options are Slurm's own where it ran under Slurm; an
        # ssh or mpi cluster's are not sbatch options)
        for key, value in (s.where.launcher_args if s.where.launcher == "slurm" else ()):
            option = f"#SBATCH --{key}={value}" if value else f"#SBATCH --{key}"
            if option not in options:
                options.append(option)
        lines = ["#!/bin/bash", *options,
                 f"# {name}.py as {s.n} Slurm tasks, as %spmd start --launcher slurm ran them: "
                 f"sbatch {name}.sbatch", *before]
        if "torch" in self.backends:
            lines += ["# rank 0's node and a port, for torch's rendezvous",
                      'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | '
                      "head -n 1)",
                      "export MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))"]
        lines.append(f"srun python {shlex.quote(script)}")
        return "\n".join(lines) + "\n"


# Wait for every process; when one fails, end the others (they would wait for it forever in
# their next collective) and exit with its status.
_WAIT = [
    "trap 'kill \"${pids[@]}\" 2>/dev/null' INT TERM  # (^C: the processes end too)",
    "status=0",
    "for _ in \"${pids[@]}\"; do",
    "  wait -n && continue",
    "  code=$?",
    "  if [ \"$status\" = 0 ]; then status=$code; kill \"${pids[@]}\" 2>/dev/null; fi",
    "done",
    "exit \"$status\"",
]


def _bash(lines: list[str]) -> str:
    return "\n".join(["#!/bin/bash", *lines]) + "\n"


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
    after = lines[last.end_lineno - 1][last.end_col_offset:]  # (a comment, or a ';')
    after = "" if after.strip() in ("", ";") else "  " + after.strip()
    return "\n".join(lines[: last.lineno - 1] + [f"print(repr({expression})){after}"]) + "\n"


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
    job = Job(s, launcher, list(session.ranks), path, keep_failed=opts.cells == "all")
    script, launch = job.script(list(session.ran)), job.launch()
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
    if job.notebook:
        count = len(job.notebook)
        lines.append(f"{count} {'cell reads' if count == 1 else 'cells read'} the notebook's own "
                     f"names, flagged in the script: {', '.join(job.notebook)}.")
    lines += [f"Run it with: {job.command()}", "", launch.rstrip("\n")]
    return "\n".join(lines)


__all__ = ["export", "needs_person", "pushed"]
