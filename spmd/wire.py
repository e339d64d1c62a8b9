"""Every name jupyter-spmd adds to ipyparallel's wire, in one place, each with what it means,
who sends it and who reads it.

Three processes speak it: the notebook (spmd/cluster, through ipyparallel's client), the
controller (spmd/controller/fanout.py) and every rank (spmd/engine/rank_kernel.py). Everything else
they exchange is ipyparallel's or Jupyter's own protocol. A name here is a string on the wire:
changing one changes the protocol, and a notebook and ranks of different versions would no
longer understand each other.

Plain constants only: imported by all three sides, this module imports nothing.
"""

from __future__ import annotations

# -- a cell, fanned out by the controller (controller/fanout.py, channel/client.py) --------

# The key, in the client's connection file, of the port of the controller's fan-out socket.
# Written by the controller (fanout.install), read by the notebook (CellRoutes.connect).
CELLS_PORT = "spmd_cells"
# A cell for several ranks, as one message: the code, the request's metadata, and each rank's
# engine identity with the id its execute request gets. Sent by the notebook
# (CellRoutes.send), read by the controller's fan-out, which sends each rank an
# ``execute_request``.
CELL_REQUEST = "spmd_cell_request"
# The ranks' replies to cells, gathered: [request id, the reply metadata of KEPT_METADATA]
# for each rank that replied. Sent by the controller's fan-out, read by the notebook
# (CellRoutes._replies).
CELL_REPLIES = "spmd_cell_replies"

# -- an execute request's metadata (notebook -> rank) -----------------------------------------

# True: the rank counts the IOPub messages it sends for this cell, puts the count in its reply
# (IOPUB_COUNT) and sends no ``status: idle``. Set by the notebook (lockstep/run.py), read by
# the rank (engine/rank_kernel.py, engine/shell/quiet.py).
COUNTED = "spmd_counted"

# -- an execute or apply reply's metadata (rank -> controller -> notebook) --------------------

# How many IOPub messages the rank sent for a COUNTED request: the notebook has the rank's
# outputs all once it has that many. Sent by the rank (engine/shell/quiet.py), read by the notebook
# (channel/client.py).
IOPUB_COUNT = "spmd_iopub"
# The cell's census digest, [count, hash] of the cross-process launches it made (absent: it
# made none). Sent by the rank (engine/watch/launches.py), read by the notebook
# (channel/client.py): the magics compare the ranks' digests after a cell (magics/cells/cell.py).
CENSUS_DIGEST = "spmd_census"
# The JAX_* and XLA_* variables changed on the rank since it started, {name: value, or None
# where removed}, in the first reply after a change. Sent by the rank (engine/join/import_env.py),
# read by the notebook (channel/client.py), which gives them to the next restart.
ENV_CHANGED = "spmd_env"
# The arrays over several processes this cell printed, {mark: the parts of its printed form
# this rank holds} (absent: none). Sent by the rank (engine/arrays/print_marks.py), read by the notebook
# (channel/client.py, magics/arrays/printed.py), which puts each printed array together where
# marks (PRINTED_BEGIN, PRINTED_MARK) surround its placeholder in the rank's output text.
PRINTED_ARRAYS = "spmd_printed"
# What the controller's fan-out keeps of each rank's reply metadata for the notebook.
KEPT_METADATA = (IOPUB_COUNT, CENSUS_DIGEST, ENV_CHANGED, PRINTED_ARRAYS)
# The marks a rank puts in its output text around the placeholder of a printed array over
# several processes (jax's ``Array(shape=..., dtype=...)``, a DTensor's repr of its own
# shard), in stdout, stderr and a display's text/plain: PRINTED_BEGIN before it, PRINTED_MARK
# after it ({} is the array's number in the cell, then "s" where str() or format() printed it,
# "r" where repr() did, "f" where a format spec did, of an array some processes hold whole).
# The notebook replaces the placeholder and its marks with the array as one process prints it,
# or drops the marks.
PRINTED_BEGIN = "\x00spmd-printed\x00"
PRINTED_MARK = "\x00spmd-array:{}\x00"

# -- control-channel requests (notebook -> rank) and their replies (rank -> notebook) ---------
# Sent by the notebook through ipyparallel's client (channel/control.py), answered by the
# rank's kernel on its control thread (engine/rank_kernel.py) once the rank has joined.

# Where the rank's main thread is: the reply's ``frames`` ([file, line, function, source],
# outermost first). Asked by %spmd where and the divergence and timeout reports.
WHERE_REQUEST = "spmd_where_request"
WHERE_REPLY = "spmd_where_reply"
# A signal for the rank's process (``signum``); the reply confirms it before it is sent.
# Sent by an interrupt or a stop of ranks that have no process handle here.
SIGNAL_REQUEST = "spmd_signal_request"
SIGNAL_REPLY = "spmd_signal_reply"
# A cell's whole census record (``request``: that cell's request id; None: the running or last
# cell's); the reply's ``census``: the record, or None where it is not kept. Asked by
# lockstep/census.py when the digests differ, and by %spmd census.
CENSUS_REQUEST = "spmd_census_request"
CENSUS_REPLY = "spmd_census_reply"
# The answer to a prompt the rank showed (PROMPT_MIME): ``id`` the prompt's, ``text`` what was
# typed, or ``error``; for a breakpoint, ``stop``. The reply's ``taken``: whether a prompt was
# still waiting for it. Sent by the notebook (lockstep/run.py).
PROMPT_ANSWER = "spmd_prompt_answer"
PROMPT_ANSWER_REPLY = "spmd_prompt_answer_reply"

# -- MIME types in a rank's display data (rank -> notebook, on IOPub) ------------------------

# A prompt (input(), getpass, or whether to stop at a breakpoint), as a display message of its
# own: {id, kind, prompt, password}. Sent by the rank (engine/shell/prompts.py), read by the
# notebook (lockstep/run.py), which asks the person and answers with PROMPT_ANSWER.
PROMPT_MIME = "application/vnd.spmd.prompt+json"
# A cell's value that is one array over several processes: the parts of its printed form this
# rank holds. Sent by the rank (engine/arrays/results.py), read by the notebook (lockstep/run.py,
# magics/arrays/values.py), which prints the array once.
GLOBAL_ARRAY_MIME = "application/vnd.spmd.global-array+json"
# A cell's outputs rank by rank, in the notebook, for programs (magics/cells/cell.py)
RANKS_DATA_MIME = "application/vnd.spmd.ranks+json"
