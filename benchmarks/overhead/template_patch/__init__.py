"""The template comparison's run-time patch of flowertune-llm (``sitecustomize.py``, put on the
template's PYTHONPATH; imported as part of this package it installs nothing)."""
