"""Generation with a plan: the loop (``loop``), choosing tokens (``sampling``) and the
driver of the resident job under mpiexec (``driver``)."""
