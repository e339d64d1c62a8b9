"""The wheel is the product (issue 57): built from this checkout, installed into a new virtual
environment outside it, it gives the SPMD kernel in ``jupyter kernelspec list`` (the wheel's
own data files), ``python -m spmd list``, and the quickstart notebook running in that kernel,
found by its kernelspec's name.

The new environment gets the dependencies without a download: a ``.pth`` file in its
site-packages adds, after its own, a folder of links to this environment's site-packages with
everything of jupyter-spmd left out (its dist-info, the editable install's ``.pth`` that points
at a checkout). So ``import spmd`` there can only find the wheel's copy, which a test proves
from inside that environment. Its processes run from a folder outside the checkout, with
nothing of the user's (a home, Jupyter and IPython folders, a temporary folder of their own),
and every one of them is ended by the module's end (found by a marker in its environment).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import signal
import site
import subprocess
import sys
import tempfile
import uuid
import zipfile
from dataclasses import dataclass
from pathlib import Path

import nbformat
import psutil
import pytest
from test_notebooks import assert_saved_without_empty_outputs

from spmd.demo import cell_text
from spmd.kernel.kernelspec import KERNEL_NAME, kernel_dict

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "notebooks" / "quickstart.ipynb"
SHIPPED = f"share/jupyter/kernels/{KERNEL_NAME}"  # (in the wheel's data, and in the venv)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@dataclass
class Installed:
    wheel: Path
    venv: Path
    home: Path  # the new environment's processes' own HOME, Jupyter folders and TMPDIR
    work: Path  # their working folder, outside the checkout
    env: dict
    marker: str  # in the environment of every process they start

    @property
    def python(self) -> str:
        return str(self.venv / "bin" / "python")

    def run(self, *argv: str, timeout: float = 60):
        """``argv`` run in the new environment (``python`` or one of its scripts first), in
        its own process group, killed whole past ``timeout``."""
        cmd = [self.python, *argv[1:]] if argv[0] == "python" else [
            str(self.venv / "bin" / argv[0]), *argv[1:]]
        proc = subprocess.Popen(cmd, cwd=self.work, env=self.env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            pytest.fail(f"{' '.join(argv)} ran past {timeout} s:\n{out}\n{err}")
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)

    def ok(self, *argv: str, **kwargs) -> str:
        done = self.run(*argv, **kwargs)
        assert done.returncode == 0, (
            f"{' '.join(argv)}: exit status {done.returncode}\n{done.stdout}\n{done.stderr}")
        return done.stdout

    def processes(self) -> list[psutil.Process]:
        """The live processes that the new environment's commands started, wherever they
        were reparented."""
        found = []
        for proc in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if (proc.environ().get("SPMD_WHEEL_TEST") == self.marker
                        and proc.status() != psutil.STATUS_ZOMBIE):
                    found.append(proc)
        return found


def _build(dist: Path) -> Path:
    """The wheel, built from the checkout as ``pip wheel .`` builds it: with this environment's
    hatchling where it has one (the test extra), so that no network is needed."""
    own_backend = ["--no-build-isolation"] if importlib.util.find_spec("hatchling") else []
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", *own_backend,
                    str(ROOT), "-w", str(dist)], check=True, cwd=dist, timeout=120)
    (wheel,) = dist.glob("jupyter_spmd-*.whl")
    return wheel


def _ours(folder: Path) -> set[str]:
    """The top-level entries of the site-packages ``folder`` that are jupyter-spmd's: its
    dist-info, its package, an editable install's ``.pth`` (which puts a checkout on
    sys.path)."""
    names = set()
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        for file in importlib.metadata.distribution("jupyter-spmd").files or []:
            if file.parts and file.parts[0] != ".." and (folder / file.parts[0]).exists():
                names.add(file.parts[0])
    for entry in folder.iterdir():
        if (entry.name == "spmd" or entry.name.startswith(("jupyter_spmd-", "__editable__"))
                or (entry.suffix == ".pth" and "spmd" in entry.name)):
            names.add(entry.name)
    return names


def _dependencies(view: Path) -> list[Path]:
    """A folder of links for each of this environment's site-packages, less jupyter-spmd."""
    folders = []
    for i, where in enumerate(dict.fromkeys(site.getsitepackages())):
        where = Path(where)
        if not where.is_dir():
            continue
        folder = view / str(i)
        folder.mkdir(parents=True)
        skip = _ours(where)
        for entry in where.iterdir():
            if entry.name not in skip and entry.name != "__pycache__":
                (folder / entry.name).symlink_to(entry)
        folders.append(folder)
    return folders


