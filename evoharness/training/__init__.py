"""Training: the embedded default model (``model``), supervised harness fine-tuning (``sft``), cost-aware GRPO
(``grpo``, ``rollouts``, ``reward``, ``advantages``) and ``accelerate launch`` of their entry points (``launch``)."""
