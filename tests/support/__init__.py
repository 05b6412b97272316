"""Helpers shared by several test suites and by `bench/`: real deployments, test images and
media servers, engine inputs and references, transfer probes, waiting on a condition."""
