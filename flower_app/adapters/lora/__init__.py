"""LoRA's adapter kind (PEFT's layers): W = W0 + s B A."""
