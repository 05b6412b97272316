"""Logs (`logging`), Prometheus metrics (`metrics`) and NVTX ranges for profiles (`nvtx`)."""
