"""The test suite; `tests.support` holds what several suites and `bench/` share."""
