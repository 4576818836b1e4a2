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


def hub_unreachable() -> bool:
    """True in huggingface_hub's offline mode (HF_HUB_OFFLINE=1) or where the endpoint's host
    name does not resolve.  Behind a proxy (HTTPS_PROXY, which huggingface_hub's client takes)
    the name need not resolve here: the proxy resolves it, so nothing is concluded."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return True
    endpoint = urlparse(constants.ENDPOINT)
    host = endpoint.hostname
    if endpoint.scheme in getproxies() and not proxy_bypass(host or ""):
        return False
    try:
        socket.getaddrinfo(host, 443)
    except (OSError, UnicodeError):
        return True
    return False


def hub_id(name: str) -> Optional[str]:
    """The Hub repository timm takes `name`'s pretrained weights from (None: not from the
    Hub)."""
    from timm.models import get_pretrained_cfg

    cfg = get_pretrained_cfg(name)
    return getattr(cfg, "hf_hub_id", None) or None


def cached_weights(name: str) -> str:
    """The local cache's copy of timm's pretrained weights for `name`; UsageError naming what
    is missing where there is none."""
    from huggingface_hub import constants, try_to_load_from_cache

    repo = hub_id(name)
    if repo is None:
        raise UsageError(f"--pretrained hub: timm takes {name}'s weights from a URL, and this "
                         f"machine reaches no network; download them elsewhere and pass "
                         f"--pretrained PATH")
    for filename in WEIGHT_FILES:
        path = try_to_load_from_cache(repo, filename)
        if isinstance(path, str):
            return path
    files = " or ".join(WEIGHT_FILES)
    raise UsageError(f"--pretrained hub: the Hugging Face Hub ({constants.ENDPOINT}) cannot be "
                     f"reached from here, and {name}'s weights ({repo}: {files}) are not in "
                     f"the local cache ({constants.HF_HUB_CACHE}); download them where there "
                     f"is network (the same --pretrained hub run, or `hf download {repo}`) and "
                     f"copy the cache here, or pass --pretrained PATH to a local .safetensors "
                     f"or .pth file")
