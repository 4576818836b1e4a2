"""Pretrained weights from the Hugging Face Hub where the Hub cannot be reached: the copy in the
local cache (HF_HOME), or one line at once.

Why: huggingface_hub retries a request whose host name does not resolve five times, backing off
1 to 8 s, and timm asks for two files: on a machine without network `--pretrained hub` waited
55 s (2-core AMD EPYC), printing a retry line each time, before saying the weights could not be
fetched.  The endpoint's name is looked up once instead (under a millisecond where it fails).
"""

from __future__ import annotations

import socket
from typing import Optional
from urllib.parse import urlparse
from urllib.request import getproxies, proxy_bypass

from accel_train.base.errors import UsageError

# what timm's loader asks the Hub for, in its order: the safetensors file, then torch's
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def hub_unreachable() -> Optional[str]:
    """Why the Hub will not be asked (words for a message), or None where it may be: in
    huggingface_hub's offline mode (HF_HUB_OFFLINE=1), or where the endpoint's host name does
    not resolve.  Behind a proxy (HTTPS_PROXY, which huggingface_hub's client takes) the name
    need not resolve here: the proxy resolves it, so nothing is concluded."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set (unset it where there is network to download)"
    endpoint = urlparse(constants.ENDPOINT)
    host = endpoint.hostname
    if endpoint.scheme in getproxies() and not proxy_bypass(host or ""):
        return None
    try:
        socket.getaddrinfo(host, 443)
    except (OSError, UnicodeError):
        return f"the Hugging Face Hub ({constants.ENDPOINT}) cannot be reached from here"
    return None


def hub_id(name: str) -> Optional[str]:
    """The Hub repository timm takes `name`'s pretrained weights from (None: not from the
    Hub)."""
    from timm.models import get_pretrained_cfg

    cfg = get_pretrained_cfg(name)
    return getattr(cfg, "hf_hub_id", None) or None


def cached_weights(name: str, why: str) -> str:
    """The local cache's copy of timm's pretrained weights for `name`; UsageError naming what
    is missing where there is none (`why`: hub_unreachable's words)."""
    from huggingface_hub import constants, try_to_load_from_cache

    repo = hub_id(name)
    if repo is None:
        raise UsageError(f"--pretrained hub: timm takes {name}'s weights from a URL, and {why}; "
                         f"download them elsewhere and pass --pretrained PATH")
    for filename in WEIGHT_FILES:
        path = try_to_load_from_cache(repo, filename)
        if isinstance(path, str):
            return path
    files = " or ".join(WEIGHT_FILES)
    raise UsageError(f"--pretrained hub: {why}, and {name}'s weights ({repo}: {files}) are "
                     f"not in the local cache ({constants.HF_HUB_CACHE}); download them where "
                     f"there is network (the same --pretrained hub run, or `hf download {repo}`) "
                     f"and copy the cache here, or pass --pretrained PATH to a local "
                     f".safetensors or .pth file")


def refuse_uncached_repository(name: str, why: str) -> None:
    """--model hf-hub:OWNER/NAME where the Hub will not be asked: one line at once when its
    config.json is not in the local cache (timm would retry for half a minute first)."""
    from huggingface_hub import constants, try_to_load_from_cache

    repo = name.partition(":")[2].strip()
    if not isinstance(try_to_load_from_cache(repo, "config.json"), str):
        raise UsageError(f"--model {name}: {why}, and the repository's config.json is not in "
                         f"the local cache ({constants.HF_HUB_CACHE}); download it where there "
                         f"is network (`hf download {repo}`) and copy the cache here, or copy "
                         f"the repository's folder here and pass --model local-dir:FOLDER")
