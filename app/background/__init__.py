"""Work off the GUI thread and its control: the training worker, the run controller, A/B compare, the GUI-thread GC."""
