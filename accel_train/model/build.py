"""The network by name: a timm model (a registry name, or timm's `hf-hub:REPO` and
`local-dir:FOLDER`), or the user's own through its import path `package.module:factory`;
local pretrained weights, backbone freezing, and the rebuild of a trained model from its spec.

A factory is called as `factory(num_classes=N)`; `drop_rate=` and `drop_path_rate=` (timm's
names) are added only when --drop-rate / --drop-path ask for them, and only to a factory that
takes them (else one line): its own defaults hold otherwise.  --pretrained is timm's and does not
apply (the factory loads any weights of its own).  The spec records the import path, and eval,
predict and export import the module again: it must be importable wherever they run.

The model knows nothing of ranks or devices; wrapping happens in `accelerator.prepare`.
"""

from __future__ import annotations

import importlib
import inspect
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import timm
import torch
from torch import nn

from accel_train.model import small_nets  # noqa: F401  (registers the small-image networks in timm's registry)
from accel_train.base.errors import UsageError, did_you_mean, first_line
from accel_train.model.outputs import (keep_auxiliary_logits, kept_auxiliary_logits,
                                       return_logits)
from accel_train.model.transformers_models import (TRANSFORMERS_CONFIG,
                                                  build_from_transformers_config,
                                                  transformers_classifier,
                                                  transformers_config_of)
from accel_train.base.readers import read_json
from accel_train.model.saved import (TIMM_CONFIG, ModelSpec, is_import_path,
                                     unknown_architecture_hint)
from accel_train.base.weightfiles import check_weights_file
from accel_train.model.hub_cache import (cached_weights, hub_unreachable,
                                         refuse_uncached_repository)
from accel_train.model.float32_convs import compute_in_float32

_IDENTIFIERS = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
# package.module:factory (the factory may be dotted too: module:Class.create)
IMPORT_PATH = re.compile(f"{_IDENTIFIERS}:{_IDENTIFIERS}")
IMPORTABLE = ("put the folder that holds it on PYTHONPATH or pip install it (it is imported again "
              "wherever the run is resumed, evaluated, used for predictions or exported)")


def timm_source(name: str) -> Optional[str]:
    """'hf-hub' or 'local-dir' when timm reads the model's config from there, else None."""
    prefix, colon, _ = name.partition(":")
    if not colon or is_import_path(name):
        return None
    return "hf-hub" if prefix.lower() in ("hf-hub", "hf_hub") else "local-dir"


def recorded_model_name(name: str) -> str:
    """The name a run records to rebuild its network: a `local-dir:` folder by its absolute
    path (eval, predict and export may run from another working folder)."""
    if timm_source(name) != "local-dir":
        return name
    prefix, _, folder = name.partition(":")
    return f"{prefix}:{Path(folder).expanduser().resolve()}"


def check_model_name(name: str, flag: str = "--model") -> None:
    """One line now for a name that cannot be built: a timm name timm does not know, a
    `local-dir:` folder that is not a model folder, an import path that does not import.  An
    `hf-hub:` name is only fetched when built (create_model): this check needs no network."""
    if is_import_path(name):
        user_factory(name, flag)
        return
    source = timm_source(name)
    if source == "local-dir":
        _check_local_dir(name, flag)
        return
    if source == "hf-hub":
        if not name.partition(":")[2].strip():
            raise UsageError(f"{flag} {name!r} names no repository; write hf-hub:OWNER/NAME")
        return
    if timm.is_model(name):
        architecture, _, tag = name.partition(".")
        # timm.is_model takes any tag after a known architecture; building with one it has no
        # weights config for raises deep inside timm
        tags = timm.list_pretrained(f"{architecture}.*") if tag else []
        if tag and name not in tags:
            known = ", ".join(tags[:5]) + (", ..." if len(tags) > 5 else "")
            raise UsageError(f"{flag} {name!r}: timm has no {tag!r} weights for {architecture}"
                             + (f" (its tags: {known})" if tags else " (it has no tags)")
                             + f"; pass {architecture!r} or one of those")
        return
    raise UsageError(f"{flag} {name!r} is not a timm model; "
                     f"{did_you_mean(name, timm.list_models())}list them with "
                     f"python -c \"import timm; print(timm.list_models('*{name[:6]}*'))\", or "
                     f"pass your own network as package.module:factory")