def _venv(venv: Path, dependencies: list[Path]) -> None:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=60)
    (own,) = venv.glob("lib/python*/site-packages")
    # (after the environment's own site-packages; their .pth files run too, less ours)
    (own / "_spmd_test_dependencies.pth").write_text(
        "".join(f"import site; site.addsitedir({str(f)!r})\n" for f in dependencies))


def _scripts(venv: Path, dists: tuple[str, ...] = ("jupyter_core", "jupyter_client")) -> None:
    """The console scripts of ``dists`` (``jupyter``, ``jupyter-kernelspec``...) in the new
    environment's bin/, as installing them there would write them."""
    for name in dists:
        for ep in importlib.metadata.distribution(name).entry_points:
            if ep.group != "console_scripts":
                continue
            module, _, attr = ep.value.partition(":")
            script = venv / "bin" / ep.name
            script.write_text(f"#!{venv / 'bin' / 'python'}\nimport sys\nfrom {module} import "
                              f"{attr.split('.')[0]}\nsys.exit({attr}())\n")
            script.chmod(0o755)


@pytest.fixture(scope="module")
def installed():
    top = Path(tempfile.mkdtemp(prefix="spmd-wheel-"))
    assert not top.resolve().is_relative_to(ROOT)
    marker = uuid.uuid4().hex
    it = None
    try:
        (top / "dist").mkdir()
        wheel = _build(top / "dist")
        venv = top / "venv"
        _venv(venv, _dependencies(top / "dependencies"))
        _scripts(venv)
        home = top / "home"
        for sub in ("jupyter-data", "jupyter-config", "jupyter-runtime", "ipython", "tmp"):
            (home / sub).mkdir(parents=True)
        work = top / "work"
        work.mkdir()
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("PYTHON", "JUPYTER_", "VIRTUAL_ENV", "IPYTHON"))}
        path = [p for p in os.environ.get("PATH", "").split(os.pathsep)
                if p and not Path(p).resolve().is_relative_to(ROOT)
                and Path(p).resolve() != Path(sys.executable).parent.resolve()]
        env.update(
            PATH=os.pathsep.join([str(venv / "bin"), *path]), VIRTUAL_ENV=str(venv),
            HOME=str(home), PYTHONNOUSERSITE="1", TMPDIR=str(home / "tmp"),
            JUPYTER_DATA_DIR=str(home / "jupyter-data"),
            JUPYTER_CONFIG_DIR=str(home / "jupyter-config"),
            JUPYTER_RUNTIME_DIR=str(home / "jupyter-runtime"), IPYTHONDIR=str(home / "ipython"),
            SPMD_WHEEL_TEST=marker,
        )
        it = Installed(wheel, venv, home, work, env, marker)
        # pip resolves the wheel's requirements against the environment (all found there,
        # through the links: --no-index, nothing fetched) and installs it with its data files
        it.ok("python", "-m", "pip", "install", "--no-index", "--quiet", str(wheel), timeout=120)
        yield it
    finally:
        if it is not None:
            for proc in it.processes():  # (the quickstart's test says whether any were left)
                with contextlib.suppress(psutil.Error):
                    proc.kill()
        shutil.rmtree(top, ignore_errors=True)


