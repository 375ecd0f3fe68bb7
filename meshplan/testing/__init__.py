"""Test oracles shared by tests and benchmarks: exhaustive or unpruned versions of the
planner's searches and plain numpy semantics of resharding; small inputs only, never used by
the planner."""
