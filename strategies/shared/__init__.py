"""What both sides of the methods load: ``BaseMethod`` (the server side every method shares,
its server hooks importing ``strategies.server`` only when the server calls them), the
maths the rules share (weighted averages, low-rank products, input validation) and the
clients' folds into W0 (``folds.py``)."""
