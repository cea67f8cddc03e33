"""Real servers the tests and benchmarks start on loopback (not used in production)."""
