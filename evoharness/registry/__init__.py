"""MLflow and releases: the tracking store (``tracking``), the ``champion`` promotion rule (``promotion``), released
policies and their model cards (``release``, ``model_card``), and lineage audits (``lineage``)."""
