"""What a federated method is to the core: the contract every method fulfils
(``contract.py``), the registry the run config and both apps look methods up in
(``registry.py``) and the communication a method's parts cost (``communication.py``).

The methods themselves live in ``strategies/``, one folder each, and register here when
``strategies.registry`` is imported (the ClientApp, the ServerApp and the tooling do);
nothing in ``flower_app`` imports ``strategies``.
"""
