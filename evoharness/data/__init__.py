"""Raw execution logs: collection by the handcoded expert (``collect``), their record schema (``records``), reading
them (``rawlog``, ``generic_log``), the DVC-versioned store and pinned versions (``datastore``, ``pinned``), and
DAgger relabelling (``dagger``)."""
