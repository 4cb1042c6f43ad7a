"""LoRA-SB's adapter kind: W = W0 + s B R A, with B and A fixed and R (r x r) trained."""
