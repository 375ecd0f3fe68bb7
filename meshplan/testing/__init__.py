"""Test oracles: reference helpers that tests and test scripts use, not the planner."""
