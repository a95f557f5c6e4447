"""How long a test waits for a condition before it calls the wait a hang.

Only a hang reaches it. The tests wait on conditions (a signal, a state, a file), never on a time budget. This
bound is far above any idle-machine time, because a CI machine shared with other work can be many times slower
(the whole suite has passed beside two CPU-bound processes on two cores). Child processes are bounded by it too,
and pytest-timeout's per-test guard sits above it (pyproject.toml); tests/test_hang_bounds.py keeps it so. Imports
nothing, so a child process can read it before anything else loads.
"""

HANG_S = 1800.0
HANG_MS = int(HANG_S * 1000)