def _check_local_dir(name: str, flag: str) -> None:
    folder = Path(name.partition(":")[2])
    if not (folder / TIMM_CONFIG).is_file():
        what = "no such folder" if not folder.is_dir() else f"no {TIMM_CONFIG} in it"
        if not flag.startswith("--"):  # eval, predict, export of what trained so
            raise UsageError(f"{flag} {name}: {what} (from this folder); the network is built "
                             f"from that folder's {TIMM_CONFIG}: put it back, or pass the run "
                             f"folder, whose own {TIMM_CONFIG} describes the trained network")
        raise UsageError(f"{flag} {name}: {what}; pass a folder in timm's format "
                         f"({TIMM_CONFIG} and model.safetensors: an accel-train export or run)")
    architecture = read_json(folder / TIMM_CONFIG, "timm_config")["architecture"]
    if is_import_path(architecture):
        raise UsageError(f"{flag} {name}: that folder holds a network built by your factory "
                         f"{architecture}, which timm cannot build; pass {flag} {architecture}")
    if not timm.is_model(architecture):
        raise UsageError(f"{flag} {name}: its architecture {architecture!r} is not in this "
                         f"timm's registry (timm {timm.__version__}); "
                         f"{unknown_architecture_hint(architecture)}")


def user_factory(name: str, flag: str = "--model") -> Callable:
    """The callable an import path names, or one line saying what to fix."""
    if not IMPORT_PATH.fullmatch(name):
        raise UsageError(f"{flag} {name!r} is neither a timm model name (or timm's hf-hub:REPO, "
                         f"local-dir:FOLDER) nor an import path package.module:factory; write "
                         f"dotted Python names, one colon between module and factory")
    module_name, _, attribute = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and (module_name + ".").startswith(err.name + "."):  # the module itself
            raise UsageError(f"{flag} {name}: no module named {err.name!r} in this Python; "
                             f"{IMPORTABLE}") from None
        raise UsageError(f"{flag} {name}: importing {module_name} failed ({first_line(err)}); "
                         f"install what it imports") from None
    except Exception as err:  # a SyntaxError, or any error its top level raises
        raise UsageError(f"{flag} {name}: importing {module_name} failed "
                         f"({type(err).__name__}: {first_line(err)}); fix the module") from None
    factory = module
    for part in attribute.split("."):
        if not hasattr(factory, part):
            hint = did_you_mean(part, [n for n in dir(factory) if not n.startswith("_")])
            raise UsageError(f"{flag} {name}: {module_name} "
                             f"({getattr(module, '__file__', None) or 'a namespace package'}) "
                             f"has no {attribute!r}; {hint}name the factory after the colon")
        factory = getattr(factory, part)
    if not callable(factory):
        raise UsageError(f"{flag} {name}: {attribute} is not callable (a "
                         f"{type(factory).__name__}); name a function (or class) that takes "
                         f"num_classes= and returns the network")
    return factory


