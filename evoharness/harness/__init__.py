"""The BPE workspace (Belief, Progress, Experience) and its meta-actions (``workspace``), what the policy reads each
turn (``context``), and BPE trace construction from raw episodes (``traces``)."""
