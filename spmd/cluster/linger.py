"""A cluster that outlives a notebook process that died, for a while (its linger), and the
record through which a new notebook process attaches to it.

When the notebook's process is killed (out of memory, a crash in a C extension, a kernel
killed by mistake), the ranks keep what they hold: each process watches the cluster folder's
owner file (engine/life/orphans.py) and ends once no live notebook process has held the cluster for
the whole linger. A clean stop, a kernel shutdown and a user's kernel restart still end the
ranks at once.

The record is one JSON file per cluster in the user's Jupyter runtime folder (where Jupyter
keeps its kernels' connection files: readable by that user alone; each file is made 0600):
enough to find the processes again by pid, to connect a new client with the cluster's key, and
to rebuild the rank table. It is written at start and restart, and removed at stop and, by the
controller, when the linger is over. A record whose controller is gone is removed, not trusted.

Clusters on this machine linger, and on ssh hosts where a rank server forks the ranks: each
host's server outlives its ssh connection while it has ranks, and the ranks outlive it while
their controller (on this machine) runs. mpiexec's and srun's ranks end with their client, and
ssh's without a server with their connection: those end as before, and ``--linger`` says so.

Threads: the main thread writes, reads and removes records (start, restart, stop, attach);
the SPMD kernel's background start writes the record of the cluster it started.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import re
import socket
import tempfile
import time
from dataclasses import dataclass, field

from spmd.cluster.launchers import profiles, remote
from spmd.cluster.records import Rank, Settings
from spmd.engine.life.orphans import GONE_FILE, folder_lock, read_owner, runs, started_at

RECORD_PREFIX = "spmd-cluster-"
DEFAULT_LINGER = Settings.linger  # seconds (10m)
# How long an attach waits for the cluster folder's lock, which a process whose linger ended
# holds while it ends (a moment).
LOCK_SECONDS = 15.0
# The notebook's path, as Jupyter gives it to the kernel of that notebook.
NOTEBOOK_ENV = "JPY_SESSION_NAME"


class AttachError(RuntimeError):
    """The cluster could not be attached; nothing was changed. The text says why."""


def parse_duration(text: str) -> float:
    """Seconds in ``10m``, ``20s``, ``1h``, ``90`` or ``0``; ValueError otherwise."""
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(s|m|h)?\s*", str(text))
    if not found:
        raise ValueError(text)
    return float(found.group(1)) * {"s": 1, "m": 60, "h": 3600, None: 1}[found.group(2)]


def words(seconds: float) -> str:
    """``10m``, ``20s``, ``1h30m``: a duration as --linger takes it."""
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    said = (f"{hours}h" if hours else "") + (f"{minutes}m" if minutes else "")
    return said + (f"{secs}s" if secs or not said else "")


def why_not(settings: Settings) -> str:
    """Why this cluster cannot linger ('' when it can)."""
    launcher = settings.where.launcher
    if launcher == "local" or (launcher == "ssh" and settings.rank_server):
        return ""
    if launcher == "ssh":
        return "ranks on ssh hosts started without a rank server end with their ssh connection"
    return f"{launcher}'s ranks end with their {'mpiexec' if launcher == 'mpi' else 'srun'}"


def lingers(settings: Settings) -> bool:
    return settings.linger > 0 and not why_not(settings)


def records_dir() -> str:
    from jupyter_core.paths import jupyter_runtime_dir

    path = jupyter_runtime_dir()
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def this_notebook() -> str:
    return os.environ.get(NOTEBOOK_ENV, "")


@dataclass
class Record:
    """One cluster, as a new notebook process needs it to attach."""

    id: str
    pid: int  # the notebook process that started it
    notebook: str  # its notebook's path ('' where Jupyter did not say)
    started: float  # time.time()
    linger: float
    settings: dict
    profile_dir: str
    cache_dir: str | None
    cluster_id: str
    controller: dict  # ipyparallel's launcher state (its pid)
    controller_started: float  # its process's start (orphans.started_at: a pid is reused)
    engine_set: str
    engines: dict  # ipyparallel's engine set state (each rank's pid)
    rank_server: int  # its pid (0: none)
    ranks: list[dict] = field(default_factory=list)
    address: str = remote.LOOPBACK
    hash_seed: str = ""
    coordinator: str = ""
    torch_method: str = ""
    versions: dict = field(default_factory=dict)
    host: str = ""  # the machine it runs on (a home folder may be shared with others)
    # When each process it lists by pid started (orphans.started_at), by pid: the rank
    # server's and each rank's on this machine, so that a pid reused is never taken for them.
    started_at: dict = field(default_factory=dict)

    @property
    def path(self) -> str:
        return os.path.join(records_dir(), f"{RECORD_PREFIX}{self.id}.json")

    @property
    def owner_file(self) -> str:
        return os.path.join(self.profile_dir, profiles.OWNER_FILE)

    def n(self) -> int:
        return int(self.settings["n"])

    def backend(self) -> str:
        return str(self.settings["backend"])

    def controller_pid(self) -> int:
        return int(self.controller.get("pid") or 0)

    def held_by(self) -> int:
        """The live notebook process that holds the cluster now (0: none)."""
        from spmd.engine.life.orphans import owner_alive, owner_pid

        return owner_pid(self.owner_file) if owner_alive(self.owner_file) else 0

    def alive(self) -> bool:
        """Whether its controller still runs (the same process)."""
        return runs({"pid": self.controller_pid(), "started": self.controller_started})

    def runs_here(self) -> bool:
        return self.host == socket.gethostname()

    def the_settings(self) -> Settings:
        """The settings it was started with; AttachError where another version wrote them."""
        try:
            return self._settings()
        except (KeyError, TypeError, ValueError):
            raise AttachError(
                f"Cluster {self.id} was started by another version of jupyter-spmd: end it with "
                f"python -m spmd stop {self.id}.") from None

    def _settings(self) -> Settings:
        values = dict(self.settings)
        where = values.pop("where")
        placed = remote.Placement(
            launcher=where["launcher"],
            hosts=tuple(tuple(h) for h in where["hosts"]),
            launcher_args=tuple(tuple(a) for a in where["launcher_args"]),
            python=where["python"],
        )
        values["preload"] = tuple(values.get("preload", ()))
        return Settings(**values, where=placed)

    def rows(self) -> list[Rank]:
        return [Rank(**row) for row in self.ranks]


def versions() -> dict:
    """What must match for a notebook to attach: this project's and jax's versions."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("jupyter-spmd", "jax"):
        with contextlib.suppress(PackageNotFoundError):
            found[name] = version(name)
    return found