def _takes(factory: Callable, keyword: str) -> bool:
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): let the call say
        return True
    return any(p.name == keyword or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def _create_from_factory(name: str, num_classes: int, drop_rate: float,
                         pretrained: Optional[str], drop_path: float,
                         model_args: Optional[dict] = None) -> nn.Module:
    if pretrained is not None:
        raise UsageError(f"--pretrained {pretrained} loads timm's weights into a timm model; "
                         f"--model {name} is your own factory: load weights there, or drop "
                         f"--pretrained")
    factory = user_factory(name)
    recorded = (model_args or {}).get(TRANSFORMERS_CONFIG)
    if recorded is not None:  # a transformers model a program trained (transformers_models.py)
        try:
            model = build_from_transformers_config(factory, recorded)
        except Exception as err:  # the installed transformers cannot read the recorded config
            raise UsageError(f"--model {name}: building it from the config the run recorded "
                             f"raised {type(err).__name__}: {first_line(err)}; use the "
                             f"transformers version that trained it (config.json's "
                             f"model_args.{TRANSFORMERS_CONFIG} holds the config)") from None
        return_logits(model)
        return model
    kwargs = {"num_classes": num_classes}
    for flag, keyword, value in (("--drop-rate", "drop_rate", drop_rate),
                                 ("--drop-path", "drop_path_rate", drop_path)):
        if value:
            if not _takes(factory, keyword):
                raise UsageError(f"{flag} {value}: --model {name} takes no {keyword}= argument; "
                                 f"add that parameter to the factory, or drop {flag}")
            kwargs[keyword] = value
    call = f"{name.partition(':')[2]}({', '.join(f'{k}={v}' for k, v in kwargs.items())})"
    try:
        model = factory(**kwargs)
    except Exception as err:  # the user's code: whatever it raises, the fix is there
        raise UsageError(f"--model {name}: {call} raised {type(err).__name__}: "
                         f"{first_line(err)}; fix the factory") from None
    if not isinstance(model, nn.Module):
        kind = type(model).__name__
        article = "an" if kind[:1].lower() in tuple("aeiou") else "a"
        raise UsageError(f"--model {name}: {call} returned {article} {kind}, not a torch "
                         f"nn.Module; return the network")
    return_logits(model)  # it may return an object holding its logits (outputs.py)
    return model


def create_model(name: str, num_classes: int, drop_rate: float = 0.0,
                 pretrained: Optional[str] = None, drop_path: float = 0.0,
                 model_args: Optional[dict] = None,
                 head_overlay: Optional[dict] = None) -> nn.Module:
    """A timm model, or the user's factory's; `pretrained` is None, 'hub', or a local weights
    file (timm models only); `model_args`: more of timm's arguments (ModelSpec.model_args);
    `head_overlay`: a local file's classifier kept or dropped, its normalization
    (pretrained_file.py)."""
    check_model_name(name)
    if is_import_path(name):
        return _create_from_factory(name, num_classes, drop_rate, pretrained, drop_path,
                                    model_args)
    kwargs = dict(num_classes=num_classes, drop_rate=drop_rate, **(model_args or {}))
    if drop_path:  # only when asked: not every timm model takes it
        kwargs["drop_path_rate"] = drop_path
    try:
        return _create(name, pretrained, kwargs, head_overlay or {})
    except TypeError as err:
        if "drop_path_rate" not in str(err):
            raise
        raise UsageError(f"--drop-path: {name} has no stochastic depth (timm's drop_path_rate); "
                         f"drop --drop-path or choose a residual model") from None


def _create(name: str, pretrained: Optional[str], kwargs: dict, head_overlay: dict
            ) -> nn.Module:
    source = timm_source(name)
    if source is not None and pretrained in (None, "hub"):
        return _create_from_source(name, source, pretrained == "hub", kwargs)
    if pretrained is None:
        return timm.create_model(name, pretrained=False, **kwargs)
    said = pretrained  # what messages name: the flag's value, not a cache file it came from
    unreachable = hub_unreachable() if pretrained == "hub" else None
    if unreachable:
        pretrained = cached_weights(name, unreachable)  # loaded as a local file, below
        said = f"hub (the cached {pretrained})"
    if pretrained == "hub":
        try:
            return timm.create_model(name, pretrained=True, **kwargs)
        except Exception as err:  # offline, missing cache entry, no weights for this name
            raise UsageError(f"--pretrained hub: cannot fetch weights for {name} "
                             f"({first_line(err, 400)}); with no network, pass "
                             f"--pretrained PATH to a local .safetensors or .pth file") from None
    path = Path(pretrained)
    if path.is_dir():
        raise UsageError(f"--pretrained {said} is a folder; pass the weights file in it "
                         f"(model.safetensors of a run or an export), or 'hub'")
    if not path.is_file():
        raise UsageError(f"--pretrained {said}: no such file; pass a local .safetensors/"
                         f".pth weights file, or 'hub'")
    if path.suffix.lower() == ".onnx":  # torch would report a refused pickle
        raise UsageError(f"--pretrained {said} is an ONNX model, which training cannot "
                         f"start from; pass the model.safetensors beside it (an accel-train "
                         f"export holds both)")
    check_weights_file(path, f"--pretrained {said}", "fetch or copy it again")
    state = torch.random.get_rng_state()
    try:
        # timm loads the file and drops its classifier where our class count differs from
        # the pretrained_cfg's, which head_overlay sets from the file (pretrained_file.py)
        model = timm.create_model(name, pretrained=True,
                                  pretrained_cfg_overlay=dict(file=str(path), **head_overlay),
                                  **kwargs)
    except (RuntimeError, KeyError, ValueError, OSError) as err:
        raise UsageError(f"--pretrained {said}: does not fit model {name} "
                         f"({first_line(err, 200)}); pass weights saved from "
                         f"{name}") from None
    # timm loads another network's file without a word where no key name matches (it logs the
    # unexpected keys and keeps the random weights): the same random start, built again,
    # shows which weights the file gave.
    after = torch.random.get_rng_state()
    torch.random.set_rng_state(state)
    fresh = timm.create_model(name, pretrained=False, **kwargs)
    torch.random.set_rng_state(after)
    loaded = [k for k, v in fresh.state_dict().items()
              if v.is_floating_point() and not torch.equal(v, model.state_dict()[k])]
    if not loaded:
        raise UsageError(f"--pretrained {said}: none of its weights fit model {name} (no "
                         f"tensor of it was loaded: weights of another network); pass weights "
                         f"saved from {name}")
    return model


def _create_from_source(name: str, source: str, weights: bool, kwargs: dict) -> nn.Module:
    """timm reads the config (and with --pretrained hub the weights) from the Hub or the folder;
    what it cannot read is one line, not a traceback."""
    unreachable = hub_unreachable() if source == "hf-hub" else None
    if unreachable:
        refuse_uncached_repository(name, unreachable)
    try:
        return timm.create_model(name, pretrained=weights, **kwargs)
    except TypeError as err:
        if "drop_path_rate" in str(err):
            raise  # create_model says it
        failure = err
    except Exception as err:  # huggingface_hub's and timm's own errors, of many types
        failure = err
    what = f"{first_line(failure, 300)} ({type(failure).__name__})"
    if source == "hf-hub":
        files = "config.json and weights" if weights else "config.json"
        raise UsageError(f"--model {name}: timm could not get the model's {files} from the "
                         f"Hugging Face Hub: {what}; this needs network, or those files in the "
                         f"Hugging Face cache (HF_HOME) from an earlier download; with no "
                         f"network, copy the repository's folder here and pass --model "
                         f"local-dir:FOLDER") from None
    raise UsageError(f"--model {name}: timm cannot build the model in that folder: {what}; "
                     f"pass a folder in timm's format (an accel-train export)") from None


def pretrained_normalization(model: nn.Module) -> tuple[tuple, tuple]:
    cfg = getattr(model, "pretrained_cfg", {}) or {}
    return (tuple(cfg.get("mean", (0.485, 0.456, 0.406))),
            tuple(cfg.get("std", (0.229, 0.224, 0.225))))


def native_image_size(model: nn.Module) -> int:
    """The input size a network is built for: timm's pretrained_cfg, else a Hugging Face
    transformers config's image_size, else timm's usual 224."""
    timm_size = (getattr(model, "pretrained_cfg", None) or {}).get("input_size")
    if timm_size:
        return int(timm_size[-1])
    hf_size = getattr(getattr(model, "config", None), "image_size", None)
    if isinstance(hf_size, (list, tuple)) and hf_size:
        hf_size = hf_size[-1]
    return hf_size if isinstance(hf_size, int) and hf_size > 0 else 224


def weights_device(model: nn.Module) -> torch.device:
    """Where the model's weights are (the CPU for a network without any)."""
    for tensor in model.parameters():
        return tensor.device
    for tensor in model.buffers():
        return tensor.device
    return torch.device("cpu")


def probe_images(model: nn.Module, count: int, image_size: int, channels: int = 3) -> torch.Tensor:
    """A batch of zeros for the start's forward probes, on the model's device: a program may
    hand fit() a module it has moved to its GPU already (accelerator.prepare moves it to the
    run's device anyway), and CPU images would fail its forward as if the size were wrong."""
    return torch.zeros(count, channels, image_size, image_size, device=weights_device(model))


def cuda_index(device: torch.device) -> list[int]:
    """fork_rng's `devices` for a forward on `device`: its CUDA generator too, where it has one
    (dropout on a GPU draws from it)."""
    if device.type != "cuda":
        return []
    return [device.index if device.index is not None else torch.cuda.current_device()]


def check_float32_weights(model: nn.Module, name: str) -> None:
    """The run keeps float32 weights and computes in bf16 or fp16 under autocast (what
    --mixed-precision chooses); a network handed over in half or double precision would fail
    its first forward on float32 images, and be told of an image size that is not the cause."""
    others = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()
                     if p.is_floating_point() and p.dtype != torch.float32})
    if others:
        raise UsageError(f"--model {name} holds {' and '.join(others)} weights, and the run "
                         f"trains float32 weights (mixed precision computes in bf16 or fp16 "
                         f"under autocast): build it in float32 (model.float()); "
                         f"--mixed-precision bf16 gives half precision's speed")


