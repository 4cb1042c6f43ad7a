"""Whether a Hugging Face Hub repository can be had on this machine, asked once, quickly,
before a run starts: in the local Hub or datasets cache, or the Hub answering one metadata
request (no retries), so a machine without the Hub fails in about a second with a line
naming it, not after the download's retries."""

from __future__ import annotations

import os
from pathlib import Path

HUB = "the Hugging Face Hub (huggingface.co)"
PROBE_TIMEOUT_S = 10.0


def cached(repo_id: str, repo_type: str) -> bool:
    """Whether a copy of ``repo_id`` is in the Hub cache (or, for a data set, in the
    datasets cache), where offline loading finds it."""
    from huggingface_hub import constants

    org_name = repo_id.replace("/", "--")
    if (Path(constants.HF_HUB_CACHE) / f"{repo_type}s--{org_name}").is_dir():
        return True
    if repo_type == "dataset":
        import datasets

        return (Path(datasets.config.HF_DATASETS_CACHE) / repo_id.replace("/", "___")).is_dir()
    return False


def hub_problem(repo_id: str, repo_type: str = "dataset") -> str | None:
    """None when ``repo_id`` (a ``dataset`` or ``model``) is cached here or the Hub answers
    for it; else one line saying why it cannot be had, naming the Hub."""
    if cached(repo_id, repo_type):
        return None
    where = f"https://huggingface.co/{'datasets/' if repo_type == 'dataset' else ''}{repo_id}"
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return f"{repo_id} is on {HUB} ({where}), not cached here, and HF_HUB_OFFLINE is set"
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError

    try:
        HfApi().repo_info(repo_id, repo_type=repo_type, timeout=PROBE_TIMEOUT_S)
    except RepositoryNotFoundError as err:
        return f"{repo_id} is not on {HUB} or needs a login (hf auth login): {_first_line(err)}"
    except Exception as err:  # no network, DNS, proxy, timeout: the Hub cannot be reached
        return (
            f"{repo_id} is on {HUB} ({where}), which this machine cannot reach "
            f"({type(err).__name__}: {_first_line(err)}), and it is not cached here"
        )
    return None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
