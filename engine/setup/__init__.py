"""Setting up TuneDeck's private environment: which torch build fits this GPU, installing it, repairing it.

Nothing here imports torch or Qt: this code runs before torch exists (the app's first-run setup view calls it)
and in the installers' last steps. Long jobs are iterators of small frozen events, like training runs.
"""
