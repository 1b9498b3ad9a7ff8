"""Checkpoint locations: a local folder as is, or a Hugging Face repo id resolved to its snapshot in the hub cache.

huggingface_hub does the resolving, so HF_HOME / HF_HUB_CACHE, HF_HUB_OFFLINE, HF_TOKEN and its progress bars
work as they do for transformers.
"""
from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

from ..errors import CheckpointError, ConfigError

# Every file pocketjax reads from a checkpoint (weights, configs, tokenizer), so LLM runs from the snapshot alone.
CHECKPOINT_FILES = ("config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
                    "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                    "additional_chat_templates/*.jinja")
# owner/name, each part starting with a letter or digit, so "./model" or "~/model" never reads as an id.
REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def resolve_checkpoint(path_or_id: str | os.PathLike, revision: str | None = None, local_files_only: bool = False,
                       files: Sequence[str] = CHECKPOINT_FILES) -> Path:
    """The local folder of a checkpoint: an existing folder as is, a repo id ("Qwen/Qwen3-0.6B") from the hub cache.

    An id missing from the cache is downloaded (only `files`, glob patterns), unless `local_files_only` or
    HF_HUB_OFFLINE=1. `revision` (branch, tag or commit hash; default "main") applies to repo ids only.
    """
    name = str(path_or_id)
    folder = Path(name).expanduser()
    if folder.is_dir():
        if revision is not None:
            raise ConfigError(f"revision={revision!r} applies to a Hugging Face repo id, not the folder {name}")
        return folder
    if folder.exists() or not REPO_ID.fullmatch(name):
        raise CheckpointError(f"{name} is not a checkpoint folder, nor a Hugging Face repo id (owner/name)")
    try:
        return Path(snapshot_download(name, revision=revision, allow_patterns=list(files),
                                      local_files_only=local_files_only))
    except Exception as err:  # huggingface_hub raises its own, httpx's and OS errors alike
        raise CheckpointError(_explain(name, revision, err)) from err


def _explain(repo_id: str, revision: str | None, err: Exception) -> str:
    """What went wrong resolving `repo_id` and how to fix it (the full huggingface_hub error is the cause)."""
    at = f"{repo_id!r} (revision {revision!r})" if revision else repr(repo_id)
    why = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}"
    if isinstance(err, RevisionNotFoundError):
        return f"the Hugging Face repo {repo_id!r} has no revision {revision!r} ({why})"
    if isinstance(err, RepositoryNotFoundError):
        return (f"{repo_id!r} is neither a local folder nor a Hugging Face repo you can access; a private or gated "
                f"repo needs `hf auth login` or HF_TOKEN ({why})")
    download = f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")
    return (f"{at} is neither a local folder nor in the hub cache {constants.HF_HUB_CACHE}, and the Hub was not "
            f"reached ({why}). Download it with network access (`{download}`, HF_HUB_OFFLINE unset), point HF_HOME "
            f"or HF_HUB_CACHE at the cache that holds it, or pass a local folder.")
