"""The one typed training configuration.

Every training option is a field of `TrainConfig`; the command line (cli.py) and the optional run
YAML (`--config run.yaml`) are generated from these fields, so there is no second dictionary of
hyperparameters anywhere.  `__post_init__` validates values and raises `UsageError` with a message
that names the flag and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

from accel_train.base.errors import UsageError, did_you_mean
from accel_train.base.readers import read_yaml

PRECISIONS = ("auto", "no", "fp16", "bf16")
IN_MEMORY_MODES = ("auto", "always", "never")
DATA_ON_DEVICE_MODES = ("auto", "always", "never")
BAD_IMAGE_MODES = ("substitute", "error")
TTA_MODES = ("none", "flip", "flip-translate")
SAMPLE_SUBSETS = ("random", "first")  # data/sample_limits.py
FLIP_MODES = ("random", "alternate")
# timm's names (timm.data.transforms.str_to_interp_mode) for the resize of images above 64 px;
# training may also draw bilinear or bicubic per image ("random", timm's train.py default).
INTERPOLATIONS = ("bilinear", "bicubic", "nearest", "box", "hamming", "lanczos")
TRAIN_INTERPOLATIONS = ("random", *INTERPOLATIONS)
CROP_MODES = ("center", "squash", "border")  # timm's eval crop modes (pretrained_cfg crop_mode)
LR_DECAYS = ("cosine", "linear")  # optim.Schedule's decays
EVAL_METRICS = ("top1", "top5", "loss", "mean_class_top1")  # train/selection.py
CLASS_WEIGHTS = ("none", "balanced")  # data/class_weights.py
SYNTHETIC_DATASET = "synthetic"


def option(default, help: str, group: str, flags: tuple[str, ...] = (), **kw):
    """A config field with what the CLI needs to expose it.

    `flags` are extra spellings; every field also gets --dash-name and --underscore_name.
    `draws_random=True` marks an option that makes training draw random numbers: the resume
    matrix (tests/test_resume_matrix.py) must turn it on, or a test fails.
    """
    meta = {"help": help, "group": group, "flags": flags, **kw}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class TrainConfig:
    # -- data ---------------------------------------------------------------------------------
    dataset: str = option(SYNTHETIC_DATASET, "Hugging Face hub dataset id, or 'synthetic' for the "
                          "embedded generated dataset (no download).", "data")
    data_dir: Optional[str] = option(None, "Local data: a folder of parquet files (train/test), a "
                                     "datasets save_to_disk folder, or an image folder (class "
                                     "subfolders, optionally under train/ val/ test/). Overrides "
                                     "--dataset.", "data")
    image_column: Optional[str] = option(None, "Image column (default: found by name/type).",
                                         "data")
    label_column: Optional[str] = option(None, "Label column (default: found by name/type).",
                                         "data")
    val_fraction: float = option(0.1, "Fraction of train carved off (deterministically, seed 0) "
                                 "for validation when the data has no validation split (a test "
                                 "split is then kept for one evaluation at the end; a class it "
                                 "would hold out whole keeps one image for training).", "data")
    val_stratify: bool = option(False, "Carve --val-fraction class by class (scikit-learn's "
                                "stratify=): each class holds out one image at least and about "
                                "its share of the rest, so validation measures every class in "
                                "about the data's balance; without it, one random draw over all "
                                "images. A class of one image trains.", "data")
    select_on_test: bool = option(False, "With only train and test splits, use the test split "
                                  "for validation and selection (best checkpoints, EMA or raw "
                                  "weights) instead of carving --val-fraction from train; the "
                                  "summary says so.", "data")
    max_train_samples: Optional[int] = option(None, "Use only N of the training images (which "
                                              "ones: --sample-subset).", "data")
    max_eval_samples: Optional[int] = option(None, "Use only N of the held-out images, and N of "
                                             "the test split's (which ones: --sample-subset).",
                                             "data")
    sample_subset: str = option("random", "Which images --max-train-samples and "
                                "--max-eval-samples keep: 'random', the ones "
                                "split.shuffle(seed=0).select(range(N)) keeps in Hugging Face "
                                "datasets (every class in about its share; the same images for "
                                "every --seed), or 'first', the first N in the data's order (an "
                                "image folder lists its images class by class).", "data",
                                choices=SAMPLE_SUBSETS)
    tta: str = option("none", "Test-time augmentation in evaluations: 'flip' also evaluates each "
                      "image mirrored and averages the two logits; 'flip-translate' adds both "
                      "views shifted one pixel up-left and down-right (6 passes, airbench's "
                      "level 2). Recorded with the model; accel-train eval and predict do the "
                      "same.", "data", choices=TTA_MODES)
    synthetic_train_size: int = option(4000, "Training images in the synthetic dataset.", "data")
    in_memory: str = option("auto", "Decode images once into memory and augment tensors "
                            "(auto: when the data fits in --in-memory-limit-gb and images share a "
                            "size).", "data", choices=IN_MEMORY_MODES)
    in_memory_limit_gb: float = option(8.0, "Memory budget for --in-memory auto.", "data")
    data_on_device: str = option("auto", "Hold the training images on the device and draw "
                                 "each batch there (crop, flip and erasing too): no copy of "
                                 "images per step; loader workers draw --reprob's erasing "
                                 "plans. Photographs (above 64 px) are decoded there once, at "
                                 "the start, and cropped, flipped and colour-jittered there as "
                                 "--decode-on-device would. auto: on a CUDA device, for data "
                                 "without --auto-augment (and with --reprob, with loader "
                                 "workers) whose decoded pixels fit in a tenth of its memory "
                                 "(photographs: JPEG files, or arrays, where cropping them "
                                 "there trains faster than decoding them every epoch, timed "
                                 "at the start); always: whenever the "
                                 "images allow (on a CPU too); never: a DataLoader. The same "
                                 "batches either way. Where the training images are held "
                                 "there, the held-out batches are kept there after the first "
                                 "evaluation if they fit beside them.", "data",
                                 choices=DATA_ON_DEVICE_MODES)
    decode_on_device: str = option("auto", "Decode the training JPEGs on the GPU (nvJPEG) and "
                                   "crop, flip and colour-jitter them there, the loader workers "
                                   "only reading the files: the same crops as the workers' "
                                   "path, pixels within the decoders' rounding. auto: on a CUDA "
                                   "device, for image files above 64 px, when timing both "
                                   "paths at the start shows the workers cannot keep up; "
                                   "always: whenever the data allows (on a CPU too, with "
                                   "libjpeg-turbo); never: the loader workers. The decoder: "
                                   "torchvision's, else TorchCodec's where installed.",
                                   "data", choices=DATA_ON_DEVICE_MODES)
    host_decode_share: Optional[float] = option(
        None, "Where the training JPEGs are decoded on the device (--decode-on-device), the "
        "share of each batch's JPEGs the loader workers decode anyway (0.25: every fourth), so "
        "that cores the device path leaves idle take work off the GPU (default: the share "
        "auto weighs from its timings; 0 with always). The same crops either way; those "
        "images' pixels are the workers' path's.", "data")
    num_workers: Optional[int] = option(None, "DataLoader worker processes per process (default: "
                                        "on a CPU, 0 for in-memory data, else min(4, cpus per "
                                        "process); on a GPU, the process's cores but one).",
                                        "data")
    prefetch_factor: int = option(2, "Batches each worker prepares ahead.", "data")
    persistent_workers: bool = option(True, "Keep loader workers alive across epochs.", "data")
    loader_timeout: float = option(600.0, "Seconds to wait for a batch from the loader workers "
                                   "(0: forever). A worker stuck reading a file names it "
                                   "before then; the run then exits 75. A file the training "
                                   "process reads itself (decoding in memory at the start, "
                                   "--num-workers 0) gets as long, then the run stops in one "
                                   "line naming it, exit 75.", "data")
    bad_images: str = option("substitute", "An image that cannot be decoded: substitute (train "
                             "on with the next image that decodes in its place; each is named "
                             "once and listed in <output-dir>/bad_images.txt) or error (stop, "
                             "naming it).", "data", choices=BAD_IMAGE_MODES)
    val_labels: Optional[str] = option(None, "Label file for a held-out folder of unlabelled "
                                       "images (ImageNet's validation layout: DIR/train/CLASS/"
                                       "IMAGE and DIR/val/IMAGE): 'IMAGE,CLASS' lines (CSV or "
                                       "whitespace) or one CLASS per line in file-name order.",
                                       "data")
    train_labels: Optional[str] = option(None, "Label file for training images not sorted into "
                                         "class folders (DIR/IMAGE or DIR/train/IMAGE, as "
                                         "Kaggle hands out train.csv beside train/): "
                                         "'IMAGE,CLASS' lines (CSV, a header line allowed, or "
                                         "whitespace), IMAGE a path, a file name or a file name "
                                         "without its extension; the classes are the file's "
                                         "labels (whole numbers in their order).", "data")
    class_depth: Optional[int] = option(None, "Image folders: the folder level under the split "
                                        "folder that names the class (1: the top level; "
                                        "default: the folder that holds the image).", "data")
    streaming: bool = option(False, "Stream the training data from shards (WebDataset tars "
                             "or parquet files in --data-dir; implied by a folder written by "
                             "accel-train shard or holding *.tar, *.tar.gz or *.tgz) instead of "
                             "indexing it whole.",
                             "data")
    shuffle_buffer: int = option(1000, "Streaming: samples each loader worker holds to shuffle "
                                 "within (memory is bounded by it).", "data")
    eval_shards: Optional[str] = option(None, "Streaming: glob (relative to --data-dir) of the "
                                        "shards held out for evaluation (default: the index's "
                                        "held-out split).", "data")
    augment: bool = option(True, "Random crop + horizontal flip on training images "
                           "(--no-augment turns it off, with what follows).", "data",
                           draws_random=True)
    crop_pad: Optional[int] = option(None, "How far the training crop may shift an image of "
                                     "64 px or less, in pixels (it reflect-pads by this much, "
                                     "then crops at a random offset): shorter runs want less, "
                                     "e.g. 2 at 32 px (airbench). Not set: the image size / 8 "
                                     "(4 px at 32). Larger images take a random resized crop "
                                     "instead.", "data", draws_random=True)
    flip: str = option("random", "The training augmentation's horizontal flip: random (each "
                       "image mirrored with probability 1/2 in every epoch) or alternate (a "
                       "random half mirrored in even epochs, the other half in odd ones, so "
                       "each image is seen both ways every two epochs; airbench).", "data",
                       choices=FLIP_MODES, draws_random=True)
    auto_augment: Optional[str] = option(None, "An augmentation policy after the crop and flip: "
                                         "torchvision's randaugment, trivialaugment, autoaugment"
                                         "[-cifar10|-svhn], augmix, or a timm string such as "
                                         "rand-m9-mstd0.5-inc1 (--aa: timm's spelling).", "data",
                                         flags=("--aa",), draws_random=True)
    reprob: float = option(0.0, "Random erasing probability (timm's RandomErasing, per-pixel "
                           "noise), after normalization.", "data", draws_random=True)
    # Images above 64 px (transforms.SMALL_IMAGE) train through timm's own training transform
    # and are evaluated through its eval transform: timm's train.py flags, spellings and
    # defaults (docs/data.md).  At 64 px or less the pad-and-crop path above stays as it is.
    scale: list = option([0.08, 1.0], "Images above 64 px: the random resized crop's area, as a "
                         "range of fractions of the image's (timm's --scale; 0.08 1 is timm's "
                         "and torchvision's ImageNet recipe).", "data", nargs=2,
                         draws_random=True)
    ratio: list = option([3 / 4, 4 / 3], "Images above 64 px: the range of the crop's aspect "
                         "ratio, width / height, drawn log-uniformly (timm's --ratio). "
                         "(default: 3/4 4/3)", "data", nargs=2, draws_random=True)
    hflip: float = option(0.5, "Probability that a training image is mirrored left-right "
                          "(timm's --hflip), at any size, under --flip random; --flip "
                          "alternate mirrors exactly half of them each epoch and takes only "
                          "0.5. 0: never.", "data", draws_random=True)
    vflip: float = option(0.0, "Images above 64 px: probability that a training image is "
                          "turned upside down (timm's --vflip).", "data", draws_random=True)
    color_jitter: float = option(0.4, "Images above 64 px: brightness, contrast and saturation "
                                 "each scaled by a random factor in [1 - x, 1 + x] "
                                 "(torchvision's ColorJitter, timm's --color-jitter and its "
                                 "default); 0: off. Off with --auto-augment, as in timm (a "
                                 "'3a' policy keeps it).", "data", draws_random=True)
    # Not draws_random: its draws (random picks bilinear or bicubic per image) are the crop's,
    # already on in the resume matrix by default.
    train_interpolation: str = option("random", "Images above 64 px: how the training crop is "
                                      "resized: random (bilinear or bicubic, drawn per image: "
                                      "timm's train.py default) or one interpolation.", "data",
                                      choices=TRAIN_INTERPOLATIONS)
    interpolation: Optional[str] = option(None, "Held-out images (and eval, predict, the "
                                          "export's config): the resize's interpolation. Not "
                                          "set: the model's (timm's pretrained_cfg); bilinear "
                                          "when the images are 64 px or less.", "data",
                                          choices=INTERPOLATIONS)
    crop_pct: Optional[float] = option(None, "Held-out images: the centre crop's share of the "
                                       "resized image (timm's crop_pct: resized to size / "
                                       "crop_pct, the size cropped out). Not set: the model's "
                                       "(pretrained_cfg, e.g. 0.875); 1 when the images are "
                                       "64 px or less.", "data")
    crop_mode: Optional[str] = option(None, "Held-out images: center (the shorter side "
                                      "resized to size / crop_pct, the centre cropped), squash "
                                      "(both sides, the aspect not kept) or border (the longer "
                                      "side, padded with the mean colour), as timm's eval "
                                      "transform. Not set: the model's (usually center); "
                                      "squash when the images are 64 px or less.", "data",
                                      choices=CROP_MODES)
    mean: Optional[list] = option(None, "The per-channel mean images are normalized with, R G B "
                                  "(or one value for all three), on pixels scaled to [0, 1] "
                                  "(timm's --mean). Not set: the pretrained weights' with "
                                  "--pretrained, else the training images'. A network handed "
                                  "to fit() with weights of its own takes its own here (timm's "
                                  "model.pretrained_cfg['mean'], a transformers image "
                                  "processor's image_mean).", "data", nargs="+")
    std: Optional[list] = option(None, "The per-channel standard deviation images are divided "
                                 "by, as --mean (timm's --std). Not set: chosen as --mean's.",
                                 "data", nargs="+")

    # -- model --------------------------------------------------------------------------------
    model: str = option("resnet18", "A timm model name (also timm's hf-hub:OWNER/NAME and "
                        "local-dir:FOLDER), or your own network as the import path "
                        "package.module:factory, called with num_classes= (and drop_rate= or "
                        "drop_path_rate= when those flags ask); its module must be importable "
                        "(on PYTHONPATH or installed) wherever the run trains, resumes, or is "
                        "evaluated or exported.", "model")
    smaller_models: list = option([], "With --time-budget: networks to train instead of --model "
                                  "when the budget cannot hold --min-budget-epochs of it, "
                                  "largest first. At the start each is timed on this machine in "
                                  "turn (as --mixed-precision auto times) and the first that "
                                  "gets that many epochs is trained (else the fastest); the "
                                  "run's config.yaml records the one chosen and a resumed run "
                                  "keeps it.", "model", nargs="*")
    min_budget_epochs: Optional[float] = option(None, "With --smaller-models: the fewest epochs "
                                                "the --time-budget must hold of a network for "
                                                "it to be trained (estimated from one timed "
                                                "step at the start: an upper bound).", "model")
    image_size: Optional[int] = option(None, "Input resolution (default: the images' own "
                                       "size where they share one, up to 224; else 224).",
                                       "model")
    pretrained: Optional[str] = option(None, "Pretrained weights: a local .safetensors/.pth file, "
                                       "or 'hub' for timm's hub weights (needs network or cache; "
                                       "the flag alone means hub, as timm's train.py's "
                                       "--pretrained does).", "model", bare="hub")
    freeze_backbone: bool = option(False, "Train only the classifier head (transfer learning).",
                                   "model")
    sync_bn: bool = option(False, "Synchronize BatchNorm statistics across processes (gloo on "
                           "CPU, torch SyncBatchNorm on CUDA).", "model",
                           flags=("--sync_batchnorm",))
    channels_last: Optional[bool] = option(None, "channels_last memory format for images and "
                                           "model. Not set (auto): on a CPU, the faster of the "
                                           "two for this model, timed at the start; on CUDA, "
                                           "on in fp16/bf16 with tensor cores, else off. "
                                           "(default: auto)", "model")
    whiten_stem: bool = option(False, "Initialize the first convolution as a whitening of the "
                               "training images' patches (eigenvectors of their covariance, "
                               "scaled; each filter with its negative), as airbench does: "
                               "decorrelated inputs from the first step. Any model whose first "
                               "layer is a plain convolution. When every filter of it is "
                               "whitened, its weights stay fixed (as airbench's; its bias "
                               "trains).", "model")
    whiten_bias_epochs: Optional[int] = option(None, "With --whiten-stem: the whitened layer's "
                                               "bias trains for this many epochs, then stays "
                                               "where it is (airbench: 3). Not set: it trains "
                                               "the whole run.", "model")
    bn_momentum: Optional[float] = option(None, "Momentum of every BatchNorm layer's running "
                                          "statistics (torch's convention: the weight of the "
                                          "newest batch; 0.1 is torch's default). Short runs "
                                          "evaluate better with more, e.g. 0.4 (airbench). Not "
                                          "set: the model's own.", "model")
    drop_rate: float = option(0.0, "Dropout before the classifier.", "model", draws_random=True)
    model_ema: bool = option(False, "Keep an exponential moving average of the weights (timm's "
                             "ModelEmaV3), evaluated every epoch beside the raw model; the "
                             "export is the better of the two on the held-out split.", "model")
    model_ema_decay: float = option(0.9998, "EMA decay per optimizer step (closer to 1: a "
                                    "longer memory; ~1 - 1/(a tenth of the steps)).", "model")
    drop_path: float = option(0.0, "Stochastic depth: the rate at which residual blocks are "
                              "dropped in training (timm's drop_path_rate).", "model",
                              draws_random=True)
    compile: bool = option(False, "torch.compile the model (inductor; after DDP wrapping, through "
                           "Accelerate). The first steps pay the compilation.", "model")

    # -- optimization -------------------------------------------------------------------------
    epochs: int = option(10, "Training epochs.", "optimization")
    batch_size: int = option(64, "Batch size PER PROCESS (global batch = batch_size x processes "
                             "x accumulation_steps).", "optimization")
    learning_rate: float = option(0.05, "Peak learning rate (after warmup).", "optimization",
                                  flags=("--lr",))
    optimizer: str = option("sgd", "Any optimizer of timm's create_optimizer_v2: sgd (Nesterov), "
                            "momentum, adamw, lamb, lars, lion, ... (timm.optim."
                            "list_optimizers()); lookahead_NAME wraps one in timm's Lookahead. "
                            "Norms and biases get no weight decay (--decay-norm-and-bias).",
                            "optimization")
    momentum: float = option(0.9, "Momentum of the optimizers that have one (SGD: Nesterov); "
                             "in [0, 1).",
                             "optimization")
    layer_decay: Optional[float] = option(None, "Layer-wise learning-rate decay for fine-tuning "
                                          "(timm): each layer's rate is this times the next "
                                          "one's, the head keeps the peak (e.g. 0.75).",
                                          "optimization")
    weight_decay: float = option(5e-4, "Weight decay.", "optimization")
    decay_norm_and_bias: bool = option(False, "Weight decay on biases and normalization "
                                       "parameters too, as airbench decays every parameter "
                                       "(timm's recipes, and this default, exempt them). The "
                                       "normalization shifts' decay is divided by "
                                       "--norm-bias-lr-scale: the same decay per step as the "
                                       "other weights.", "optimization")
    lookahead_every: int = option(0, "Every K optimizer steps, move a slow copy of the weights "
                                  "towards the trained ones and go on from it, more strongly as "
                                  "the run nears its end (airbench's Lookahead-style averaging, "
                                  "K=5); the model takes the slow copy when training ends. 0: "
                                  "off. Not --optimizer lookahead_NAME (a fixed halfway pull).",
                                  "optimization")
    norm_bias_lr_scale: float = option(1.0, "Learning-rate multiplier for the shifts (biases) "
                                       "of normalization layers (BatchNorm, GroupNorm, "
                                       "LayerNorm), the warmup and decay applying to it as to "
                                       "the rest: airbench trains them 64x faster than the "
                                       "convolutions, whose BatchNorm makes them scale-free.",
                                       "optimization")
    warmup_epochs: float = option(1.0, "Linear warmup length in epochs (may be fractional); "
                                  "the decay (--lr-decay) follows.", "optimization")
    warmup_fraction: Optional[float] = option(None, "Warmup length as a share of the whole "
                                              "run (0.2: its first fifth), instead of "
                                              "--warmup-epochs. With --time-budget it follows "
                                              "the fitted length, so a recipe's warmup is the "
                                              "same share of the run on a slow machine as on "
                                              "a fast one.", "optimization")
    warmup_start_factor: float = option(0.0, "The fraction of the peak learning rate warmup "
                                        "rises from (airbench: 0.2).", "optimization")
    lr_decay: str = option("cosine", "The learning rate's decay after warmup, to "
                           "--final-lr-factor at the end: cosine, or linear (airbench's "
                           "triangle, with --warmup-start-factor 0.2 --final-lr-factor 0.07).",
                           "optimization", choices=LR_DECAYS)
    final_lr_factor: float = option(0.0, "The fraction of the peak learning rate the decay ends "
                                    "at.", "optimization")
    label_smoothing: float = option(0.1, "Label smoothing for the cross-entropy loss.",
                                    "optimization")
    class_weight: str = option("none", "balanced: weigh each class's training loss by "
                               "n_images / (n_classes x its images), scikit-learn's "
                               "class_weight='balanced', for classes of very different sizes "
                               "(the held-out loss stays unweighted); none: every image alike.",
                               "optimization", choices=CLASS_WEIGHTS)
    aux_loss_weight: float = option(0.0, "Add this times the loss of each auxiliary classifier "
                                    "to the training loss: torchvision's inception_v3 and "
                                    "googlenet return auxiliary logits in train mode (its "
                                    "fine-tuning tutorial weighs Inception's 0.4, GoogLeNet's "
                                    "paper 0.3). 0: the auxiliary heads do not train.",
                                    "optimization")
    mixup: float = option(0.0, "Mixup alpha (timm's Mixup on the batch; 0: off; 0.8 is usual). "
                          "Targets become soft; the loss follows.", "optimization",
                          draws_random=True)
    cutmix: float = option(0.0, "CutMix alpha (0: off; 1.0 is usual). With --mixup too, each "
                           "batch picks one (see --mixup-switch-prob).", "optimization",
                           draws_random=True)
    mixup_prob: float = option(1.0, "Probability that a batch is mixed at all.",
                               "optimization")
    mixup_switch_prob: float = option(0.5, "With both on: probability of CutMix over Mixup.",
                                      "optimization")
    grad_clip: Optional[float] = option(None, "Clip the gradient norm to this value.",
                                        "optimization")
    accumulation_steps: int = option(1, "Micro-batches per optimizer step (gradient "
                                     "accumulation).", "optimization",
                                     flags=("--gradient_accumulation_steps",))
    mixed_precision: str = option("auto", "Mixed precision. auto: fp16 on CUDA GPUs (tensor "
                                  "cores); on a CPU, fp32 without native bf16 (AVX512-BF16 or "
                                  "AMX), else the faster of fp32 and bf16 for this model, timed "
                                  "at the start (a resumed run keeps its choice); no: fp32. "
                                  "Under accelerate launch, its config's bf16 counts as asked "
                                  "and its no and fp16 as not chosen (auto), because accelerate "
                                  "exports no when nobody chose and auto is already fp16 on a "
                                  "GPU, the only place fp16 runs. An explicit fp16 without CUDA "
                                  "says so and trains in fp32. (default: auto)", "optimization",
                                  choices=PRECISIONS)
    max_steps: Optional[int] = option(None, "Stop after this many optimizer steps.",
                                      "optimization")
    time_budget: Optional[str] = option(None, "Wall-clock training budget (600, 90s, 10m, 1h): "
                                        "the run measures its step time after a few steps and "
                                        "fits the whole schedule, warmup to the end of the "
                                        "decay, into it (instead of --epochs: not both; "
                                        "--epochs typed over a --config file's budget "
                                        "replaces it), its evaluations included, the final "
                                        "one too.",
                                        "optimization")
    seed: int = option(0, "Seed for model init, data order and augmentation.", "optimization")

    # -- output and checkpoints ---------------------------------------------------------------
    output_dir: Optional[str] = option(None, "Run directory (default: runs/<timestamp>).",
                                       "output")
    checkpoint: Optional[str] = option(None, "Checkpoint directory (default: "
                                       "<output-dir>/checkpoints).", "output",
                                       flags=("--checkpoint-dir", "--checkpoint_dir"))
    checkpoint_every: int = option(0, "Also checkpoint every N optimizer steps (0: only at "
                                   "epoch ends).", "output")
    checkpoint_minutes: float = option(0.0, "At epoch ends, checkpoint only where M minutes or "
                                       "more have passed since the last checkpoint (0: at "
                                       "every epoch end): short epochs on a fast GPU then "
                                       "wait for no save at each end. The run's last step, a "
                                       "stop signal, --checkpoint-every and a new best under "
                                       "--keep-best still save.", "output")
    keep_checkpoints: int = option(3, "Keep the newest K checkpoints.", "output")
    keep_best: int = option(0, "Also keep the K checkpoints with the best held-out "
                            "--eval-metric (saved at epoch ends; with --model-ema the better of "
                            "the raw and the EMA weights'), as timm's checkpoint saver does.",
                            "output")
    eval_metric: str = option("top1", "The held-out number that picks the best: the checkpoints "
                              "--keep-best keeps, the raw or the EMA weights (--model-ema) for "
                              "model.safetensors, the best the run reports (timm's "
                              "--eval-metric). mean_class_top1, the mean of the classes' top-1, "
                              "for classes of very different sizes; loss: lower is better.",
                              "output", choices=EVAL_METRICS)
    resume: Optional[str] = option(None, "'auto' (the newest valid checkpoint of this run), or a "
                                   "path: a step_XXXXXXXX checkpoint, a folder of them (its "
                                   "newest valid one), or a run folder.", "output")
    log_every: int = option(20, "Log a metrics line every N optimizer steps (and at the end of an "
                                 "epoch none of whose steps fell on it).", "output")
    eval_every: int = option(1, "Evaluate on the held-out split at every Nth epoch end, and "
                             "always at the last (0: only at the last). A time budget counts "
                             "only the evaluations that will run; an epoch end without one "
                             "still checkpoints, and --keep-best skips its checkpoint.",
                             "output")
    report_to: list = option([], "Trackers through accelerate: tensorboard (files in "
                             "<output-dir>/trackers), wandb, mlflow, ..., or all that are "
                             "installed; metrics.jsonl is always written.", "output", nargs="*")
    plots: bool = option(True, "Write PNG curves (loss, learning rate, accuracy, throughput) to "
                         "<output-dir>/plots at the end; `accel-train plot RUN` redraws them.",
                         "output")
    progress: str = option("auto", "Progress display: bar, log lines, or auto (bar on a "
                           "terminal).", "output", choices=("auto", "bar", "log"))

    # -- the seed manual's distributed flags: checked against the launcher, never ignored -------
    world_size: Optional[int] = option(None, "Expected total number of processes (checked "
                                       "against the launcher's WORLD_SIZE).", "distributed")
    rank: Optional[int] = option(None, "Expected global rank of this process (checked against "
                                 "the launcher's RANK).", "distributed")
    local_rank: Optional[int] = option(None, "Set by python -m torch.distributed.launch; checked "
                                       "against LOCAL_RANK.", "distributed")
    gpu_ids: Optional[str] = option(None, "Comma-separated GPU ids this machine's processes use "
                                    "(local rank i uses the i-th).", "distributed")
    dist_url: Optional[str] = option(None, "tcp://HOST:PORT of the rank-0 machine (checked "
                                     "against MASTER_ADDR/MASTER_PORT).", "distributed")
    collective_timeout: Optional[float] = option(
        None, "Seconds a rank waits in a collective for the others once an epoch's first step is "
        "done (start-up, epoch ends and checkpoints keep a 30-minute one). Not set: the larger "
        "of 60 s and 20x the slowest step. A rank that stalls is then named and the run exits "
        "75, for the elastic launcher to restart from the newest checkpoint.", "distributed")
    # DDP tuning (used with more than one process; see BENCHMARKS.md for what each bought here)
    ddp_bucket_mb: float = option(25.0, "DDP gradient bucket size in MB: gradients are "
                                  "all-reduced bucket by bucket while backward runs.",
                                  "distributed")
    # On by default: the one knob that helped with 2 gloo processes (1.04-1.11x in three of four
    # measurements, BENCHMARKS.md), and on GPUs it saves a gradient-sized buffer.  Same math.
    ddp_grad_as_bucket_view: bool = option(True, "DDP gradient_as_bucket_view: gradients are "
                                           "views into the all-reduce buckets (saves one copy "
                                           "and the memory of the gradients).", "distributed")
    ddp_static_graph: bool = option(False, "DDP static_graph: the set of used parameters never "
                                    "changes, so DDP can skip per-step bookkeeping.",
                                    "distributed")
    ddp_find_unused_parameters: bool = option(
        False, "DDP find_unused_parameters: at every step, look for the parameters the forward "
        "pass left out (a walk of the autograd graph each step).  Turned on by itself for "
        "parameters the training forward never uses; needed where a network leaves some out "
        "only at some steps (a layer skipped at random, LayerDrop; a branch the input chooses), "
        "which DDP otherwise stops at.", "distributed")

    def __post_init__(self):
        self.channels_last = _auto_or_bool(self.channels_last, "channels_last")
        if isinstance(self.report_to, str):  # report_to="tensorboard" means the one tracker
            self.report_to = [self.report_to]
        self._read_yaml_forms()
        self._check_types()
        self._check_ranges()

    def _read_yaml_forms(self):
        """What a run YAML or fit() writes for an option the command line spells as text: a
        budget in seconds as a number (time_budget: 600), and an option whose flag alone means
        a value (--pretrained: hub) as true, or false for not set (timm's args.yaml's
        `pretrained: true`)."""
        if isinstance(self.time_budget, (int, float)) and not isinstance(self.time_budget, bool):
            self.time_budget = str(self.time_budget)
        for spec in dataclasses.fields(self):
            if "bare" in spec.metadata and isinstance(getattr(self, spec.name), bool):
                setattr(self, spec.name, spec.metadata["bare"] if getattr(self, spec.name)
                        else None)

    def _check_types(self):
        """Values from a run YAML or fit()'s keywords, which no argparse type has read: a
        switch given as 'no' would be taken as on, a choice outside the list go unsaid, a
        path given as true or a count as a word reach the code that uses them (a traceback
        there).  An option that may be left unset (None) is checked when it is set."""
        for spec in dataclasses.fields(self):
            value, default = getattr(self, spec.name), spec.default
            choices = spec.metadata.get("choices")
            if isinstance(default, bool):
                if not isinstance(value, bool):
                    # (named as in a run YAML and fit(): on the command line a switch is a flag)
                    raise UsageError(f"{spec.name} is a switch: true or false (got {value!r})")
            else:
                # the kind its default gives, else its Optional[...]'s, checked when it is set
                kind = (type(default) if isinstance(default, (int, float, str))
                        else _OPTIONAL_KIND.get(str(spec.type)) if value is not None else None)
                kind_error = kind and _kind_error(kind, value, example=default)
                if kind_error:
                    raise UsageError(f"{flag(spec.name)} must be {kind_error} (got {value!r})")
            if choices and value is not None and value not in choices:
                raise UsageError(f"{flag(spec.name)} {value!r} is not one of "
                                 f"{', '.join(map(str, choices))}")

    # Each check names the flag and says what would work.
    def _check_ranges(self):
        positive_ints = ("epochs", "batch_size", "accumulation_steps", "log_every",
                         "prefetch_factor", "keep_checkpoints", "synthetic_train_size",
                         "shuffle_buffer")
        for name in positive_ints:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UsageError(f"{flag(name)} must be a whole number >= 1 (got {value!r})")
        for name, least in (("max_steps", 1), ("max_train_samples", 1),
                            ("max_eval_samples", 1), ("image_size", 8), ("class_depth", 1)):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value < least):
                raise UsageError(f"{flag(name)} must be a whole number >= {least} (got "
                                 f"{value!r})")
        if not (isinstance(self.learning_rate, (int, float)) and self.learning_rate > 0
                and math.isfinite(self.learning_rate)):
            raise UsageError(f"--learning-rate must be a number > 0 (got {self.learning_rate!r})")
        for name in ("weight_decay", "momentum", "label_smoothing", "warmup_epochs", "drop_rate",
                     "checkpoint_every", "aux_loss_weight"):
            if getattr(self, name) < 0:
                raise UsageError(f"{flag(name)} must be >= 0 (got {getattr(self, name)!r})")
        if self.momentum >= 1:  # a velocity that never decays: the steps grow without bound
            raise UsageError(f"--momentum is the share of the last step kept: in [0, 1) (got "
                             f"{self.momentum!r}); 0.9 is usual")
        if not (isinstance(self.checkpoint_minutes, (int, float))
                and math.isfinite(self.checkpoint_minutes) and self.checkpoint_minutes >= 0):
            raise UsageError(f"--checkpoint-minutes must be a number of minutes >= 0 (got "
                             f"{self.checkpoint_minutes!r}); 0 checkpoints at every epoch end")
        if not (isinstance(self.in_memory_limit_gb, (int, float))
                and math.isfinite(self.in_memory_limit_gb) and self.in_memory_limit_gb > 0):
            raise UsageError(f"--in-memory-limit-gb must be a number of GiB > 0 (got "
                             f"{self.in_memory_limit_gb!r}); --in-memory never holds nothing")
        if self.crop_pad is not None and self.crop_pad < 0:
            raise UsageError(f"--crop-pad must be 0 or more pixels (got {self.crop_pad})")
        if not isinstance(self.eval_every, int) or isinstance(self.eval_every, bool) \
                or self.eval_every < 0:
            raise UsageError(f"--eval-every must be 0 (only after the last epoch) or a number "
                             f"of epochs >= 1 (got {self.eval_every!r})")
        if self.warmup_fraction is not None and not (
                isinstance(self.warmup_fraction, (int, float)) and 0 <= self.warmup_fraction < 1):
            raise UsageError(f"--warmup-fraction is a share of the run: at least 0 and below 1 "
                             f"(got {self.warmup_fraction!r}); 0.2 warms up over the first "
                             f"fifth")
        if self.host_decode_share is not None and not (
                isinstance(self.host_decode_share, (int, float))
                and 0 <= self.host_decode_share <= 1):
            raise UsageError(f"--host-decode-share is a share of each batch's JPEGs: between 0 "
                             f"and 1 (got {self.host_decode_share!r}); 0.25 leaves every "
                             f"fourth to the loader workers")
        for name in ("warmup_start_factor", "final_lr_factor"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 <= value <= 1):
                raise UsageError(f"{flag(name)} is a fraction of the peak learning rate: "
                                 f"between 0 and 1 (got {value!r})")
        if self.lookahead_every < 0:
            raise UsageError(f"--lookahead-every must be 0 (off) or a number of steps >= 1 "
                             f"(got {self.lookahead_every})")
        if not (self.norm_bias_lr_scale > 0 and math.isfinite(self.norm_bias_lr_scale)):
            raise UsageError(f"--norm-bias-lr-scale must be a number > 0 (got "
                             f"{self.norm_bias_lr_scale!r}); 1 trains them like the rest")
        for name in ("label_smoothing", "drop_rate"):
            if getattr(self, name) >= 1:
                raise UsageError(f"{flag(name)} must be below 1 (got {getattr(self, name)!r})")
        if not 0 < self.val_fraction < 1:
            raise UsageError(f"--val-fraction must be between 0 and 1 (got {self.val_fraction})")
        # (checked here: without --data-dir the embedded set would train, the file unread)
        for name, what in (("val_labels", "labels the held-out folder of an image folder"),
                           ("train_labels", "labels the training images of an image folder"),
                           ("class_depth", "names the folder level of an image folder's "
                                           "classes")):
            if getattr(self, name) is not None and self.data_dir is None:
                raise UsageError(f"{flag(name)} {what}: pass --data-dir DIR too")
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise UsageError(f"--grad-clip must be > 0 (got {self.grad_clip}); omit it to not clip")
        if not (isinstance(self.loader_timeout, (int, float)) and self.loader_timeout >= 0
                and math.isfinite(self.loader_timeout)):
            raise UsageError(f"--loader-timeout must be seconds >= 0 (got "
                             f"{self.loader_timeout!r}); 0 waits forever")
        if self.collective_timeout is not None and not (
                isinstance(self.collective_timeout, (int, float)) and self.collective_timeout > 0
                and math.isfinite(self.collective_timeout)):
            raise UsageError(f"--collective-timeout must be seconds > 0 (got "
                             f"{self.collective_timeout!r}); omit it for 20x the slowest step")
        if not (isinstance(self.ddp_bucket_mb, (int, float)) and self.ddp_bucket_mb > 0):
            raise UsageError(f"--ddp-bucket-mb must be a number > 0 (got {self.ddp_bucket_mb!r}); "
                             f"25 is DDP's default")
        if self.num_workers is not None and self.num_workers < 0:
            raise UsageError(f"--num-workers must be >= 0 (got {self.num_workers})")
        if self.layer_decay is not None and not 0 < self.layer_decay <= 1:
            raise UsageError(f"--layer-decay must be in (0, 1] (got {self.layer_decay}); "
                             f"0.65-0.85 is usual for fine-tuning")
        if self.mixup < 0 or self.cutmix < 0:
            raise UsageError(f"--mixup and --cutmix are Beta-distribution alphas: >= 0 (got "
                             f"{self.mixup}, {self.cutmix}); 0 turns one off")
        self._check_probabilities("mixup_prob", "mixup_switch_prob", "reprob")
        if (self.mixup > 0 or self.cutmix > 0) and self.batch_size % 2:
            raise UsageError(f"--mixup/--cutmix pair images within a batch: --batch-size must "
                             f"be even (got {self.batch_size})")
        if not isinstance(self.keep_best, int) or self.keep_best < 0:
            raise UsageError(f"--keep-best must be a whole number >= 0 (got {self.keep_best!r})")
        self._check_timm_pipeline()
        if self.time_budget is not None:
            parse_duration(self.time_budget)
        if self.optimizer.lower() not in ("sgd", "momentum", "adamw"):
            check_optimizer_name(self.optimizer)
        if not 0 < self.model_ema_decay < 1:
            raise UsageError(f"--model-ema-decay must be in (0, 1) (got {self.model_ema_decay}); "
                             f"0.999-0.9999 is usual")
        if not 0 <= self.drop_path < 1:
            raise UsageError(f"--drop-path must be in [0, 1) (got {self.drop_path}); "
                             f"0.05-0.2 is usual")
        for name, allowed in (("mixed_precision", PRECISIONS), ("in_memory", IN_MEMORY_MODES),
                              ("data_on_device", DATA_ON_DEVICE_MODES),
                              ("decode_on_device", DATA_ON_DEVICE_MODES),
                              ("bad_images", BAD_IMAGE_MODES), ("tta", TTA_MODES),
                              ("flip", FLIP_MODES), ("lr_decay", LR_DECAYS)):
            if getattr(self, name) not in allowed:
                raise UsageError(f"{flag(name)} {getattr(self, name)!r} is not supported: "
                                 f"choose one of {', '.join(allowed)}")
        if self.world_size is not None and self.world_size < 1:
            raise UsageError(f"--world_size must be >= 1 (got {self.world_size})")
        if self.rank is not None and self.rank < 0:
            raise UsageError(f"--rank must be >= 0 (got {self.rank})")
        if self.gpu_ids is not None:
            parse_gpu_ids(self.gpu_ids)
        if self.bn_momentum is not None and not 0 < self.bn_momentum <= 1:
            raise UsageError(f"--bn-momentum is the weight of the newest batch: in (0, 1] (got "
                             f"{self.bn_momentum}); torch's default is 0.1")
        if self.whiten_bias_epochs is not None and (
                not isinstance(self.whiten_bias_epochs, int) or self.whiten_bias_epochs < 0):
            raise UsageError(f"--whiten-bias-epochs must be a whole number of epochs >= 0 (got "
                             f"{self.whiten_bias_epochs!r}); airbench trains the bias for 3")
        if self.whiten_bias_epochs is not None and not self.whiten_stem:
            raise UsageError("--whiten-bias-epochs acts on the layer --whiten-stem whitens: add "
                             "--whiten-stem, or leave the option out")
        if self.whiten_stem and self.pretrained:
            raise UsageError("--whiten-stem would overwrite the --pretrained first layer: use "
                             "one or the other")
        self._check_network_choice()

    def _check_timm_pipeline(self):
        """timm's pipeline flags: each checked as its own flag, with the fix."""
        self.scale = _number_pair(self.scale, "scale", "e.g. --scale 0.08 1")
        self.ratio = _number_pair(self.ratio, "ratio", "e.g. --ratio 0.75 1.3333")
        if not 0 < self.scale[0] <= self.scale[1] <= 1:
            raise UsageError(f"--scale is a range of fractions of the image's area: 0 < low <= "
                             f"high <= 1 (got {self.scale[0]:g} {self.scale[1]:g}); e.g. "
                             f"--scale 0.08 1")
        if not 0 < self.ratio[0] <= self.ratio[1]:
            raise UsageError(f"--ratio is a range of aspect ratios: 0 < low <= high (got "
                             f"{self.ratio[0]:g} {self.ratio[1]:g}); e.g. --ratio 0.75 1.3333")
        self._check_probabilities("hflip", "vflip")
        self._check_normalization()
        if self.flip == "alternate" and self.hflip != 0.5:
            raise UsageError(f"--flip alternate mirrors exactly half of the images each epoch; "
                             f"--hflip {self.hflip:g} is a probability for --flip random: drop "
                             f"one of the two")
        if not (isinstance(self.color_jitter, (int, float)) and 0 <= self.color_jitter
                and math.isfinite(self.color_jitter)):
            raise UsageError(f"--color-jitter must be a number >= 0 (got {self.color_jitter!r}); "
                             f"0 turns it off, 0.4 is timm's")
        if self.crop_pct is not None and not (isinstance(self.crop_pct, (int, float))
                                              and 0 < self.crop_pct <= 1):
            raise UsageError(f"--crop-pct is the crop's share of the resized image: in (0, 1] "
                             f"(got {self.crop_pct!r}); e.g. 0.875")
        for name, allowed in (("train_interpolation", TRAIN_INTERPOLATIONS),
                              ("interpolation", INTERPOLATIONS), ("crop_mode", CROP_MODES)):
            value = getattr(self, name)
            if value is not None and value not in allowed:
                raise UsageError(f"{flag(name)} {value!r} is not supported: choose one of "
                                 f"{', '.join(allowed)}")

    def _check_normalization(self):
        """--mean and --std as three numbers for the [0, 1] pixels the run normalizes; one
        value stands for all three channels, as timm's resolve_data_config repeats it."""
        for name, example, lowest in (("mean", "0.485 0.456 0.406", ">= 0"),
                                      ("std", "0.229 0.224 0.225", "> 0")):
            if getattr(self, name) is None:
                continue
            numbers = _channel_values(getattr(self, name), name, example)
            if max(numbers) > 1:  # mmcv's and Caffe's 123.675 ...: on the 0-255 scale
                raise UsageError(f"{flag(name)} {_listed(numbers)}: the run normalizes pixels "
                                 f"scaled to [0, 1], so each value is <= 1; divide values on "
                                 f"the 0-255 scale by 255 (e.g. {flag(name)} {example})")
            if min(numbers) < 0 or (name == "std" and min(numbers) == 0):
                raise UsageError(f"{flag(name)} {_listed(numbers)}: each value must be "
                                 f"{lowest} (e.g. {flag(name)} {example})")
            setattr(self, name, numbers)

    def _check_probabilities(self, *names: str):
        for name in names:
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 <= value <= 1):
                raise UsageError(f"{flag(name)} is a probability: between 0 and 1 (got "
                                 f"{value!r})")

    def _check_network_choice(self):
        if self.smaller_models and self.min_budget_epochs is None:
            raise UsageError("--smaller-models needs --min-budget-epochs E: the epochs the "
                             "--time-budget must hold of a network for it to be trained")
        if self.min_budget_epochs is not None and not self.min_budget_epochs > 0:
            raise UsageError(f"--min-budget-epochs must be > 0 (got {self.min_budget_epochs})")
        if self.smaller_models and self.pretrained not in (None, "hub"):
            raise UsageError(f"--pretrained {self.pretrained} holds the weights of one network; "
                             f"--smaller-models may train another: drop one of the two")


    # -- conversions ----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any], source: str = "config") -> "TrainConfig":
        """The options by field name, or by the other names the command line takes (`lr`,
        `sync_batchnorm`: a recipe or fit() refused the words --help lists)."""
        known = {f.name for f in fields(cls)}
        aliases = {alias.lstrip("-").replace("-", "_"): f.name for f in fields(cls)
                   for alias in f.metadata.get("flags", ())}
        twice = sorted(name for name in set(values) & set(aliases) if aliases[name] in values)
        if twice:
            raise UsageError(f"{source}: {twice[0]} and {aliases[twice[0]]} are one option; "
                             f"give one")
        values = {aliases.get(key, key): value for key, value in values.items()}
        unknown = sorted(set(values) - known)
        if unknown:
            close = {name: difflib.get_close_matches(name, [*known, *aliases], n=1)
                     for name in unknown}
            named = ", ".join(name + (f" (did you mean {close[name][0]}?)" if close[name] else "")
                              for name in unknown)
            raise UsageError(f"{source}: unknown option(s) {named}; see `python -m accel_train "
                             f"--help` for the names")
        return cls(**values)


