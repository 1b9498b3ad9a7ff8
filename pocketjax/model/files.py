"""Which files a checkpoint folder may name: the one containment check every reader of checkpoint files uses."""
from __future__ import annotations

from pathlib import Path

from ..errors import CheckpointError


def contained(folder: str | Path, name: str) -> Path:
    """`folder / name`, once it resolves (symlinks followed) inside the folder, or inside the Hub cache's blob store
    when the folder is a snapshot (`models--*/snapshots/<rev>`, whose files are links to `../../blobs/<hash>`).
    A checkpoint naming anything else (`../../etc/passwd`, another model's file, a link out) is a CheckpointError
    that names only what the checkpoint wrote: the outside file is never opened."""
    folder = Path(folder)
    if not isinstance(name, str) or not name or "\0" in name:
        raise CheckpointError(f"{folder}: a checkpoint file name must be a non-empty string, got {name!r:.80}")
    root = folder.resolve()
    roots = [root]
    if root.parent.name == "snapshots" and root.parent.parent.name.startswith(("models--", "datasets--")):
        roots.append(root.parent.parent / "blobs")
    try:
        target = (folder / name).resolve()
    except (OSError, RuntimeError) as e:  # a symlink loop
        raise CheckpointError(f"{folder}: {name!r:.200} cannot be resolved: {type(e).__name__}") from None
    if not any(target.is_relative_to(r) for r in roots):
        raise CheckpointError(f"{folder}: {name!r:.200} resolves outside the checkpoint folder; refusing to read it")
    return target
