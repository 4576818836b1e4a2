"""--pretrained hub where the Hub cannot be reached (offline mode, or a host name that does not
resolve): the weights come from the local Hugging Face cache without a request, or the run
stops at once in one line naming the repository and the cache (it retried for 55 s before).
Oracle: the weights file written into a cache laid out as huggingface_hub lays it out, read back
with safetensors; huggingface_hub's own try_to_load_from_cache."""

from __future__ import annotations

import sys

import pytest
import timm
import torch
from safetensors.torch import load_file, save_file

from conftest import PINNED, accel_train, run, test_env

REPO_ID = "timm/test_resnet.r160_in1k"   # where timm takes test_resnet's weights from
TINY = ["--dataset", "synthetic", "--synthetic-train-size", "32", "--max-eval-samples", "16",
        "--batch-size", "16", "--max-steps", "1", "--no-plots", *PINNED]


def cache_holding(root, weights: dict):
    """A Hub cache (HF_HUB_CACHE) holding REPO_ID's model.safetensors at one revision."""
    repo = root / f"models--{REPO_ID.replace('/', '--')}"
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    save_file(weights, str(snapshot / "model.safetensors"))
    return root


def test_the_repository_is_the_one_timm_names():
    assert timm.models.get_pretrained_cfg("test_resnet").hf_hub_id == REPO_ID


UNREACHABLE = {  # the environment, and why the run says the Hub is not asked
    "offline-mode": ({"HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE is set (unset it where there is "
                                              "network to download)"),
    "host-does-not-resolve": ({"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "https://hub.example.invalid"},
                              "the Hugging Face Hub (https://hub.example.invalid) cannot be "
                              "reached from here")}


@pytest.mark.slow
@pytest.mark.parametrize("unreachable", list(UNREACHABLE))
def test_weights_not_in_the_cache_are_one_line_at_once(tmp_path, unreachable):
    env, why = UNREACHABLE[unreachable]
    result = accel_train(*TINY, "--model", "test_resnet", "--pretrained", "hub",
                         "--output-dir", str(tmp_path / "run"),
                         env=test_env(HF_HUB_CACHE=str(tmp_path / "cache"), **env))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"accel_train: error: --pretrained hub: {why}, and test_resnet's "
                           f"weights ({REPO_ID}: model.safetensors or pytorch_model.bin) are not "
                           f"in the local cache ({tmp_path / 'cache'})"), line
    assert "Retrying" not in result.stderr and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_the_flag_alone_asks_for_the_hubs_weights(tmp_path):
    """`--pretrained` with no value, as timm's train.py takes it, before another option: the
    Hub's weights (here the one line of an empty cache offline, naming hub); with a value after
    it, that value is the weights file, as before."""
    env, why = UNREACHABLE["offline-mode"]
    result = accel_train(*TINY, "--model", "test_resnet", "--pretrained", "--output-dir",
                         str(tmp_path / "run"),
                         env=test_env(HF_HUB_CACHE=str(tmp_path / "cache"), **env))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"accel_train: error: --pretrained hub: {why}"), line
    result = accel_train(*TINY, "--model", "test_resnet", "--pretrained",
                         str(tmp_path / "w.safetensors"), "--output-dir", str(tmp_path / "run"),
                         env=test_env(HF_HUB_CACHE=str(tmp_path / "cache"), **env))
    line = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 2 and line.startswith(
        f"accel_train: error: --pretrained {tmp_path / 'w.safetensors'}: no such file"), line
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_an_hf_hub_model_not_in_the_cache_is_one_line_at_once(tmp_path):
    env, why = UNREACHABLE["host-does-not-resolve"]
    result = accel_train(*TINY, "--model", f"hf-hub:{REPO_ID}", "--output-dir",
                         str(tmp_path / "run"),
                         env=test_env(HF_HUB_CACHE=str(tmp_path / "cache"), **env))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"accel_train: error: --model hf-hub:{REPO_ID}: {why}, and the "
                           f"repository's config.json is not in the local cache"), line
    assert "Retrying" not in result.stderr and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_weights_in_the_cache_are_loaded_without_a_request(tmp_path):
    """The cached file's tensors are the network's start (the classifier, of another class
    count, excepted: timm drops it), with the Hub's host unresolvable."""
    torch.manual_seed(5)
    weights = {k: v.contiguous() for k, v in
               timm.create_model("test_resnet", num_classes=1000).state_dict().items()}
    cache = cache_holding(tmp_path / "cache", weights)
    script = ("import sys, torch\n"
              "from safetensors.torch import save_file\n"
              "from accel_train.model.build import create_model\n"
              "model = create_model('test_resnet', 10, pretrained='hub')\n"
              "state = {k: v.contiguous() for k, v in model.state_dict().items()}\n"
              "save_file(state, sys.argv[1])\n")
    result = run([sys.executable, "-c", script, str(tmp_path / "built.safetensors")],
                 env=test_env(HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="0",
                              HF_ENDPOINT="https://hub.example.invalid"))
    assert result.returncode == 0, result.stderr[-2000:]
    built = load_file(str(tmp_path / "built.safetensors"))
    body = [k for k in weights if not k.startswith("fc.")]
    assert body and all(torch.equal(built[k], weights[k]) for k in body)
    assert built["fc.weight"].shape[0] == 10
    result = accel_train(*TINY, "--model", "test_resnet", "--pretrained", "hub",
                         "--output-dir", str(tmp_path / "run"),
                         env=test_env(HF_HUB_CACHE=str(cache)))
    assert result.returncode == 0, result.stderr[-2000:]


def test_behind_a_proxy_an_unresolvable_name_says_nothing():
    """Clusters that reach the Hub through HTTPS_PROXY often resolve no outside name: the proxy
    does.  There the look-up concludes nothing (the Hub is tried as before); without a proxy,
    or with the Hub's host in NO_PROXY, it does."""
    script = ("import os\n"
              "from accel_train.model.hub_cache import hub_unreachable\n"
              "print(bool(hub_unreachable()))\n"
              "os.environ['HTTPS_PROXY'] = 'http://127.0.0.1:9'\n"
              "print(bool(hub_unreachable()))\n"
              "os.environ['NO_PROXY'] = 'hub.example.invalid'\n"
              "print(bool(hub_unreachable()))\n")
    env = test_env(HF_HUB_OFFLINE="0", HF_ENDPOINT="https://hub.example.invalid")
    for name in ("HTTPS_PROXY", "https_proxy", "NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy"):
        env.pop(name, None)
    result = run([sys.executable, "-c", script], env=env)
    assert result.stdout.split() == ["True", "False", "True"], result.stderr[-2000:]
