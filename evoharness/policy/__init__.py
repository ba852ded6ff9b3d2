"""The policy acting in an environment: the harness loop (``agent``), a causal language model as the policy
(``lm_policy``), and batched inference for episodes played together (``batching``, ``batched_play``)."""