def check_one_run_length(given: dict[str, Any], where: str = "") -> None:
    """--epochs and --time-budget given together (typed, or in one recipe file: `where` names
    it): the budget fits the steps into its time and the epochs were ignored without a word
    (--help says "instead of --epochs")."""
    if given.get("epochs") is not None and given.get("time_budget") is not None:
        raise UsageError(f"{where}--epochs {given['epochs']} and --time-budget "
                         f"{given['time_budget']} both set the run's length: give one (a "
                         f"budget fits the steps into its time; --max-steps caps them)")


def flag(name: str) -> str:
    """The documented spelling of a field's flag, for messages."""
    return "--" + name.replace("_", "-")


def parse_gpu_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.split(",") if part.strip() != ""]
    except ValueError:
        ids = []
    if not ids or any(i < 0 for i in ids):
        raise UsageError(f"--gpu_ids {text!r} is not a comma-separated list of GPU numbers, "
                         f"e.g. --gpu_ids 0,1")
    return ids


def load_run_yaml(path: str) -> dict[str, Any]:
    """Read a run config YAML (training options by field name) for use as CLI defaults.

    A resolved `config.yaml` from a run directory also works: its `train` section is used.
    """
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"--config {path}: no such file")
    data = read_yaml(file, "recipe", "--config", empty={})  # readers.py: bad YAML is one line
    from_program, a_runs_record = False, isinstance(data.get("train"), dict)
    if a_runs_record:
        resolved = data.get("resolved")
        from_program = isinstance(resolved, dict) and bool(resolved.get("data_from_program"))
        data = data["train"]  # a run's config.yaml
    values = {key.replace("-", "_"): value for key, value in data.items()}
    if not a_runs_record:  # a recipe written by hand (a run's record holds every option)
        check_one_run_length(values, f"--config {path}: ")
    if from_program:  # fit() records the embedded set's name as its data: no data at all
        values[FROM_PROGRAM] = True
    return values


