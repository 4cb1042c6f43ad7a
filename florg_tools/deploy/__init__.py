"""Deployment of the Flower App on a SuperLink and SuperNodes (TLS, node auth, netns).

``commands``: the argv of every process (the single source of truth); ``certs``: demo CA,
server certificate and node keys; ``deployment``: a SuperLink + SuperNodes (+ SuperExecs)
started and stopped by pid (``Deployment``); ``netns``: network namespaces with veth
pairs; ``__main__``: the CLI (``python -m florg_tools.deploy
up|superlink|node|connection|certs``). See ``docs/deploy-superlink.md``.
"""
