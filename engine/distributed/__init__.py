"""What runs a model over several processes: the step broadcast, the process group, ..."""