# load_run_yaml's mark on a run of fit(), whose datasets were a program's (no option names them)
FROM_PROGRAM = "_trained_on_a_programs_datasets"


def check_optimizer_name(name: str) -> str:
    """The name as timm's factory knows it, or a UsageError that suggests close names."""
    from timm.optim import list_optimizers

    known = list_optimizers()
    if name.lower() in known:
        return name.lower()
    # timm's factory wraps any of its optimizers in Lookahead (Zhang et al. 2019: every k
    # steps the weights move halfway back towards a slow copy) when the name says so; its list
    # of names does not spell those out.
    base = name.lower().removeprefix("lookahead_")
    if base != name.lower() and base in known:
        return name.lower()
    raise UsageError(f"--optimizer {name!r} is not one of timm's optimizers; "
                     f"{did_you_mean(name.lower(), known)}e.g. sgd, "
                     f"adamw, lamb, lars, lion (lookahead_NAME wraps one in Lookahead)")


def _number_pair(value, name: str, example: str) -> list[float]:
    """Two numbers (the command line gives them as text, a run YAML as numbers)."""
    try:
        low, high = (float(v) for v in value)
    except (TypeError, ValueError):
        raise UsageError(f"{flag(name)} takes two numbers, low and high (got {value!r}); "
                         f"{example}") from None
    if not (math.isfinite(low) and math.isfinite(high)):
        raise UsageError(f"{flag(name)} takes two finite numbers (got {value!r}); {example}")
    return [low, high]


