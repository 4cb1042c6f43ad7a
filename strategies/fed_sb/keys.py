"""Where Fed-SB's fixed B and A travel and are kept: the message record, the node's context
record and the reply metric that says a node holds them (read by the client's hook,
``method.py``, and the server's strategy, ``strategy.py``)."""

BASIS = "basis"  # a message's ArrayRecord of '<layer>.B' and '<layer>.A'
BASIS_CONTEXT = "fed-sb-basis"  # a node's context: the B and A it holds
BASIS_HELD = "basis-held"  # a reply's metric: 1 when the node holds B and A
