"""The control loop: dispatch under a staleness bound, assemble groups, train, sync weights."""
