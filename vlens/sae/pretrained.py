"""``SAE.from_pretrained(release, sae_id)``: SAELens's names for published SAEs.

Where SAELens is installed, its own ``SAE.from_pretrained`` resolves the release in its registry
and downloads into HuggingFace's cache, as it would for a SAELens user; the SAE it returns is read
through its public surface (``SAE.of``). Without SAELens, a release that is a HuggingFace repository
id is read directly: ``sae_id`` is then the folder inside it that SAELens's format keeps
(``cfg.json``, ``sae_weights.safetensors``), taken from HuggingFace's cache first. Offline, or where
neither resolves, the error says which folder to pass to ``SAE.load_from_disk`` instead.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from vlens.sae.config import CFG_FILENAME, WEIGHTS_FILENAME


class PretrainedSAEError(LookupError):
    """A published SAE that could not be found or fetched; the message says what to pass
    instead."""


def sae_lens_installed() -> bool:
    return importlib.util.find_spec("sae_lens") is not None


def from_sae_lens(release: str, sae_id: str, **options: Any) -> Any:
    """SAELens's own ``SAE.from_pretrained(release, sae_id, **options)``, its download failure
    told with the offline alternative."""
    from sae_lens import SAE as SAELensSAE

    try:
        return SAELensSAE.from_pretrained(release, sae_id, **options)
    except OSError as error:  # huggingface_hub's "not in the cache and no connection" among them
        raise PretrainedSAEError(
            f"SAELens could not fetch SAE {sae_id!r} of release {release!r} ({error}). "
            f"{_OFFLINE_HELP}"
        ) from error


def hub_folder(release: str, sae_id: str, force_download: bool = False) -> Path:
    """The local folder of ``sae_id`` inside HuggingFace repository ``release`` (SAELens's
    format), downloaded into HuggingFace's cache unless it is there already."""
    if "/" not in release:
        raise PretrainedSAEError(
            f"{release!r} is a name from SAELens's registry of releases, and SAELens is not "
            f"installed: install it beside vlens (`bash install.sh saelens`, or `pip install "
            f"sae-lens`), or name the HuggingFace repository (owner/name) that holds the SAE. "
            f"{_OFFLINE_HELP}"
        )
    from huggingface_hub import snapshot_download

    patterns = [f"{sae_id}/{name}" for name in (CFG_FILENAME, WEIGHTS_FILENAME)]
    try:
        if not force_download:
            try:
                root = snapshot_download(release, allow_patterns=patterns, local_files_only=True)
                if all((Path(root) / pattern).is_file() for pattern in patterns):
                    return Path(root) / sae_id
            except OSError:
                pass  # not in the cache yet
        root = snapshot_download(release, allow_patterns=patterns, force_download=force_download)
    except OSError as error:
        raise PretrainedSAEError(
            f"could not fetch {sae_id!r} from HuggingFace repository {release!r} ({error}). "
            f"{_OFFLINE_HELP}"
        ) from error
    folder = Path(root) / sae_id
    if not all((Path(root) / pattern).is_file() for pattern in patterns):
        raise PretrainedSAEError(
            f"HuggingFace repository {release!r} has no {CFG_FILENAME} and "
            f"{WEIGHTS_FILENAME} under {sae_id!r}: sae_id names the folder that holds them"
        )
    return folder


_OFFLINE_HELP = (
    "Offline, load the SAE from a folder that holds its cfg.json and sae_weights.safetensors: "
    "SAE.load_from_disk(folder)."
)
