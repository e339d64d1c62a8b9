"""Reading the options of ``%spmd start``, ``%%spmd``, ``%spmd log`` and ``%spmd gather``:
each bad value is a UsageError with one sentence that says what to do."""

from __future__ import annotations

import argparse
import functools
import math
import os
import re
import shlex

from IPython.core.error import UsageError
from IPython.core.magic_arguments import MagicArgumentParser
from traitlets.config import Config

from spmd import options
from spmd.cluster import linger
from spmd.cluster.launchers import remote
from spmd.cluster.session import Settings
from spmd.options import count


def _words(what: str, text: str) -> list[str]:
    """Shell words, as the options are written; a quote left open is a UsageError."""
    try:
        return shlex.split(text)
    except ValueError as exc:  # shlex says "No closing quotation"
        raise UsageError(
            f"{what.strip()}: {str(exc).lower()}: close the quote, or leave the quotes out."
        ) from None


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"a timeout is a number of seconds above 0, not {text!r}")
    return value


def _linger(text: str) -> float:
    try:
        return linger.parse_duration(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"a linger is a duration like 10m, 30s or 1h (0: none), not {text!r}") from None


def _grace(text: str) -> float:
    """Seconds, or 'off' (0 and 'off' turn the divergence watchdog off)."""
    if text.lower() in ("off", "none", "0"):
        return 0.0
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"--grace takes seconds (like 2) or off, not {text!r}")
    return value


def _ranks(text: str) -> list[int]:
    try:
        ranks = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        ranks = []
    if not ranks or ranks[0] < 0:
        raise argparse.ArgumentTypeError(f"--ranks takes rank numbers like 0,2, not {text!r}")
    return ranks


class _Parser(MagicArgumentParser):
    """argparse that raises UsageError with one sentence that says what to do."""

    def error(self, message: str):
        raise UsageError(f"{self.prog}: {message}. See %spmd? for the options.")


@functools.cache
def _start_parser() -> _Parser:
    p = _Parser(prog="%spmd start", add_help=False)
    # (required, but inside a Slurm allocation: see start_settings)
    p.add_argument("-n", "--processes", type=count("-n", "-n 4"), default=None)
    p.add_argument("-d", "--devices-per-process", type=count("--devices-per-process", "-d 2"))
    p.add_argument("--backend", type=options.backend, default="jax")
    p.add_argument("--torch-backend", choices=options.TORCH_BACKENDS, default=None)
    p.add_argument("--init-method", type=options.init_method, default=None)
    p.add_argument("--check-collectives", action="store_true")
    p.add_argument("--timeout", type=_seconds, default=None)
    p.add_argument("--grace", type=_grace, default=Settings.grace)
    p.add_argument("--start-timeout", type=_seconds, default=Settings.start_timeout)
    p.add_argument("--hosts", default="")
    p.add_argument("--launcher", choices=remote.LAUNCHERS, default=None)
    p.add_argument("--launcher-arg", type=_key_value, action="append", default=[])
    p.add_argument("--python", default="")
    p.add_argument("--gpus-per-process", type=_gpus, default=None)
    p.add_argument("--no-curve", action="store_true")
    p.add_argument("--compilation-cache", default=None)
    p.add_argument("--preload", type=_modules, default=())
    p.add_argument("--rank-server", choices=("on", "off"), default="on")
    p.add_argument("--max-output", type=_max_output, default=Settings.max_output)
    p.add_argument("--panel", action="store_true")
    p.add_argument("--tabs", action="store_true")
    p.add_argument("--breakpoint", choices=BREAKPOINTS, default="lowest")
    p.add_argument("--linger", type=_linger, default=None)
    return p


# breakpoint() on the ranks: one rank stops (the first to reach one; of those that reach it
# within 50 ms, the lowest), or every rank
BREAKPOINTS = ("lowest", "all")