def takes_size(model: nn.Module, image_size: int, channels: int = 3) -> bool:
    """Whether one forward of a [1, channels, S, S] batch goes through (eval mode, no
    gradients: BatchNorm's statistics stay as they are)."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(probe_images(model, 1, image_size, channels))
        return True
    except Exception:  # shape errors surface as RuntimeError, AssertionError, ValueError
        return False
    finally:
        model.train(was_training)


def builds_for_size(model: nn.Module) -> bool:
    """The network's class is built for an input size (timm's `img_size` argument)."""
    try:
        return "img_size" in inspect.signature(type(model).__init__).parameters
    except (TypeError, ValueError):  # a class whose signature Python cannot read
        return False


def size_that_works(model: nn.Module, image_size: int) -> Optional[int]:
    """The size a refusal of `image_size` names: the network's own where its class is built
    for a size (a run at that size builds it so), else the first of a few that this network
    takes, its own first; naming one that fails too (a network for 32 px told to try timm's
    default 224) only sent the user on, and where none works the forward itself is broken."""
    native = native_image_size(model)
    if builds_for_size(model):
        return native if native != image_size else None
    return next((size for size in dict.fromkeys((native, 224, 32, 64, 128, 256))
                 if size != image_size and takes_size(model, size)), None)


def check_first_forward(model: nn.Module, name: str, image_size: int, num_classes: int) -> None:
    """One tiny forward pass, so that a size the model cannot take, or an output other than a
    row of `num_classes` logits per image, is one line now: not a traceback at the first step
    or, for too many logits, never (cross-entropy takes them, top-5 counts classes that do not
    exist, and predict runs out of class names)."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            output = model(probe_images(model, 1, image_size))
    except Exception as err:  # shape errors surface as RuntimeError/AssertionError/ValueError
        if takes_size(model, image_size, channels=1):  # written for MNIST-like data
            raise UsageError(f"--model {name} takes 1-channel images, and the run feeds "
                             f"3-channel ones (grey images repeated to RGB): make its first "
                             f"layer take 3 channels (nn.Conv2d(3, ...); timm's in_chans=3)"
                             ) from None
        working = size_that_works(model, image_size)
        if working is None:  # no size helps (a forward that wants other arguments, a bug)
            raise UsageError(f"--model {name} failed on a [1, 3, {image_size}, {image_size}] "
                             f"batch of images ({type(err).__name__}: {first_line(err)}); fix "
                             f"the network's forward") from None
        raise UsageError(f"--image-size {image_size} does not work with {name} "
                         f"({type(err).__name__}: {first_line(err)}); try --image-size "
                         f"{working}, or fix the network's forward if the size is not the "
                         f"cause") from None
    finally:
        model.train(was_training)
    check_logits(model, name, output, image_size, num_classes, training=False)


