"""Tools around a run: the memory planner, evaluation, the environment doctor, the dry run."""
