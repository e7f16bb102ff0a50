"""What runs a model over several processes: the process group and its collectives, the step broadcast."""
