"""The server's side of every method, loaded only by the ServerApp: the common Flower
strategy (``strategy.py``) and the parts it coordinates (the reply gate, screening, the rank
router, the communication and node ledgers, client sampling, the run state, the clients'
evaluation, saved updates, the virtual clock, SecAgg+'s secure sum), the folding methods'
strategy and messages, and the server's privacy mechanisms (central DP's mean and
product-mean mechanisms, the clients' DP-SGD record). The ClientApp never imports this
folder (tests/runtime/test_architecture.py)."""
