"""Development tools that run from a checkout, never installed: the `make demo` tour and the
harness it shares with the tests and the bench (tests/, bench/)."""