def write(record: Record) -> None:
    """Write (or replace) the record, readable by this user only."""
    folder = records_dir()
    fd, partial = tempfile.mkstemp(dir=folder, prefix=f".{RECORD_PREFIX}")  # (0600)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(dataclasses.asdict(record), f)
        os.replace(partial, record.path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(partial)
        raise


def remove(record: Record | None) -> None:
    if record is not None:
        with contextlib.suppress(OSError):
            os.remove(record.path)


def read(path: str) -> Record | None:
    """The record at ``path``; None where it is not one, or not this user's own (another
    user's file, or one others may read or write, is not trusted)."""
    try:
        with open(path) as f:
            facts = os.fstat(f.fileno())
            if facts.st_uid != os.getuid() or facts.st_mode & 0o077:
                return None
            return Record(**json.load(f))
    except (OSError, ValueError, TypeError):
        return None


def every() -> list[Record]:
    """This user's clusters that still run, oldest first; records of clusters that are gone
    are removed."""
    found = []
    folder = records_dir()
    for name in sorted(os.listdir(folder)):
        if not (name.startswith(RECORD_PREFIX) and name.endswith(".json")):
            continue
        record = read(os.path.join(folder, name))
        if record is None or not record.runs_here():  # (another machine's: not ours to judge)
            continue
        if not record.alive():
            remove(record)
            continue
        found.append(record)
    return sorted(found, key=lambda r: r.started)


def lingering(records: list[Record] | None = None) -> list[Record]:
    """The clusters no live notebook process holds."""
    return [r for r in (every() if records is None else records) if not r.held_by()]


def mine() -> Record | None:
    """The lingering cluster this notebook left (by its path), or None."""
    notebook = this_notebook()
    if not notebook:
        return None
    try:
        return next((r for r in lingering() if r.notebook == notebook), None)
    except OSError:  # (no runtime folder to read: nothing lingers)
        return None


def ends_in(record: Record) -> str:
    """How long until a lingering cluster ends, in words: from when its controller found the
    notebook gone (orphans.note_gone; approximate: each process keeps its own clock from
    when it found that). Before the controller has looked (a second), the whole linger."""
    if record.held_by():
        return "held"
    gone = min(time.time(), gone_at(record) or time.time())
    return words(max(0.0, gone + record.linger - time.time()))


def gone_at(record: Record) -> float | None:
    """When the cluster's controller found its notebook gone (time.time(); orphans.note_gone),
    or None: it has not (or a notebook holds it)."""
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        with open(os.path.join(record.profile_dir, GONE_FILE)) as f:
            return float(json.load(f)["at"])
    return None


def table(records: list[Record]) -> str:
    """The clusters as ``%spmd attach`` and ``python -m spmd list`` show them."""
    rows = [("ID", "RANKS", "HOSTS", "BACKEND", "NOTEBOOK", "SINCE", "ENDS IN")]
    for r in records:
        hosts = ",".join(h for h, _ in r.settings["where"]["hosts"]) or "this machine"
        since = time.strftime("%H:%M:%S", time.localtime(r.started))
        rows.append((r.id, str(r.n()), hosts, r.backend(), r.notebook or "-", since,
                     f"held by process {r.held_by()}" if r.held_by() else ends_in(r)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)


def choose(wanted: str = "") -> Record:
    """The cluster ``%spmd attach [ID]`` means; AttachError (one sentence) otherwise."""
    records = every()
    if wanted:
        for record in records:
            if record.id == wanted:
                return record
        known = ", ".join(r.id for r in records)
        raise AttachError(
            f"No cluster has the id {wanted!r}"
            + (f": this user's are {known}." if known else ", and none of this user's runs.")
        )
    free = lingering(records)
    mine = [r for r in free if r.notebook and r.notebook == this_notebook()]
    if len(mine) == 1:
        return mine[0]
    if len(free) == 1:
        return free[0]
    if not free:
        held = f" ({len(records)} held by a running notebook)" if records else ""
        raise AttachError(f"No cluster is lingering to attach{held}: start one with %spmd start.")
    raise AttachError(
        "Several clusters linger; pick one with %spmd attach ID:\n" + table(free)
    )


@contextlib.contextmanager
def taken(record: Record):
    """Hold the record's lock while this process makes the cluster its own: a second notebook
    attaching at the same moment waits, then finds it held (``take``)."""
    try:
        lock = open(record.path)
    except OSError:
        raise AttachError(f"Cluster {record.id} has ended: start one with %spmd start.") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def check(record: Record) -> None:
    """AttachError if another live notebook process holds the cluster, if it ended, or if
    it runs other versions."""
    if not record.alive() or read(record.path) is None:
        raise AttachError(f"Cluster {record.id} has ended: start one with %spmd start.")
    holder = record.held_by()
    if holder and holder != os.getpid():
        raise AttachError(
            f"Cluster {record.id} is attached to notebook process {holder}: stop it there, "
            "or end that kernel first."
        )
    mine = versions()
    if record.versions != mine:
        said = ", ".join(f"{k} {v}" for k, v in sorted(record.versions.items()))
        raise AttachError(
            f"Cluster {record.id} runs {said}, and this notebook has "
            + ", ".join(f"{k} {v}" for k, v in sorted(mine.items()))
            + f": attach from the same environment, or end it with python -m spmd stop {record.id}."
        )


def take(record: Record, still_there=None) -> dict:
    """Make this notebook process the cluster's holder (with ``taken`` held): what its owner
    files said before, for ``give_back``. AttachError as ``check``'s, and where
    ``still_there()`` raises it: it is asked under the folder's lock, before the owner files
    name this process (once they do, the cluster's processes stop counting their linger)."""
    check(record)
    ended = AttachError(f"Cluster {record.id} has ended: start one with %spmd start.")
    # (with the lock its processes end under: one whose linger is over has ended, or it
    # reads this notebook as the holder and stays: orphans.Linger.confirm_over)
    try:
        lock = folder_lock(record.profile_dir, wait=LOCK_SECONDS)
    except TimeoutError:
        raise AttachError(
            f"Cluster {record.id}'s folder stayed locked for {LOCK_SECONDS:g} s by another "
            f"process: try again, or end it with python -m spmd stop {record.id}.") from None
    if lock is None:  # (its linger ended meanwhile: the controller removed its folder)
        raise ended
    before = {}
    try:
        if not record.alive():
            raise ended
        if still_there is not None:
            still_there()
        for folder in (record.profile_dir, record.cache_dir):
            if not folder:  # (no cache: a cluster without jax)
                continue
            # (only the cluster's own folders: a cache the user named has no owner file)
            owner = read_owner(os.path.join(folder, profiles.OWNER_FILE))
            if owner:
                before[folder] = owner
                profiles.mark_owner(folder)
    except BaseException as exc:  # (whatever failed, the cluster is not left held by nobody)
        give_back(record, before)
        if isinstance(exc, AttachError):
            raise
        if isinstance(exc, OSError):  # (the controller removed its folder)
            raise ended from None
        raise
    finally:
        os.close(lock)
    return before


def give_back(record: Record, before: dict) -> None:
    """An attach that failed: the owner files say what they said before, so the cluster's
    linger goes on (or another notebook can attach)."""
    for folder, owner in before.items():
        with contextlib.suppress(OSError):
            profiles.write_owner(folder, owner)


def new_id() -> str:
    return os.urandom(4).hex()


# What the launch and the attach use.


def process_env(settings: Settings, profile_dir: str, controller: bool = False,
                remove: list[str] | None = None) -> dict[str, str]:
    """The environment that makes a cluster's process linger (orphans.Linger); for the
    controller, also what it removes when the linger is over (the cluster's folders, its
    record)."""
    from spmd.engine.life import orphans

    if not lingers(settings):
        return {}
    env = {orphans.LINGER_ENV: repr(settings.linger),
           orphans.OWNER_ENV: os.path.join(profile_dir, profiles.OWNER_FILE)}
    if controller:
        env[orphans.REMOVE_ENV] = os.pathsep.join(p for p in remove or [] if p)
    return env


def record_of(launch, ranks: list[Rank], record_id: str) -> Record:
    """The record of what the launch runs now (after a start or a restart)."""
    cluster, server = launch.cluster, launch.rank_server
    engine_set = cluster.engines[cluster.rank_set]
    # (another host's ranks have no pid here: the controller watches them, and their end is
    # asked on their control channel)
    here = launch.settings.where.launcher == "local"
    controller = cluster.controller.to_dict()
    server_process = getattr(server, "process", None)
    record = Record(
        id=record_id, pid=os.getpid(), notebook=this_notebook(), started=time.time(),
        linger=launch.settings.linger, settings=dataclasses.asdict(launch.settings),
        profile_dir=launch.profile_dir, cache_dir=launch.cache_dir,
        cluster_id=cluster.cluster_id, controller=controller,
        controller_started=started_at(controller["pid"]),
        engine_set=cluster.rank_set,
        engines=json.loads(json.dumps(engine_set.to_dict())) if here else {},
        rank_server=(getattr(server_process, "pid", 0) or 0) if here else 0,
        ranks=[dataclasses.asdict(r) for r in ranks], address=launch.address,
        hash_seed=launch.hash_seed, coordinator=launch.coordinator,
        torch_method=launch.torch_method, versions=versions(), host=socket.gethostname(),
    )
    pids = [record.rank_server] + [int(e.get("pid") or 0)
                                   for e in record.engines.get("engines", {}).values()]
    record.started_at = {str(pid): started_at(pid) for pid in pids if pid}
    return record


def disarm(launch) -> None:
    """A stop has begun: the cluster no longer lingers (its processes end with this notebook
    process, should it be killed before the stop has finished: a kernel that its manager
    kills when its shutdown takes too long), and its record goes."""
    with contextlib.suppress(OSError):
        os.remove(launch.record_path())
    if not launch.linger_env or not launch.profile_dir:
        return
    path = os.path.join(launch.profile_dir, profiles.OWNER_FILE)
    owner = read_owner(path)
    if owner.pop("keeper", None) is not None:
        with contextlib.suppress(OSError):
            profiles.write_owner(launch.profile_dir, owner)


def keep(launch, ranks: list[Rank]) -> None:
    """Write the record of what the launch runs (where it lingers), and mark its folders as
    kept by its controller while no notebook holds them (a later start leaves them alone)."""
    if not launch.linger_env:
        return
    record = record_of(launch, ranks, launch.record_id)
    write(record)
    for folder in (record.profile_dir, record.cache_dir):
        if folder and folder != launch.settings.cache_dir and os.path.isdir(folder):
            profiles.mark_owner(folder, keeper=record.controller_pid())
