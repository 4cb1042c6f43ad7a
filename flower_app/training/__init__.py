"""Local training: the loops, the learning-rate schedule, precision and quantisation."""