def start_settings(args: list[str], make_folders: bool = True):
    """(the parsed options, the cluster's Settings) of ``%spmd start ARGS``; UsageError, in
    one sentence, for options that cannot be used. ``make_folders`` False: a
    --compilation-cache folder is named, not made (a kernelspec's install)."""
    opts = _start_parser().parse_args(args)
    if opts.processes is None:
        # inside a Slurm allocation, --launcher slurm takes its task count
        tasks = os.environ.get("SLURM_NTASKS", "") if (
            opts.launcher == "slurm" and remote.in_allocation()
        ) else ""
        if not tasks.isdigit() or int(tasks) < 1:
            raise UsageError(
                "%spmd start: the following arguments are required: -n, like -n 4 (inside a "
                "Slurm allocation, --launcher slurm takes its task count). See %spmd? for "
                "the options."
            )
        opts.processes = int(tasks)
    cache_dir = opts.compilation_cache
    where = _options_checked(opts, _placement(opts))
    # (10m where the ranks can outlive the notebook; elsewhere they end with it, as before)
    lingers = opts.linger if opts.linger is not None else linger.DEFAULT_LINGER
    opts.linger_refused = linger.why_not(
        Settings(n=1, where=where, rank_server=opts.rank_server == "on")) if lingers else ""
    return opts, Settings(
        n=opts.processes,
        cpu_devices=opts.devices_per_process,
        backend=opts.backend,
        torch_backend=opts.torch_backend or Settings.torch_backend,
        init_method=opts.init_method or Settings.init_method,
        cell_timeout=opts.timeout,
        grace=opts.grace or None,
        where=where,
        gpus_per_process=opts.gpus_per_process,
        curve=not opts.no_curve,
        start_timeout=opts.start_timeout,
        cache_dir=_cache_folder(cache_dir) if make_folders else cache_dir,
        max_output=opts.max_output,
        preload=opts.preload,
        rank_server=opts.rank_server == "on",
        check_collectives=opts.check_collectives,
        linger=0.0 if opts.linger_refused else lingers,
    )


def _max_output(text: str) -> int | None:
    """Lines per rank and cell, or 'all'."""
    if text.lower() == "all":
        return None
    return count("--max-output", "--max-output 1000 (or all)")(text)


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(
            f"--launcher-arg takes KEY=VALUE, like partition=gpu, not {text!r}"
        )
    return key.strip(), value


