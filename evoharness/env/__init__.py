"""Environments: ALFWorld games by split and their handcoded expert (``alfworld``), environment processes for
episodes played together (``pool``), TextWorld speed-ups, wall-clock limits, and the adapter protocol other
environments plug into (``adapters``)."""
