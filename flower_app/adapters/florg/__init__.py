"""FLoRG's adapter kind: W = W0 + s L Aᵀ A R, with A (r x k) the only trained matrix."""
