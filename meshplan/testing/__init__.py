"""Test oracles: exhaustive or unpruned versions of the planner's searches, small inputs only."""