def _channel_values(value, name: str, example: str) -> list[float]:
    """Three finite numbers, one per channel (R G B); one number stands for all three.  The
    command line gives text, a run YAML or fit() numbers (or one number alone)."""
    try:
        numbers = [float(value)] if isinstance(value, (int, float)) else \
            [float(v) for v in value]
    except (TypeError, ValueError):
        numbers = []
    if len(numbers) == 1:
        numbers *= 3
    if len(numbers) != 3 or not all(math.isfinite(v) for v in numbers):
        raise UsageError(f"{flag(name)} takes three numbers, R G B (or one for all three), "
                         f"got {value!r}; e.g. {flag(name)} {example}")
    return numbers


def _listed(numbers: list[float]) -> str:
    return " ".join(f"{v:g}" for v in numbers)


# The options that may be left unset, by their declared type: what each holds when set
_OPTIONAL_KIND = {"Optional[str]": str, "Optional[int]": int, "Optional[float]": float}


def _kind_error(kind: type, value, example: Any = None) -> Optional[str]:
    """What `value` should have been, for an option of `kind` whose default is `example`
    (None: it is of that kind)."""
    if kind is str and not isinstance(value, str):
        return "text: a path, a name or a word" if example is None else \
            f"a word such as {example!r}"
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        return "a whole number"
    if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
        return "a number"
    return None


def _auto_or_bool(value, name: str) -> Optional[bool]:
    """A run YAML may say `auto` (or leave it out) for an option that is chosen by measuring."""
    if value is None or isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    choices = {"auto": None, "true": True, "on": True, "yes": True, "false": False, "off": False,
               "no": False}
    if text not in choices:
        raise UsageError(f"{flag(name)} {value!r}: use auto, true or false")
    return choices[text]


_DURATION = re.compile(r"^(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s?)?$")


def parse_duration(text: str) -> float:
    """Seconds in "600", "90s", "10m", "1h", "1h30m"; a UsageError naming the flag otherwise."""
    match = _DURATION.match(str(text).strip().lower())
    if not match or not any(match.groups()):
        raise UsageError(f"--time-budget {text!r} is not a duration; write 600, 90s, 10m, 1h or "
                         f"1h30m")
    hours, minutes, seconds = (float(g) if g else 0.0 for g in match.groups())
    total = hours * 3600 + minutes * 60 + seconds
    if total <= 0:
        raise UsageError(f"--time-budget {text!r} is no time at all; give it minutes, e.g. 10m")
    return total