def _modules(text: str) -> tuple[str, ...]:
    """--preload: module names, comma-separated."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    if not names or not all(re.fullmatch(r"[A-Za-z_][\w.]*", name) for name in names):
        raise argparse.ArgumentTypeError(
            f"--preload takes module names separated by commas, like flax,optax, not {text!r}"
        )
    return names


def _gpus(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(
            f"--gpus-per-process takes a whole number (0 hides the GPUs), not {text!r}"
        )
    return int(text)


def _cache_folder(path: str | None) -> str | None:
    """--compilation-cache: the folder, made if missing; UsageError where it cannot be."""
    if path is None:
        return None
    folder = os.path.abspath(os.path.expanduser(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise UsageError(
            f"%spmd start: --compilation-cache {path} cannot be used ({exc.strerror}): name a "
            "folder you can write to."
        ) from None
    return folder


def _options_checked(opts, where: remote.Placement) -> remote.Placement:
    """``where``, once the torch and preload options agree with the backend and
    launcher."""
    if opts.preload and opts.rank_server == "off":
        raise UsageError(
            "%spmd start: --preload is what the rank server imports, and --rank-server off "
            "starts none: drop one of them."
        )
    if opts.preload and where.launcher not in ("local", "ssh"):
        raise UsageError(
            f"%spmd start: --preload is for ranks forked by a rank server, on this machine or "
            f"over ssh ({where.launcher} starts a Python per rank): drop it, or import the "
            "modules in a cell."
        )
    torch_flag = "--torch-backend" if opts.torch_backend else "--init-method"
    if (opts.torch_backend or opts.init_method) and "torch" not in opts.backend:
        raise UsageError(f"%spmd start: {torch_flag} is for --backend torch: add it.")
    if opts.check_collectives and "torch" not in opts.backend:
        raise UsageError(
            "%spmd start: --check-collectives turns on torch's own check of each collective, "
            "for --backend torch: add it, or drop --check-collectives."
        )
    if opts.torch_backend == "mpi" and where.launcher != "mpi":
        raise UsageError(
            "%spmd start: --torch-backend mpi needs ranks started by mpiexec: add --launcher mpi."
        )
    method = opts.init_method or ""
    if method == "file" and not where.on_this_machine:
        raise UsageError(
            "%spmd start: --init-method file keeps its file in a folder of this machine, which "
            "the other hosts cannot see: give one on a shared file system, like "
            "--init-method file:///shared/spmd-init."
        )
    folder = os.path.dirname(method[len("file://"):])
    if method.startswith("file:///") and where.on_this_machine and not os.path.isdir(folder):
        raise UsageError(
            f"%spmd start: the folder of --init-method {method} does not exist: create it, or "
            "name a file in a folder that does."
        )
    return where


def _placement(opts) -> remote.Placement:
    """Where the ranks of ``%spmd start`` run, from its options; UsageError if they clash."""
    launcher = opts.launcher or ("ssh" if opts.hosts else "local")
    if launcher == "local" and (opts.hosts or opts.launcher_arg):
        flag = "--hosts" if opts.hosts else "--launcher-arg"
        raise UsageError(
            f"%spmd start: {flag} is for ranks on other hosts: add --launcher ssh, mpi or slurm."
        )
    if launcher == "ssh" and not opts.hosts:
        raise UsageError("%spmd start: --launcher ssh needs --hosts, like --hosts node1,node2.")
    if opts.python and launcher in ("local", "mpi") and not opts.hosts:
        if not (os.path.isfile(opts.python) and os.access(opts.python, os.X_OK)):
            raise UsageError(
                f"%spmd start: --python {opts.python} is not a Python interpreter on this "
                "machine: give the path of one, like /usr/bin/python3."
            )
    try:
        hosts = remote.parse_hosts(opts.hosts, opts.processes) if opts.hosts else ()
        placed = remote.Placement(launcher, hosts, tuple(opts.launcher_arg), opts.python)
        if launcher != "local":  # the launcher's settings exist and take these values
            remote.configure(Config(), placed, [], [], {})
    except (remote.HostsError, ValueError) as exc:
        raise UsageError(f"%spmd start: {exc}.") from None
    return placed


@functools.cache  # built once: %%spmd parses its line on every cell
def _cell_parser() -> _Parser:
    p = _Parser(prog="%%spmd", add_help=False)
    p.add_argument("--ranks", type=_ranks, default=None)
    p.add_argument("--timeout", type=_seconds, default=None)
    p.add_argument("--grace", type=_grace, default=None)
    p.add_argument("--max-output", type=_max_output, default=0)
    p.add_argument("--tabs", action="store_true")
    p.add_argument("--panel", action="store_true")
    p.add_argument("--breakpoint", choices=BREAKPOINTS, default=None)
    return p


@functools.cache
def _log_parser() -> _Parser:
    p = _Parser(prog="%spmd log", add_help=False)
    p.add_argument("rank", type=_rank)
    p.add_argument("--tail", type=count("--tail", "--tail 50"), default=None)
    return p


def _rank(text: str) -> int:
    """A rank's number: ASCII digits only ("²".isdigit() is true, and int() refuses it)."""
    if not (text.isascii() and text.isdigit()):
        raise argparse.ArgumentTypeError(f"say which rank by its number, like 1, not {text!r}")
    return int(text)


def _gather_options(text: str) -> tuple[str, str | None, int]:
    """'x[0] -o first --max-bytes 1e6' -> ('x[0]', 'first', 1000000)."""
    name = None
    # (numpy: not for %spmd start, nor a kernel's early start)
    from spmd.magics.arrays import transfers

    max_bytes = transfers.DEFAULT_MAX_BYTES
    if re.search(r"(?:^|\s)-o\s*$", text):
        raise UsageError("-o takes a variable name, like %spmd gather x -o full.")
    if re.search(r"(?:^|\s)--max-bytes\s*$", text):
        raise UsageError("--max-bytes takes a number of bytes, like --max-bytes 1e9.")
    m = re.search(r"(?:^|\s)-o\s+(\S+)", text)
    if m:
        name = m.group(1)
        if not name.isidentifier():
            raise UsageError(f"-o takes a variable name, like -o full, not {name!r}.")
        text = text[: m.start()] + text[m.end() :]
    m = re.search(r"(?:^|\s)--max-bytes\s+(\S+)", text)
    if m:
        try:
            max_bytes = int(float(m.group(1)))
        except (ValueError, OverflowError):  # 'lots', or 1e400 (inf)
            max_bytes = 0
        if max_bytes < 1:
            raise UsageError(f"--max-bytes takes a number of bytes, like 1e9, not {m.group(1)!r}.")
        text = text[: m.start()] + text[m.end() :]
    expr = text.strip()
    if not expr:
        raise UsageError("Say which value: %spmd gather x [-o NAME] [--max-bytes N].")
    return expr, name, max_bytes