def check_logits(model: nn.Module, name: str, output: Any, image_size: int, num_classes: int,
                 training: bool) -> None:
    """What a probe forward of `model` returned (through its logits hook, outputs.py) must be
    a row of `num_classes` floating-point logits per image, in eval mode and in train mode
    alike: the training step's loss and evaluation take it as that."""
    if isinstance(output, torch.Tensor) and not output.is_floating_point():
        raise UsageError(f"--model {name} gives {output.dtype} outputs; logits are floating "
                         f"point (cross-entropy and softmax need them): drop the cast to "
                         f"{output.dtype} from its forward")
    count = 2 if training else 1  # train_forward's two images: BatchNorm's minimum
    if not isinstance(output, torch.Tensor) or tuple(output.shape) != (count, num_classes):
        got = (f"a tensor of shape {list(output.shape)}" if isinstance(output, torch.Tensor)
               else f"a {type(output).__name__}")
        if not isinstance(output, torch.Tensor):
            fix = ("return the logits tensor, or an object holding it as `.logits` (or a dict, "
                   "as its \"logits\" entry)")
            if training:  # a plain tuple names neither its logits nor its auxiliary logits
                fix += (" in train mode too; a named tuple with fields logits and aux_logits "
                        "(as torchvision's Inception v3 returns) names auxiliary logits for "
                        "--aux-loss-weight")
        elif transformers_config_of(model) is not None:  # its head is sized by its config
            fix = (f"build it with num_labels={num_classes} (from_pretrained(..., num_labels="
                   f"{num_classes}, ignore_mismatched_sizes=True) replaces a pretrained head)")
        else:
            fix = "make its last layer give num_classes outputs"
        mode = " in train mode" if training else ""
        raise UsageError(f"--model {name} maps a [{count}, 3, {image_size}, {image_size}] "
                         f"batch of images{mode} to {got}, not to [{count}, {num_classes}] "
                         f"logits (one per class of the data); {fix}")


