"""Manage the Flower CLI home directory (``$FLWR_HOME``) and its ``config.toml``, where the
``flwr`` CLI reads its connections: ``write_local_simulation_connection``,
``write_tls_connection``, ``read_flower_config``, ``set_ray_address`` / ``ray_address_env``.

    python -m florg_tools.flwr_home setup [--flwr-home DIR] [--num-supernodes N]
        [--num-cpus-per-client N] [--num-gpus-per-client F] [--ray-address HOST:PORT|auto]

A simulation connection has ``address = ":local:"`` (a SuperLink every ``flwr`` command
starts detached on demand) and its ``options`` (supernodes, client resources); an explicit
address is a SuperLink you run. ``--ray-address`` records a Ray cluster's address in the
connection and prints the ``export RAY_ADDRESS=...`` the SuperLink's shell needs. The file,
``:local:`` and why Ray's address goes through the environment: docs/deploy-ray.md.
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