def test_the_wheel_ships_the_kernelspec_and_the_license(installed):
    with zipfile.ZipFile(installed.wheel) as whl:
        names = whl.namelist()
        data = next(n.split("/data/")[0] for n in names if ".data/data/" in n)
        spec = json.loads(whl.read(f"{data}/data/{SHIPPED}/kernel.json"))
        metadata = whl.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        license_file = whl.read(next(n for n in names if n.endswith(".dist-info/licenses/LICENSE")))
    # python -m spmd.kernel install's spec, with the environment's own python (as ipykernel's)
    assert spec == {**kernel_dict(executable="python"), "kernel_protocol_version": spec.get(
        "kernel_protocol_version")}
    assert spec["argv"][:3] == ["python", "-m", "spmd.kernel.app"]
    assert {f"{data}/data/{SHIPPED}/{logo}" for logo in
            ("logo-32x32.png", "logo-64x64.png", "logo-svg.svg")} <= set(names)
    assert "License-Expression: BSD-3-Clause" in metadata.splitlines()
    # the long description: README.md with its relative links as words (hatch_build.py), as
    # PyPI shows it with no checkout beside it
    description = metadata.split("\n\n", 1)[1]
    assert "Description-Content-Type: text/markdown" in metadata.splitlines()
    assert description.startswith("# jupyter-spmd\n")
    assert "](docs/" not in description
    assert "Install (docs/getting-started/install.md in the source) says how" in description
    assert "(an image, docs/screenshots/failing-rank.png in the source)" in description
    assert "%spmd start -n 4 [-d K] [--backend" in description  # (a code block, as it is)
    assert license_file == (ROOT / "LICENSE").read_bytes()
    assert b"BSD 3-Clause License" in license_file
    assert not [n for n in names if n.startswith(("tests/", "notebooks/", "docs/", "benchmarks/",
                                                  "spmd/labextension/", "labextension/"))]
    assert f"{data}/data/share/jupyter/labextensions/jupyter-spmd/package.json" in names


def test_spmd_there_is_the_wheels_copy_not_the_checkouts(installed):
    shown = json.loads(installed.ok("python", "-c", """if 1:
        import importlib.metadata, importlib.util, json, sys
        import spmd
        dists = [d for d in importlib.metadata.distributions()
                 if d.metadata["Name"] == "jupyter-spmd"]
        print(json.dumps({
            "spmd": spmd.__file__, "prefix": sys.prefix, "path": sys.path,
            "dists": [str(d.locate_file("")) for d in dists],
            "installer": dists[0].read_text("INSTALLER") if dists else None,
        }))
        """))
    own = next(p for p in shown["path"] if p.endswith("site-packages")
               and Path(p).resolve().is_relative_to(installed.venv.resolve()))
    assert Path(shown["prefix"]).resolve() == installed.venv.resolve()
    assert Path(shown["spmd"]).resolve() == (Path(own) / "spmd" / "__init__.py").resolve()
    assert [Path(d).resolve() for d in shown["dists"]] == [Path(own).resolve()]
    assert shown["installer"].strip() == "pip"
    # nothing on its sys.path is in the checkout, or holds another spmd package
    for entry in shown["path"]:
        assert not Path(entry or installed.work).resolve().is_relative_to(ROOT), entry
        if entry != own:
            assert not (Path(entry or installed.work) / "spmd").exists(), entry


def _kernelspecs(installed) -> dict[str, str]:
    """``jupyter kernelspec list`` in the new environment, as {name: folder}."""
    out = installed.ok("jupyter", "kernelspec", "list")
    return dict(line.split() for line in out.splitlines()[1:] if line.strip())