def check_train_forward(model: nn.Module, name: str, image_size: int, num_classes: int) -> None:
    """A forward in train mode too, where a network may compute more than in eval mode:
    torchvision's Inception v3 runs its auxiliary head, which needs larger images than the
    rest (at 80 px its pooling has a 3x3 map to pool 5x5), so the run passed the eval-mode
    check and ended in a traceback at the speed probe or the first step.  A refusal names the
    first larger size that trains, where one of a few tried does.  What it returns is held to
    the eval-mode rule (check_logits): a network returning a plain tuple (logits, aux) in
    train mode only failed at the first loss, after the run folder was written."""
    output, err = train_forward(model, image_size)
    if err is None:
        check_logits(model, name, output, image_size, num_classes, training=True)
        return
    larger = next((size for size in larger_sizes(image_size, native_image_size(model))
                   if train_forward_error(model, size) is None), None)
    fix = (f"it trains at --image-size {larger}" if larger else
           "try a larger --image-size")
    raise UsageError(f"--model {name} takes [N, 3, {image_size}, {image_size}] images in eval "
                     f"mode but fails in train mode ({type(err).__name__}: {first_line(err)}): "
                     f"a part only training runs (an auxiliary head) needs other images; {fix}")


def keep_auxiliary_losses(model: nn.Module, name: str, image_size: int, weight: float) -> None:
    """--aux-loss-weight: the auxiliary logits of `model`'s train-mode forwards kept for the
    training step's loss (outputs.py).  A network with none is refused: the flag would change
    nothing, and a user who set it believes their auxiliary heads train."""
    if not weight:
        return
    kept = keep_auxiliary_logits(model)
    train_forward_error(model, image_size)  # check_train_forward saw it pass
    if not kept.take():
        raise UsageError(f"--aux-loss-weight {weight:g}: --model {name} returns no auxiliary "
                         f"logits in train mode (torchvision's inception_v3 and googlenet, "
                         f"built with aux_logits=True, do); drop the flag")


@contextmanager
def probing(model: nn.Module, training: bool) -> Iterator[None]:
    """A probe forward in train or eval mode that leaves no trace: the mode, the buffers it
    updates (BatchNorm's statistics) and the random state (dropout) are put back."""
    saved = {key: buffer.clone() for key, buffer in model.named_buffers()}
    was_training = model.training
    model.train(training)
    try:
        with torch.random.fork_rng(devices=cuda_index(weights_device(model))):
            yield
    finally:
        model.train(was_training)
        with torch.no_grad():
            for key, buffer in model.named_buffers():
                buffer.copy_(saved[key])


def train_forward(model: nn.Module, image_size: int) -> tuple[Any, Optional[Exception]]:
    """What a train-mode forward of two images of `image_size` returns, or else raises
    (BatchNorm in train mode needs more than one value per channel), leaving no trace
    (probing)."""
    try:
        with probing(model, training=True), torch.no_grad():
            return model(probe_images(model, 2, image_size)), None
    except Exception as err:  # as in check_first_forward
        return None, err


def train_forward_error(model: nn.Module, image_size: int) -> Optional[Exception]:
    """What a train-mode forward of two images of `image_size` raises, if anything."""
    return train_forward(model, image_size)[1]


def larger_sizes(image_size: int, native_size: int) -> list[int]:
    """The sizes a refusal tries, smallest first: the network's own (timm's pretrained_cfg, a
    transformers config; 224 otherwise), Inception's 299, and twice and four times the run's,
    up to 1024 px (a CPU forward of two images each: only when the run is refused anyway)."""
    return sorted({size for size in (native_size, 299, 2 * image_size, 4 * image_size)
                   if image_size < size <= 1024})


def check_trainable(num_trainable: int, name: str) -> None:
    """A network with nothing to train (every parameter frozen, or none at all) is one line,
    not the optimizer's "empty parameter list" traceback.  (--freeze-backbone refuses a
    classifier without parameters itself.)"""
    if num_trainable == 0:
        raise UsageError(f"--model {name} has no trainable parameters (none with "
                         f"requires_grad=True); nothing would train")


