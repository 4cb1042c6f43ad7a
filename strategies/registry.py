"""Every method folder of this package, registered with the core's method registry
(``flower_app/methods/registry.py``) when this module is imported.

A method is one folder, ``strategies/<folder>/``: its ``method.py`` ends with
``METHODS = (...)`` (the ``Method`` objects it defines, see
``flower_app/methods/contract.py``), and its line in ``METHOD_FOLDERS`` below registers them,
in order. The ClientApp, the ServerApp, the tooling and the tests import this module before
they resolve a run config.
"""

from __future__ import annotations

from importlib import import_module

from flower_app.methods.registry import register_method

# One line per method folder (strategies/<folder>/).
METHOD_FOLDERS = (
    "florg",  # florg, florg-no-procrustes
    "florg_signed",
    "fedit",
    "federa",
    "ffa_lora",
    "fedsa_lora",
    "fedex_lora",
    "hetlora",
    "flexlora",
    "rolora",
    "fedsvd",
    "flora",
    "fed_sb",
    "fedrot_lora",
)
for _folder in METHOD_FOLDERS:
    for _method in import_module(f"strategies.{_folder}.method").METHODS:
        register_method(_method, source=__name__)
