# Two entry points a newcomer needs: `make demo` and `make test` (and `make docs`, the site).
# Each one builds .venv from nothing the first time.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# torch is installed first, pinned to one version, from whatever index pip is set up to use:
# the pin chooses the version, not the build. On an ordinary Linux machine it is PyPI's CUDA
# build (several GB); for a CPU build, put that version in .venv first (from
# https://download.pytorch.org/whl/cpu) and it is kept: docs/getting-started/install.md.
TORCH_VERSION := 2.13.0

.PHONY: demo test docs bench lint clean system labextension

# What the cluster tests need from Debian: sshd for hosts made in network namespaces,
# MPICH's mpiexec, a one-node Slurm, chromium for the browser tests. Installed one by one where
# this runs as root with apt-get (CI): a package this system lacks (Ubuntu has no chromium deb)
# is skipped, and the tests that need it skip and say why; so do they where this is not root.
SYSTEM_PACKAGES := iproute2 openssh-server openssh-client mpich slurm-wlm munge chromium

$(STAMP): pyproject.toml $(wildcard spmd/labextension/package.json)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==$(TORCH_VERSION)
	# (the Ranks sidebar as git keeps it built: make labextension builds it, never pip)
	HATCH_JUPYTER_BUILDER_SKIP_NPM=1 $(BIN)/python -m pip install --quiet -e '.[test,torch]'
	touch $(STAMP)

NOTEBOOKS := quickstart 01-multi-process 02-parallel-programming 03-distributed-initialize \
             04-torch-distributed pitfalls

demo: $(STAMP)
	$(BIN)/python -m spmd.kernel install --sys-prefix
	$(BIN)/python -m spmd.demo $(NOTEBOOKS:%=notebooks/%.ipynb)

# The site, into docs/_build/html: its pages, the reference generated from the code, and the
# notebooks above run at build in their kernels (a notebook that fails fails the build; so
# does any warning). No network: nothing is fetched.
DOCS_STAMP := $(VENV)/.installed-docs

$(DOCS_STAMP): $(STAMP)
	HATCH_JUPYTER_BUILDER_SKIP_NPM=1 $(BIN)/python -m pip install --quiet -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	$(BIN)/python -m spmd.kernel install --sys-prefix
	@start=$$(date +%s); \
	$(BIN)/python -m sphinx -W --keep-going -b html docs docs/_build/html && \
	echo "The site is in docs/_build/html (built in $$(( $$(date +%s) - start )) s)."

# (the docs extra too: tests/test_docs.py builds a one-page site)
# (spmd's bytecode first: where PYTHONDONTWRITEBYTECODE is set, as on CI's machine, every rank
# server, kernel and notebook the tests start would compile spmd's modules again)
test: $(DOCS_STAMP) system
	$(BIN)/python -m compileall -q spmd
	$(BIN)/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder

system:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  missing=$$(for p in $(SYSTEM_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	  if [ -n "$$missing" ]; then \
	    echo "Installing $$missing (apt-get)"; \
	    apt-get update -qq; \
	    for p in $$missing; do \
	      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$p >/dev/null 2>&1 \
	        || echo "  $$p could not be installed here: the tests that need it skip and say why"; \
	    done; \
	  fi; \
	fi

# The closest peer, jupyter-distributed 0.1.1, beside this checkout's packages (a .pth of
# .venv's), for benchmarks/debugger_server.py: made where pip can reach PyPI, and the benchmark
# says so and measures the SPMD kernel alone where it could not be.
PEER_VENV := .venv-peer

$(PEER_VENV)/.installed: $(STAMP)
	-rm -rf $(PEER_VENV) && $(BIN)/python -m venv $(PEER_VENV) && \
	  $(BIN)/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" \
	    > "$$($(PEER_VENV)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/spmd-venv.pth" && \
	  $(PEER_VENV)/bin/python -m pip install --quiet --no-deps jupyter-distributed==0.1.1 && \
	  touch $@

# ... then writes the new figures into the pages that quote them (docs/_ext/spmd_docs/figures.py)
bench: $(STAMP) $(PEER_VENV)/.installed
	$(BIN)/python -m benchmarks.run $(ARGS)
	PYTHONPATH=docs/_ext $(BIN)/python -m spmd_docs.figures

# The Ranks sidebar's JupyterLab extension, from labextension/ (TypeScript, npm's packages,
# JupyterLab's builder) into spmd/labextension, which git keeps: pip and make test never need
# node. Run it after changing labextension/ (tests/test_labextension.py says when).
labextension: $(STAMP)
	cd labextension && npm install --no-audit --no-fund --loglevel=error && \
	  PATH="$(CURDIR)/$(BIN):$$PATH" npm run build
	HATCH_JUPYTER_BUILDER_SKIP_NPM=1 $(BIN)/python -m pip install --quiet --no-deps -e .

lint: $(STAMP)
	$(BIN)/ruff check spmd tests benchmarks docs/conf.py docs/_ext hatch_build.py

clean:
	rm -rf $(VENV) $(PEER_VENV) notebooks/*.executed.ipynb docs/_build \
	       docs/reference/magics.md docs/reference/kernel.md docs/reference/internals.md docs/reference/errors.md \
	       docs/development/benchmarks.md
