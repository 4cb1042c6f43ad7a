"""Deployment of the Flower App on a SuperLink and SuperNodes (TLS, node auth, netns).

``commands``: the argv of every process; ``certs``: demo CA, server certificate and node
keys; ``processes``: start/stop a SuperLink + SuperNodes by pid; ``__main__``: the CLI
(``python -m flower_app.deploy up ...``).
"""