def unused_parameters(model: nn.Module, image_size: int) -> list[str]:
    """The trainable parameters one train-mode forward and backward pass leaves without a
    gradient.  DDP waits for a gradient of each at every step and fails at the second
    ("Expected to have finished reduction ..."), unless told to look for them
    (find_unused_parameters, which costs a graph walk each step).  Train mode, as the steps
    run: a layer only eval mode uses (a calibration after the head) gets no gradient in
    training, and an eval-mode probe took it for used.  Two images (BatchNorm's minimum in
    train mode); probing puts the statistics and the random state back, and the gradients
    are dropped again.  Where --aux-loss-weight keeps a network's auxiliary logits, their
    loss reaches the auxiliary heads: DDP, told to look for unused parameters, would take
    those heads for unused (it looks from the logits the forward returns) and fail when the
    auxiliary loss's gradient reaches them ("Expected to mark a variable ready only once")."""
    try:
        with probing(model, training=True), torch.enable_grad():
            output = model(probe_images(model, 2, image_size))
            total = output.float().sum()
            for logits in kept_auxiliary_logits(model):
                total = total + logits.float().sum()
            total.backward()
        unused = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    finally:
        for param in model.parameters():
            param.grad = None
    return unused


def check_layer_decay(model: nn.Module, name: str, layer_decay: Optional[float]) -> None:
    """--layer-decay groups the parameters by timm's layers: through the model's
    group_matcher(), else by its pretrained_cfg's classifier (timm.optim's layer grouping).
    A network with neither gets one layer, and the flag would change nothing (timm only logs
    that): one line now instead."""
    if layer_decay is None or callable(getattr(model, "group_matcher", None)):
        return
    if (getattr(model, "pretrained_cfg", None) or {}).get("classifier"):
        return
    raise UsageError(f"--layer-decay {layer_decay:g}: --model {name} names no layers for it "
                     f"(timm groups layers through a group_matcher() method or a "
                     f"pretrained_cfg['classifier'], as timm's models have); drop --layer-decay, "
                     f"or give the network a group_matcher()")


def freeze_backbone(model: nn.Module) -> int:
    """Leave only the classifier trainable; returns the number of trainable parameters."""
    # timm's interface for the head; a user's network may offer the same method
    if callable(getattr(model, "get_classifier", None)):
        classifier = model.get_classifier()
    else:
        classifier = transformers_classifier(model)
    if classifier is None:
        raise UsageError("--freeze-backbone: this model has no get_classifier() method (timm's "
                         "way to name the classifier; transformers' classifiers name it "
                         "`classifier`); give your network one that returns its head, or drop "
                         "--freeze-backbone")
    if not isinstance(classifier, nn.Module) or not any(True for _ in classifier.parameters()):
        raise UsageError("--freeze-backbone: this model has no separate classifier to train")
    for param in model.parameters():
        param.requires_grad_(False)
    for param in classifier.parameters():
        param.requires_grad_(True)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def set_train_mode(model: nn.Module, backbone_frozen: bool) -> None:
    """model.train(), but a frozen backbone keeps its BatchNorm statistics fixed too: transfer
    learning with frozen features should not drift the features' normalization."""
    model.train()
    if backbone_frozen:
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.eval()


def build_from_spec(spec: ModelSpec) -> nn.Module:
    """The trained network's architecture, through the name it was trained with (a user's
    factory is imported again: one line naming the module when it is not importable here), its
    float32 layers as the run computed them."""
    if spec.model_name.partition(":")[0] == "__main__":
        raise UsageError(f"the model is {spec.model_name}, a class that the script which "
                         f"trained it defined in itself, and no other program can import it; "
                         f"move the class into a module the script imports (then it is "
                         f"recorded by that module's name) and train again, or load "
                         f"model.safetensors into the class in your own code")
    if is_import_path(spec.model_name) or timm_source(spec.model_name):
        check_model_name(spec.model_name, "the model was trained with --model")
    elif not timm.is_model(spec.model_name):
        raise UsageError(f"the model's architecture {spec.model_name!r} is not in this timm's "
                         f"registry (timm {timm.__version__}); "
                         f"{unknown_architecture_hint(spec.model_name)}")
    model = create_model(spec.model_name, spec.num_classes, spec.drop_rate,
                         model_args=spec.model_args)
    compute_in_float32(model, spec.float32_layers)
    return model
