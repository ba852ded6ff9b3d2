"""Evaluation: playing a split's games (``evaluate``, ``play``, ``workers``), the paired test (``stats``), the
pipeline's summary (``report``), transcripts and figures."""