def test_jupyter_kernelspec_list_shows_the_spmd_kernel_from_the_wheel(installed):
    specs = _kernelspecs(installed)
    assert Path(specs[KERNEL_NAME]) == installed.venv / SHIPPED, specs
    listed = installed.ok("python", "-m", "spmd.kernel", "list")
    assert f"{KERNEL_NAME}  Python 3 (SPMD, 4 processes)  {installed.venv / SHIPPED}" in listed
    # Jupyter starts it with the environment's own python (the server's, run from it)
    argv = json.loads(installed.ok("python", "-c", """if 1:
        import json
        from jupyter_client.manager import KernelManager
        km = KernelManager(kernel_name="spmd")
        print(json.dumps(km.format_kernel_cmd()))
        """))
    assert argv[:3] == [str(installed.venv / "bin" / "python"), "-m", "spmd.kernel.app"]


def test_python_m_spmd_kernel_install_still_sets_the_kernels_options(installed):
    shipped = installed.venv / SHIPPED
    kept = installed.home / "shipped-spec"
    shutil.copytree(shipped, kept)
    try:
        # over the wheel's spec, in the environment (where Jupyter looks first in a venv)
        said = installed.ok("python", "-m", "spmd.kernel", "install", "--sys-prefix", "-n", "2",
                            "--display-name", "SPMD, two")
        assert said == f"Installed kernelspec {KERNEL_NAME} in {shipped}\n"
        assert Path(_kernelspecs(installed)[KERNEL_NAME]) == shipped
        spec = json.loads((shipped / "kernel.json").read_text())
        assert spec["display_name"] == "SPMD, two" and "--SpmdKernel.processes=2" in spec["argv"]
        assert spec["argv"][0] == str(installed.venv / "bin" / "python")
    finally:
        shutil.rmtree(shipped)
        shutil.copytree(kept, shipped)
    # for the user: what a JupyterLab of another environment finds; this environment's own
    # spec of that name comes first here, and the command says so
    done = installed.run("python", "-m", "spmd.kernel", "install", "--user", "-n", "2")
    mine = installed.home / "jupyter-data" / "kernels" / KERNEL_NAME
    assert done.returncode == 0 and done.stdout == (
        f"Installed kernelspec {KERNEL_NAME} in {mine}\n"), done.stderr
    assert done.stderr == (
        f"Note: a Jupyter run from this Python finds the kernelspec {KERNEL_NAME} in {shipped} "
        "first, and starts that one (a Jupyter of another environment finds this one): to "
        "change what it starts, install with --sys-prefix, or with another --name for a second "
        "kernel.\n")
    shutil.rmtree(mine)
    assert Path(_kernelspecs(installed)[KERNEL_NAME]) == shipped


def test_jupyterlab_there_finds_the_ranks_sidebar_the_wheel_installed(installed):
    done = installed.run("python", "-m", "jupyterlab.labextensions", "list", timeout=60)
    said = done.stdout + done.stderr
    assert done.returncode == 0, said
    # (listed under the new environment's own folder, from the wheel's data files)
    where = said.split(f"{installed.venv}/share/jupyter/labextensions", 1)
    assert len(where) == 2, said
    first = where[1].strip().splitlines()[0]
    assert first.startswith("jupyter-spmd v0.1.0") and "enabled" in first and "OK" in first, said


def test_python_m_spmd_list_and_stop_run(installed):
    assert installed.ok("python", "-m", "spmd", "list") == "No cluster of this user runs.\n"
    assert installed.ok("python", "-m", "spmd", "stop", "--all") == ""


# The quickstart as the docs show it, in the SPMD kernel: its `%load_ext spmd` does nothing
# there (the kernel has the magics loaded), and it runs with 2 ranks instead of 4 (each with
# its 2 devices). The kernelspec found by its name is told the same count (as `python -m
# spmd.kernel install -n 2 -d 2` writes it), so that the notebook's start takes the kernel's
# own start.
LOAD = "%load_ext spmd"
START = "%spmd start -n 4 --devices-per-process 2"
RUN = """if 1:
    import sys
    import nbformat
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient
    path, out, *settings = sys.argv[1:]
    nb = nbformat.read(path, as_version=4)
    km = KernelManager(kernel_name=nb.metadata.kernelspec.name)
    spec = km.kernel_spec
    print(spec.resource_dir, spec.argv[0], flush=True)
    names = {s.partition("=")[0] for s in settings}
    spec.argv = [a for a in spec.argv if a.partition("=")[0] not in names] + settings
    client = NotebookClient(nb, km=km, timeout=120, resources={"metadata": {"path": "."}})
    try:
        client.execute()
    finally:
        nbformat.write(nb, out)
    """
