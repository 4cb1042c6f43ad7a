"""Manage the Flower CLI home directory (``$FLWR_HOME``) and its ``config.toml``.

Since Flower 1.27 the CLI no longer reads connections ("federations") from the app's
``pyproject.toml``: they live in ``$FLWR_HOME/config.toml`` (a ``[tool.flwr.federations]``
table in ``pyproject.toml`` is migrated there and commented out by ``flwr run``). In
Flower 1.41 a connection looks like this::

    [superlink]
    default = "local-simulation"

    [superlink.local-simulation]
    address = ":local:"          # or "127.0.0.1:PORT" for a SuperLink you started
    insecure = true              # only meaningful with an explicit address

    [superlink.local-simulation.options]
    num-supernodes = 2

    [superlink.local-simulation.options.backend.client-resources]
    num-cpus = 1                 # must be an INTEGER in 1.41 (protobuf int field)
    num-gpus = 0.0

``address = ":local:"`` makes every ``flwr`` command lazily start a *detached*
``flower-superlink --simulation`` on ``127.0.0.1:39091`` (override with the environment
variable ``FLWR_LOCAL_SUPERLINK_HTTP_API_PORT``), with its state in
``$FLWR_HOME/local-superlink/state.db``; it keeps running after ``flwr run`` returns.
An explicit ``address`` is treated as user-managed (nothing is started).

``options.*`` in a connection is deprecated in 1.41 (``flwr run`` prints a warning) but
still honoured: it is sent as the per-run simulation config override.

Command line::

    python -m florg_tools.flwr_home setup [--flwr-home DIR] [--num-supernodes N]
        [--num-cpus-per-client N] [--num-gpus-per-client F] [--ray-address HOST:PORT|auto]

Ray cluster (``--ray-address``, see ``docs/deploy-ray.md``). The simulation's Ray
backend calls ``ray.init(**init_args)``, and Flower 1.41 forwards only ``num-cpus``,
``num-gpus``, ``logging-level`` and ``log-to-driver`` of
``options.backend.init-args`` (its ``SimulationConfig`` protobuf has no address field;
other keys are dropped without a word). Ray itself reads the ``RAY_ADDRESS`` environment
variable when ``ray.init`` gets no address, and ``flwr-simulation`` inherits the
environment of the SuperLink that started it. So ``--ray-address`` records the address
in the connection (``[superlink.NAME.options.backend.init-args] address``, where Flower
would take it; ``ray_address_env`` reads it back) and prints ``export RAY_ADDRESS=...``
for the shell that starts the SuperLink.
"""


# Modules: ``connections`` (read / write config.toml connections), ``ray_cluster`` (the Ray
# address of a connection), ``cli`` (``setup`` and the machine's default resources).

from __future__ import annotations

from florg_tools.flwr_home.cli import detect_defaults, main
from florg_tools.flwr_home.connections import (
    CONFIG_FILE_NAME,
    DEFAULT_CONNECTION_NAME,
    LOCAL_SUPERLINK_ADDRESS,
    default_flwr_home,
    read_flower_config,
    simulation_connection,
    write_local_simulation_connection,
    write_tls_connection,
)
from florg_tools.flwr_home.connections import (
    REPO_ROOT as REPO_ROOT,  # (not in __all__, as before)
)
from florg_tools.flwr_home.ray_cluster import (
    RAY_ADDRESS_ENV_VAR,
    ray_address_env,
    set_ray_address,
    validate_ray_address,
)

__all__ = [
    "CONFIG_FILE_NAME",
    "DEFAULT_CONNECTION_NAME",
    "LOCAL_SUPERLINK_ADDRESS",
    "RAY_ADDRESS_ENV_VAR",
    "default_flwr_home",
    "detect_defaults",
    "main",
    "ray_address_env",
    "read_flower_config",
    "set_ray_address",
    "simulation_connection",
    "validate_ray_address",
    "write_local_simulation_connection",
    "write_tls_connection",
]