WHERE = "import sys, spmd\nprint(sys.executable, spmd.__file__)"


def test_the_quickstart_runs_in_the_spmd_kernel_found_by_its_name(installed):
    nb = nbformat.read(QUICKSTART, as_version=4)
    sources = [c.source for c in nb.cells if c.cell_type == "code"]
    assert sources[:2] == [LOAD, START], "the quickstart's start changed: change this test too"
    for cell in nb.cells:
        if cell.source == START:
            cell.source = START.replace("-n 4", "-n 2")
    stop = [c.source for c in nb.cells].index("%spmd stop")
    # which Python and which spmd: the kernel's own (%%local), and the ranks'
    nb.cells[stop:stop] = [nbformat.v4.new_code_cell(f"%%local\n{WHERE}"),
                           nbformat.v4.new_code_cell(WHERE)]
    nb.metadata.kernelspec = {"name": KERNEL_NAME, "display_name": "Python 3 (SPMD)",
                              "language": "python"}
    nbformat.write(nb, installed.work / "quickstart.ipynb")
    # (no linger: a kernel that died here leaves no ranks behind for minutes)
    done = installed.run(
        "python", "-c", RUN, "quickstart.ipynb", "executed.ipynb",
        "--SpmdKernel.processes=2", "--SpmdKernel.devices_per_process=2",
        "--SpmdKernel.cluster=--linger 0", timeout=200)
    ran = installed.work / "executed.ipynb"
    assert done.returncode == 0, done.stderr[-4000:] + "\n" + (
        "\n".join(f"{c.source}\n-> {cell_text(c)}" for c in nbformat.read(ran, 4).cells
                  if c.cell_type == "code") if ran.exists() else "")
    # the wheel's kernelspec, found by its name, its bare python the environment's
    assert done.stdout.startswith(f"{installed.venv / SHIPPED} python\n"), done.stdout
    nb = nbformat.read(ran, as_version=4)
    assert_saved_without_empty_outputs(nb)
    shown = {c.source: cell_text(c) for c in nb.cells if c.cell_type == "code"}
    assert shown[LOAD] == "", shown
    # the kernel's own start, taken by the notebook's: its summary, once
    start = shown[START.replace("-n 4", "-n 2")]
    assert start.startswith(
        "Started 2 processes, 2 devices per process, 4 global devices (jax) in "), shown
    assert start.count("Started") == 1, start
    assert shown["import jax\nprint(jax.device_count(), jax.local_device_count())"] == (
        "[ranks 0-1] 4 2\n")
    assert shown["print(jax.process_index())"] == "[rank 0] 0\n[rank 1] 1\n"
    psum = next(v for k, v in shown.items() if "psum" in k)
    assert psum == "Array([4., 4.], dtype=float32)\n"
    assert shown["%spmd stop"].startswith("Stopped 2 processes in ")
    # the kernel and its ranks ran the new environment's python and the wheel's spmd
    python, spmd = installed.venv / "bin" / "python", next(installed.venv.glob(
        "lib/python*/site-packages/spmd/__init__.py"))
    assert shown[f"%%local\n{WHERE}"] == f"{python} {spmd}\n"
    assert shown[WHERE] == f"[ranks 0-1] {python} {spmd}\n"
    # and every process it started has ended with the kernel
    left = [p for p in installed.processes() if p.is_running()]
    _, alive = psutil.wait_procs(left, timeout=10)
    assert not alive, [" ".join(p.cmdline()) for p in alive]
