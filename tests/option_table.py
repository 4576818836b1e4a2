"""The table of option effects: for every option of every command, the test that checks what it
does through the command line (or the function the command line calls: `load_data`,
`build_loaders`, `build_network`, `build_optimizer` with a whole TrainConfig) against an
independent expectation, or why that cannot be done cheaply here.

tests/test_option_effects.py fails when an option has no row, when a row names a test that does not
exist, or a test module that never passes the option.  Adding an option means adding its row and,
if no test checks it yet, the test.
"""

from __future__ import annotations

import functools
import importlib
import re
from dataclasses import dataclass, fields
from typing import Optional


@dataclass(frozen=True)
class Row:
    test: Optional[str]   # "file.py::test_name" (a parametrized test by its base name)
    checks: str = ""      # what the test compares with
    why: str = ""         # no test: why it cannot be checked cheaply here


def effect(test: str, checks: str) -> Row:
    return Row(test, checks)


def not_cheaply(why: str) -> Row:
    return Row(None, why=why)


@functools.cache  # every row's test asks: the parsers are built once
def all_options() -> dict[str, tuple[str, ...]]:
    """Every option and positional argument, as "COMMAND --flag" (or "COMMAND METAVAR"): its
    spellings (none for a positional argument), read from each command's --help as users read
    it (argparse has no public list of a parser's arguments)."""
    from accel_train.cli import build_train_parser
    from accel_train.commands import SUMMARIES

    parsers = {"train": build_train_parser()}
    for name in SUMMARIES:
        module = importlib.import_module("accel_train.commands." + name.replace("-", "_"))
        parsers[name] = module.build_parser()
    options = {}
    for command, parser in parsers.items():
        for key, flags in help_arguments(parser.format_help()):
            options[f"{command} {key}"] = flags
    return options


def help_arguments(help_text: str) -> list[tuple[str, tuple[str, ...]]]:
    """(key, spellings) of each argument --help lists but -h/--help itself.  An argument's line
    is indented two spaces (its help, when wrapped, further); a positional argument's line
    holds its name alone, an option's its spellings, comma-separated, each perhaps followed by
    its value's name."""
    arguments, positional = [], False
    for line in help_text.splitlines():
        if line and not line.startswith(" "):  # a section's title
            positional = line.startswith("positional arguments")
            continue
        match = re.match(r"  (\S+(?: \S+)*?)(?:  |$)", line)
        if not match:
            continue
        invocation = match.group(1)
        if positional:
            arguments.append((invocation, ()))
        elif invocation.startswith("-"):
            flags = tuple(part.split(" ")[0] for part in invocation.split(", "))
            if "--help" not in flags:
                arguments.append((flags[0], flags))
    return arguments


def spellings(option: str, flags: tuple[str, ...]) -> list[str]:
    """What a test module that passes the option contains: a flag, or (training options, for
    tests that build a TrainConfig and call what the CLI calls) the field as a keyword."""
    names = list(flags)
    command = option.split(" ", 1)[0]
    if command == "train" and flags:
        from accel_train.config import TrainConfig
        field_names = {f.name for f in fields(TrainConfig)}
        name = flags[0][2:].replace("-", "_")
        if name in field_names:
            names += [f"{name}=", f'"{name}":']
    return names


EQ = "test_equivalence.py"
FLAGS = "test_flags.py"
ORACLE = "test_eval_oracle.py"
EFFECTS = "test_option_effects.py"
COMPONENTS = "test_recipe_components.py"
STREAM = "test_streaming.py"
TIMM = "test_timm_pipeline.py"

ROWS: dict[str, Row] = {
    # -- train: data ----------------------------------------------------------------------------
    "train --config": effect(
        "test_config_file.py::test_a_runs_config_yaml_repeats_it_under_accelerate_config_default",
        "a run's config.yaml given back trains bit-identical weights; flags override it"),
    "train --dataset": effect(
        f"{EFFECTS}::test_dataset_names_a_local_parquet_folder",
        "classes and counts are those of the parquet files pyarrow reads"),
    "train --data-dir": effect(
        "test_layouts.py::test_rows_labels_and_classes_are_those_of_datasets_imagefolder",
        "rows, labels and classes equal datasets' own imagefolder loader"),
    "train --image-column": effect(
        f"{EFFECTS}::test_columns_chosen_by_flag_reach_training_check_data_eval_and_shard",
        "decoy columns named image/label are passed over: trains on the photo column's size, "
        "streamed too (--streaming: undecodable decoys pass --bad-images error)"),
    "train --label-column": effect(
        f"{EFFECTS}::test_columns_chosen_by_flag_reach_training_check_data_eval_and_shard",
        "class counts are those of the truth column, not the all-zero decoy; streamed, its "
        "ClassLabel names, or 10 classes counted from it (the decoy's one is refused)"),
    "train --val-fraction": effect(
        "test_bad_images.py::test_parquet_rows_are_named_by_file_and_row_also_after_carving",
        "0.25 of 17 rows carves ceil(4.25) = 5 held-out rows"),
    "train --val-stratify": effect(
        "test_split_roles.py::test_an_image_folder_carved_class_by_class_says_so_and_records_how",
        "45 + 5 images at 0.2 hold out 9 and 1 (by hand; where datasets' own stratified split "
        "holds out none of a rare class, one: test_a_stratified_carve_holds_out_one_image_of_"
        "every_class_where_datasets_held_none); eval and resume of such a run carve the same: "
        "test_a_stratified_run_is_evaluated_and_resumed_on_the_images_it_carved"),
    "train --select-on-test": effect(
        "test_three_roles.py::test_select_on_test_uses_the_test_split_for_selection_and_says_so",
        "64 train / 32 held-out rows: the test split itself, no test split kept"),
    "train --max-train-samples": effect(
        "test_data.py::test_shared_cifar10_parquet", "256 of 640 rows: exactly 256 train rows"),
    "train --max-eval-samples": effect(
        f"{EQ}::test_distributed_eval_counts_each_sample_once",
        "101 held-out images counted exactly once on 1 and 2 processes"),
    "train --sample-subset": effect(
        "test_split_roles.py::test_the_first_images_of_a_sorted_folder_holding_one_class_are_said",
        "first: the folder's first 10 files (all of class a), said; random (the default, "
        "test_a_limit_keeps_the_images_datasets_shuffle_keeps): the file names datasets' own "
        "image folder reader shuffled with seed 0 keeps"),
    "train --tta": effect(
        "test_small_nets.py::test_a_run_trains_exports_and_evaluates_one_with_flip_tta",
        "the run's own evaluation equals eval --tta flip, itself checked against plain torch; "
        "flip-translate: test_short_run_options.py, six views built with index arrays"),
    "train --crop-pad": effect(
        "test_short_run_options.py::test_crop_pad_bounds_the_training_crops_shift",
        "crop offsets read off row-numbered images: exactly -2..2 with 2, -4..4 unset, 0 with 0"),
    "train --flip": effect(
        "test_short_run_options.py::test_alternate_flip_mirrors_a_random_half_then_the_other_half",
        "mirroring read off ramp images' pixels: epoch e mirrors exactly the images epoch 0 did "
        "(e even) or the others (e odd); random mode is not so tied"),
    "train --synthetic-train-size": effect(
        f"{FLAGS}::test_sgd_grad_clip_weight_decay_and_label_smoothing",
        "one full batch of 32 images: the step equals plain torch on synthetic.splits(32)"),
    "train --in-memory": effect(
        "test_bad_images.py::"
        "test_one_process_finishes_naming_each_broken_file_in_memory_and_per_step",
        "never decodes per step with loader workers; the weights equal the in-memory run's"),
    "train --in-memory-limit-gb": effect(
        f"{FLAGS}::test_in_memory_limit_decides_whether_images_are_decoded_up_front",
        "3456 bytes over a 1074-byte limit (by hand) are not decoded up front"),
    "train --data-on-device": effect(
        "test_data_on_device.py::"
        "test_device_batches_equal_the_loaders_for_an_epoch_and_a_half_and_across_a_resume",
        "always: every batch of an epoch and a half, resumed mid-epoch from either loader's "
        "checkpoint, equals the DataLoader path's (never) to the bit, also with --reprob's "
        "erasing plans drawn by 2 loader workers; a second rank's are Accelerate's "
        "BatchSamplerShard's; a 2-step run's weights equal never's; photographs held decoded "
        "give --decode-on-device always's batches to the bit "
        "(test_photos_on_device.py); the held-out batches kept after the first evaluation "
        "(uint8, normalized on the device to the loader's floats to the bit) give the loader's "
        "numbers, and on 2 processes accel-train eval's (test_held_out_kept.py)"),
    "train --decode-on-device": effect(
        "test_device_decode.py::test_the_device_path_trains_the_workers_samples",
        "always: the same labels as the loader workers' path (timm's transform on PIL images) "
        "and pixels within 1 level of 255 per image (another crop, flip or jitter: tens); "
        "auto's rule against hand-computed figures; never: the workers' path"),
    "train --host-decode-share": effect(
        "test_host_decode_share.py::test_the_workers_decode_their_share_and_the_device_the_rest",
        "a quarter: positions 3 and 7 of 8 by hand, cropped by the workers and jittered by the "
        "device (torchvision's adjust_* on their crops give its pixels), all eight the device "
        "path's without a share to the bit; the positions of other shares by hand; the "
        "summary's words and the record; unset, auto's share against hand-computed figures "
        "(test_device_decode.py), and a resume without it keeps the checkpoint's to the bit "
        "(the resume matrix)"),
    "train --num-workers": effect(
        f"{FLAGS}::test_loader_flags_reach_the_training_loader",
        "a probe outside the package sees num_workers 1 in DataLoader, 0 in the control"),
    "train --prefetch-factor": effect(
        f"{FLAGS}::test_loader_flags_reach_the_training_loader",
        "the probe sees prefetch_factor 3"),
    "train --persistent-workers": effect(
        f"{FLAGS}::test_loader_flags_reach_the_training_loader",
        "--no-persistent-workers: the probe sees persistent_workers False"),
    "train --bad-images": effect(
        "test_bad_images.py::test_bad_images_error_stops_naming_the_file",
        "error: exit 2 naming the file the test broke; substitute lists exactly the broken ones"),
    "train --val-labels": effect(
        "test_layouts.py::test_train_and_eval_on_the_imagenet_layout",
        "12 train / 9 held-out images of 3 classes, as the test's label file says"),
    "train --train-labels": effect(
        "test_train_labels.py::test_each_image_takes_the_class_its_line_gives",
        "each image's class is its line's as pandas' read_csv reads the file (ids without "
        "extension, quoted names with commas, whitespace without a header)"),
    "train --class-depth": effect(
        f"{EFFECTS}::test_class_depth_alike_in_training_and_check_data",
        "the top folder names the class: the counts the test wrote, in both commands"),
    "train --streaming": effect(
        f"{EFFECTS}::test_streaming_flag_and_eval_shards",
        "parquet streamed: stream.json in the checkpoint, each training row once per epoch"),
    "train --shuffle-buffer": effect(
        f"{STREAM}::test_one_process_two_workers_each_sample_once_per_epoch",
        "each sample once per epoch with a 50-sample buffer (plan unit-tested as a permutation)"),
    "train --eval-shards": effect(
        f"{EFFECTS}::test_streaming_flag_and_eval_shards",
        "two named shards of 24: evaluations count 48 images and training loses them"),
    "train --augment": effect(
        f"{FLAGS}::test_sgd_grad_clip_weight_decay_and_label_smoothing",
        "--no-augment: the step equals plain torch on the raw images (the crop/flip oracle is "
        "test_augment.py's)"),
    "train --auto-augment": effect(
        f"{COMPONENTS}::test_a_policy_changes_the_images_deterministically_on_both_data_paths",
        "images differ from crop/flip alone, alike on both data paths, per (seed, epoch, index); "
        "--aa is the same field (test_timm_pipeline.py)"),
    "train --reprob": effect(
        f"{COMPONENTS}::test_random_erasing_replaces_one_rectangle_deterministically",
        "exactly one rectangle of noise, within timm's area bound"),
    "train --scale": effect(
        f"{TIMM}::test_training_crop_scale_and_aspect_follow_timms_sampler",
        "crop area fractions read off a position-coded image against timm's "
        "RandomResizedCropAndInterpolation: KS distance below the 0.001 critical value over 2000 "
        "draws, and --scale 0.25 1 rejected; each image equals timm's create_transform in its "
        "seeded block"),
    "train --ratio": effect(
        f"{TIMM}::test_training_crop_scale_and_aspect_follow_timms_sampler",
        "log aspect ratios against timm's sampler by the same KS test; --ratio 0.9 1.1 rejected"),
    "train --hflip": effect(
        f"{TIMM}::test_training_crop_scale_and_aspect_follow_timms_sampler",
        "0.3: the mirrored share of 2000 draws within 4 binomial deviations; on 32 px images: "
        "test_hflip_is_the_mirroring_probability_on_the_small_image_path_too, 0 none, 1 all"),
    "train --vflip": effect(
        f"{TIMM}::test_training_crop_scale_and_aspect_follow_timms_sampler",
        "0.2: the share turned upside down within 4 binomial deviations; 0 (default) none"),
    "train --color-jitter": effect(
        f"{TIMM}::test_each_training_image_is_timms_training_transform_in_its_seeded_block",
        "0.4 (default) and 0.3: pixels equal timm's create_transform(color_jitter=...) drawn in "
        "the sample's documented seeded block"),
    "train --train-interpolation": effect(
        f"{TIMM}::test_each_training_image_is_timms_training_transform_in_its_seeded_block",
        "random (default), bicubic, bilinear: pixels equal timm's create_transform with that "
        "interpolation; nearest reads the crop box back in the sampler test"),
    "train --interpolation": effect(
        f"{TIMM}::test_held_out_images_are_prepared_by_timms_eval_transform",
        "the model's (bilinear, bicubic) or given (bicubic, nearest): held-out pixels equal "
        "timm's create_transform(**resolve_data_config(model)) within 1e-5"),
    "train --crop-pct": effect(
        f"{TIMM}::test_held_out_images_are_prepared_by_timms_eval_transform",
        "the model's (0.875, 0.9, 0.95) or given (0.8, 1.0): held-out pixels equal timm's eval "
        "transform within 1e-5; the export's config.json says it (predict = timm's pipeline "
        "within 1e-4)"),
    "train --crop-mode": effect(
        f"{TIMM}::test_held_out_images_are_prepared_by_timms_eval_transform",
        "center (the model's), squash and border given: held-out pixels equal timm's eval "
        "transform within 1e-5; 64 px images keep squash"),
    "train --mean": effect(
        f"{FLAGS}::test_mean_and_std_normalize_what_the_model_sees",
        "--mean 0.25 (one value for all channels): the first loss and SGD step equal plain "
        "torch's on (x - 0.25) / std written out from the flags, not the data's statistics' "
        "step; recorded in the spec for eval and export"),
    "train --std": effect(
        f"{FLAGS}::test_mean_and_std_normalize_what_the_model_sees",
        "--std 0.5 0.25 0.125 per channel: the same hand-written step as --mean's row"),
    # -- train: model ---------------------------------------------------------------------------
    "train --model": effect(
        f"{FLAGS}::test_sgd_grad_clip_weight_decay_and_label_smoothing",
        "the step equals plain torch on timm.create_model of that name"),
    "train --smaller-models": effect(
        "test_network_choice.py::test_the_network_the_budget_holds_long_enough_is_the_one_trained",
        "with planted step times, the network whose hand-computed epochs in the budget reach the "
        "minimum is the one in config.yaml, the final model's config.json and the checkpoints"),
    "train --min-budget-epochs": effect(
        "test_network_choice.py::test_the_network_the_budget_holds_long_enough_is_the_one_trained",
        "1.25 epochs for test_resnet: a minimum of 1 trains it, timing nothing else; 2 the next"),
    "train --image-size": effect(
        f"{FLAGS}::test_image_size_resizes_what_the_model_sees",
        "the probe sees 16x16 inputs at the first conv where the data is 32x32"),
    "train --pretrained": effect(
        "test_training.py::test_pretrained_local_weights_and_frozen_backbone",
        "every backbone tensor equals the weights file's after training; a run's own file "
        "(test_pretrained_file.py) keeps its classifier for the same classes, rows in the new "
        "order: eval of the unchanged start equals the original run's, its mean/std too; "
        "the flag alone asks for the Hub's weights (test_hub_cache.py::"
        "test_the_flag_alone_asks_for_the_hubs_weights)"),
    "train --freeze-backbone": effect(
        "test_training.py::test_pretrained_local_weights_and_frozen_backbone",
        "backbone and BatchNorm statistics bit-identical to the source; only the head moves"),
    "train --sync-bn": effect(
        f"{EQ}::test_sync_bn_running_stats_equal_one_process_and_differ_without_it",
        "2x8 BatchNorm statistics equal 1x16's; without it they differ"),
    "train --channels-last": effect(
        f"{FLAGS}::test_channels_last_reaches_the_model_and_the_images",
        "the conv probe sees channels_last inputs and weights; NCHW in the control"),
    "train --bn-momentum": effect(
        "test_short_run_options.py::test_bn_momentum_through_the_command_line",
        "after one step, running statistics = (1-m) x start + m x batch: the batch's statistics "
        "solved from m=0.5 and m=0.25 agree"),
    "train --whiten-stem": effect(
        "test_short_run_options.py::test_whiten_stem_through_the_command_line",
        "the saved first convolution decorrelates the run's normalized training patches as "
        "numpy's eigh of their covariance says (filters in +- pairs)"),
    "train --whiten-bias-epochs": effect(
        "test_short_run_options.py::test_whiten_bias_epochs_through_the_command_line",
        "with 1 of 2 epochs the stem's bias after epoch 2 is bit-identical to the epoch-1 "
        "checkpoint's (moved in epoch 1, the rest trained on); with 2 it moved in both"),
    "train --drop-rate": effect(
        f"{FLAGS}::test_drop_rate_drops_in_training_and_is_recorded",
        "about half the classifier's inputs are zero in training, none in the control"),
    "train --model-ema": effect(
        f"{COMPONENTS}::test_model_ema_follows_timms_rule_and_is_evaluated_saved_and_exported",
        "after step 2 the EMA is lerp(w1, w2, 1 - decay), written out by hand"),
    "train --model-ema-decay": effect(
        f"{COMPONENTS}::test_model_ema_follows_timms_rule_and_is_evaluated_saved_and_exported",
        "the same lerp with the decay given"),
    "train --drop-path": effect(
        f"{COMPONENTS}::test_drop_path_reaches_the_model",
        "DropPath rates follow timm's linear rule by hand; train-mode forwards become random"),
    "train --compile": effect(
        f"{FLAGS}::test_compile_compiles_the_model_and_trains_the_same_step",
        "one torch.compile(inductor) call seen by a probe; the step equals plain torch"),
    # -- train: optimization ----------------------------------------------------------------------
    "train --epochs": effect(
        "test_training.py::test_training_in_a_subprocess_improves_accuracy",
        "2 epochs: epoch records 1 and 2, each over all 1000 held-out images"),
    "train --batch-size": effect(
        f"{FLAGS}::test_sgd_grad_clip_weight_decay_and_label_smoothing",
        "the conv probe sees batches of 32; the step equals the 32-image plain step"),
    "train --learning-rate": effect(
        "test_schedule.py::test_cli_run_logs_the_hand_computed_lr",
        "the logged rate at each step equals warmup-then-cosine from the peak, by hand; on "
        "--resume with another rate: test_resume_learning_rate.py, the rates of a run started "
        "with it"),
    "train --optimizer": effect(
        f"{FLAGS}::test_adamw_first_step_is_lr_times_the_gradient_sign",
        "AdamW's first update is lr x sign-like g/(|g|+eps) with decoupled decay, by hand; "
        "lookahead_sgd: test_short_run_options.py, halfway between plain SGD's step 6 and 12"),
    "train --momentum": effect(
        f"{FLAGS}::test_sgd_grad_clip_weight_decay_and_label_smoothing",
        "momentum 0: w1 = w0 - lr x d exactly (Nesterov 0.9 would give 1.9 d)"),
    "train --layer-decay": effect(
        f"{COMPONENTS}::test_layer_decay_scales_each_parameters_rate_as_timm_does",
        "each group's rate is the peak times timm's param_groups_layer_decay scale"),
    "train --eval-every": effect(
        "test_short_run_options.py::test_eval_every_evaluates_every_nth_epoch_and_the_last",
        "which epoch records carry eval figures (by hand: 2 and the last of 3; 0: the last), "
        "weights bit-identical to --eval-every 1, --keep-best's kept steps; the budget's count "
        "by hand and by brute force: test_time_budget.py"),
    "train --lookahead-every": effect(
        "test_short_run_options.py::test_lookahead_every_through_the_command_line",
        "one step: every float tensor at start + 0.05 x (trained - start), rho = 0.95 x 1^3 by "
        "hand; K=2 (no sync) ends on the initial state; exact resume: test_resume_matrix.py"),
    "train --norm-bias-lr-scale": effect(
        "test_short_run_options.py::test_norm_bias_lr_scale_through_the_command_line",
        "after one step each BatchNorm bias moved exactly 64x as far as without; every other "
        "tensor identical; with --layer-decay: test_recipe_components.py, timm's groups x 64"),
    "train --weight-decay": effect(
        f"{FLAGS}::test_sgd_grad_clip_weight_decay_and_label_smoothing",
        "decay 0.5 on weights only, written into the hand update"),
    "train --decay-norm-and-bias": effect(
        "test_short_run_options.py::test_decay_norm_and_bias_through_the_command_line",
        "after one step each 1-d parameter is lower by lr x (1 + momentum) x decay x its start "
        "than without, by hand; all else identical; the shifts' decay over "
        "--norm-bias-lr-scale: test_recipe_components.py"),
    "train --lr-decay": effect(
        "test_schedule.py::test_cli_run_logs_the_triangle",
        "the logged rates of a 12-step run against np.interp through airbench's corners; "
        "cosine: test_cli_run_logs_the_hand_computed_lr; a budget fit continues the line"),
    "train --warmup-start-factor": effect(
        "test_schedule.py::test_cli_run_logs_the_triangle",
        "warmup rises from 0.2 x the peak: the first update at 0.04, then 0.06, 0.08, 0.1 "
        "(--lr 0.1, 4 warmup steps), against np.interp"),
    "train --final-lr-factor": effect(
        "test_schedule.py::test_cli_run_logs_the_triangle",
        "the last rate is 0.07 x the peak, as np.interp draws the line to it"),
    "train --warmup-epochs": effect(
        "test_schedule.py::test_cli_run_logs_the_hand_computed_lr",
        "0.25 epochs = 4 linear warmup steps in the logged rates"),
    "train --warmup-fraction": effect(
        "test_schedule.py::test_cli_warmup_fraction_is_a_share_of_the_run",
        "0.25 of a 12-step run = 3 warmup steps (over --warmup-epochs' 4) in the logged rates; "
        "with --time-budget the warmup follows the fits: "
        "test_time_budget.py::test_a_warmup_share_follows_the_budget_on_a_slow_machine"),
    "train --label-smoothing": effect(
        f"{FLAGS}::test_sgd_grad_clip_weight_decay_and_label_smoothing",
        "the first loss equals hand-written smoothed cross-entropy with eps 0.3"),
    "train --class-weight": effect(
        f"{FLAGS}::test_class_weight_balanced_weighs_the_first_loss_and_step",
        "weights counted by hand (32 / (10 x count)) in config.yaml; the first loss and SGD "
        "step of the weighted smoothed cross-entropy written out in plain torch, not the "
        "unweighted one's; Mixup's weighted soft loss by hand in test_class_weights.py"),
    "train --aux-loss-weight": effect(
        "test_auxiliary_loss.py::test_the_auxiliary_loss_and_its_gradient_are_the_hand_computed_ones",
        "the logged loss grows by w ln 5 and the auxiliary bias moves by the hand-computed "
        "gradient; GoogLeNet's aux heads train only when weighted (tests/test_auxiliary_loss.py)"),
    "train --mixup": effect(
        f"{FLAGS}::test_mix_probability_zero_trains_the_plain_step",
        "with probability 0 the step is the plain oracle's; the mix itself is checked in "
        "test_recipe_components"),
    "train --cutmix": effect(
        f"{COMPONENTS}::test_cutmix_replaces_one_rectangle_and_lam_is_its_complement_area",
        "one rectangle from the flipped batch, lam = 1 - its area, on the mixer the config "
        "builds"),
    "train --mixup-prob": effect(
        f"{FLAGS}::test_mix_probability_zero_trains_the_plain_step",
        "probability 0: the first step equals the unmixed plain-torch step"),
    "train --mixup-switch-prob": effect(
        f"{COMPONENTS}::test_switch_prob_and_mix_prob_choose_what_a_batch_gets",
        "switch 0: only blends; 1: only rectangles, on the mixer the config builds"),
    "train --grad-clip": effect(
        f"{FLAGS}::test_sgd_grad_clip_weight_decay_and_label_smoothing",
        "the gradient part of the update has norm lr x clip exactly"),
    "train --accumulation-steps": effect(
        f"{EQ}::test_accumulation_equals_the_larger_batch_and_skips_the_allreduce",
        "1x8x2 accumulation trains the weights of 1x16"),
    "train --mixed-precision": effect(
        f"{FLAGS}::test_bf16_is_recorded_runs_in_bf16_and_trains",
        "bf16: every training conv outputs bf16; the loss is near, not equal to, fp32's"),
    "train --max-steps": effect(
        "test_schedule.py::test_cli_run_logs_the_hand_computed_lr",
        "steps 1..12 logged; the cosine reaches 0 at step 12"),
    "train --time-budget": effect(
        f"{EFFECTS}::test_time_budget_fits_every_evaluation_pass",
        "on a fake clock the fitted step count is the hand-computed one, EMA and TTA passes "
        "included"),
    "train --seed": effect(
        f"{FLAGS}::test_seed_sets_the_initial_weights",
        "--seed 7: the step equals plain torch from timm's init after torch.manual_seed(7)"),
    # -- train: output --------------------------------------------------------------------------
    "train --output-dir": effect(
        "test_training.py::test_training_in_a_subprocess_improves_accuracy",
        "metrics.jsonl, config.yaml and the rank log are in the folder given"),
    "train --checkpoint": effect(
        f"{EFFECTS}::test_checkpoint_folder_keep_checkpoints_and_keep_best",
        "verified checkpoints in the folder given, none under the run folder"),
    "train --checkpoint-every": effect(
        f"{EFFECTS}::test_checkpoint_folder_keep_checkpoints_and_keep_best",
        "a checkpoint every step: the newest two are steps 11 and 12"),
    "train --checkpoint-minutes": effect(
        f"{EFFECTS}::test_checkpoint_minutes_skips_epoch_ends_but_the_last_the_steps_and_new_bests",
        "an hour: the saves are --checkpoint-every's steps, the last step and the new bests of "
        "metrics.jsonl's top-1; the final weights those of a run saving every epoch end"),
    "train --keep-checkpoints": effect(
        f"{EFFECTS}::test_checkpoint_folder_keep_checkpoints_and_keep_best",
        "2: steps 11 and 12 kept besides the best"),
    "train --keep-best": effect(
        f"{EFFECTS}::test_checkpoint_folder_keep_checkpoints_and_keep_best",
        "the 2 epoch-end saves with the highest eval_top1 in metrics.jsonl are kept"),
    "train --eval-metric": effect(
        f"{EFFECTS}::test_eval_metric_loss_picks_the_kept_checkpoint_the_weights_and_the_best",
        "loss with --model-ema: the kept best is the epoch end of metrics.jsonl's lowest loss "
        "(raw or EMA), the saved weights the lower loss's, the last line its value; a resume "
        "by top1 refused in one line, nothing touched; mean_class_top1 on each epoch line "
        "(test_eval_metric_mean_class_top1_on_each_epoch_line_and_the_last); by-hand ranks in "
        "test_checkpoint.py"),
    "train --resume": effect(
        f"{EFFECTS}::test_resume_from_each_form_of_path_ends_bit_identical",
        "checkpoints folder, run folder and step folder each end bit-identical to the run "
        "never stopped (auto: test_resume_matrix.py)"),
    "train --log-every": effect(
        "test_tracking.py::test_tensorboard_files_hold_the_logged_scalars",
        "every 2 of 8 steps: train records at 2, 4, 6, 8"),
    "train --report-to": effect(
        "test_tracking.py::test_tensorboard_files_hold_the_logged_scalars",
        "TensorBoard's own reader gives back the scalars of metrics.jsonl"),
    "train --plots": effect(
        "test_tracking.py::test_plots_are_drawn_at_the_end_of_training",
        "three 800x600 PNGs that PIL opens in plots/"),
    "train --progress": effect(
        f"{EFFECTS}::test_progress_bar_or_log_lines",
        "bar: tqdm's counter on stderr and no log lines; log: the reverse"),
    # -- train: distributed -----------------------------------------------------------------------
    "train --world-size": effect(
        "test_process_control.py::test_manual_start_without_a_launcher_trains_like_torchrun",
        "two hand-started processes form one group: weights equal torchrun's"),
    "train --rank": effect(
        "test_process_control.py::test_manual_start_without_a_launcher_trains_like_torchrun",
        "each process's log says its rank; only rank 0 prints"),
    "train --local-rank": effect(
        f"{EFFECTS}::test_local_rank_is_checked_against_the_launcher",
        "a value other than the launcher's LOCAL_RANK stops in one line naming both"),
    "train --gpu-ids": effect(
        f"{EFFECTS}::test_gpu_ids_are_visible_before_torch_is_first_asked_about_cuda",
        "CUDA_VISIBLE_DEVICES is 2,3 at torch's first CUDA query (recorded); a different "
        "value already set is refused before it (training on them needs GPUs)"),
    "train --dist-url": effect(
        "test_process_control.py::test_manual_start_without_a_launcher_trains_like_torchrun",
        "the tcp:// address given is where the hand-started group meets"),
    "train --loader-timeout": effect(
        "test_loader_workers.py::test_a_worker_stuck_reading_names_the_file_and_the_run_stops_in_one_line",
        "a read blocked in a worker: the worker names the parquet file and row at 80% of 4 s, "
        "the run stops in one line at 4 s, exit 75"),
    "train --collective-timeout": effect(
        "test_elastic.py::test_a_stalled_rank_is_named_and_the_group_restarts_bit_identical",
        "rank 1 stopped (SIGSTOP): rank 0 reports 'a collective waited 3 s', naming rank 1 and "
        "its last step, within 3 s + 10 s of the stop (the default would wait >= 60 s); the "
        "restarted group ends with the never-stalled run's weights; and "
        "test_slow_data_preparation_and_a_slow_checkpoint_do_not_trip_the_tight_timeout"),
    "train --ddp-bucket-mb": effect(
        f"{FLAGS}::test_ddp_knobs_reach_the_ddp_wrapper",
        "a DDP probe sees bucket_bytes_cap 1.5 MiB, by hand"),
    "train --ddp-grad-as-bucket-view": effect(
        f"{FLAGS}::test_ddp_knobs_reach_the_ddp_wrapper",
        "the DDP probe sees gradient_as_bucket_view False when turned off"),
    "train --ddp-static-graph": effect(
        f"{FLAGS}::test_ddp_knobs_reach_the_ddp_wrapper", "the DDP probe sees static_graph True"),
    "train --ddp-find-unused-parameters": effect(
        "test_user_model.py::test_a_layer_skipped_at_some_steps_stops_in_one_line_or_trains_as_on_one_process",
        "a block left out of every second batch: without it one line naming it at step 3 "
        "(torch's RuntimeError before); with it 2 processes under torchrun end with the weights "
        "of 1 process, by allclose"),

    # -- eval -------------------------------------------------------------------------------------
    "eval RUN_OR_CHECKPOINT": effect(
        f"{ORACLE}::test_eval_held_out_matches_a_plain_torch_evaluation",
        "loss, top-1/5 and per-class counts equal a plain timm+safetensors evaluation; an "
        "export's model.onnx (test_export_formats.py): the export's numbers within 1e-4 and "
        "its wrong images, through ONNX Runtime"),
    "eval --data-dir": effect(
        "test_commands.py::test_eval_on_another_folder_maps_classes_by_name",
        "counts equal the PNGs the test wrote; classes mapped by name"),
    "eval --dataset": effect(
        f"{ORACLE}::test_eval_of_a_named_dataset_matches_plain_torch",
        "--dataset synthetic: the plain-torch evaluation of those images"),
    "eval --image-column": effect(
        f"{EFFECTS}::test_columns_chosen_by_flag_reach_training_check_data_eval_and_shard",
        "evaluates the photo column: per-class counts of the truth column"),
    "eval --label-column": effect(
        f"{EFFECTS}::test_columns_chosen_by_flag_reach_training_check_data_eval_and_shard",
        "per-class counts are the truth column's, not the decoy's"),
    "eval --val-labels": effect(
        "test_commands.py::test_eval_of_one_class_and_of_imagenets_validation_layout",
        "ImageNet's layout (train/CLASS, val/IMAGE, a label file): top-1 equals predict's "
        "top-1 on the val/ files against the file's labels"),
    "eval --train-labels": effect(
        "test_train_labels.py::test_train_labels_alike_in_training_check_data_and_eval",
        "--data-dir with it, --split all: every image counted under the file's class (pandas' "
        "value_counts); without --data-dir the run's own file is read again"),
    "eval --class-depth": effect(
        "test_commands.py::test_eval_of_one_class_and_of_imagenets_validation_layout",
        "without --data-dir: one line (the run's data is read as it trained); with it, as in "
        "training (test_layouts.py)"),
    "eval --split": effect(
        f"{ORACLE}::test_eval_train_split_with_a_ragged_last_batch",
        "train split: equals plain torch on the first training images"),
    "eval --max-samples": effect(
        f"{ORACLE}::test_eval_train_split_with_a_ragged_last_batch",
        "40: count 40 and the oracle on those 40"),
    "eval --sample-subset": effect(
        f"{ORACLE}::test_eval_of_images_without_the_last_class_still_counts_every_class",
        "first: the oracle on the split's first N images; random (the default, "
        "test_eval_train_split_with_a_ragged_last_batch): the oracle on numpy's "
        "default_rng(0).permutation's first 40"),
    "eval --batch-size": effect(
        f"{ORACLE}::test_eval_loader_flags_reach_its_loader",
        "a DataLoader probe sees batch_size 7 and the numbers still equal the oracle"),
    "eval --num-workers": effect(
        f"{ORACLE}::test_eval_loader_flags_reach_its_loader",
        "the DataLoader probe sees num_workers 1"),
    "eval --loader-timeout": effect(
        "test_loader_workers.py::test_eval_with_workers_starts_them_from_a_fork_server_and_stops_when_one_is_stuck",
        "a held-out read blocked in the eval's one worker: the worker names its row, eval "
        "stops in one line at 8 s, exit 75 (it waited for ever without the option)"),
    "eval --mixed-precision": effect(
        f"{ORACLE}::test_eval_in_bf16_is_near_but_not_the_fp32_oracle",
        "bf16: loss within 0.05 of the fp32 oracle but not equal; no: equal"),
    "eval --tta": effect(
        f"{ORACLE}::test_eval_with_flip_tta_matches_a_plain_torch_evaluation_of_both_views",
        "flip: logits averaged with numpy-mirrored images, in plain torch"),
    "eval --ema": effect(
        "test_commands.py::test_a_checkpoints_ema_weights_through_eval_export_and_predict",
        "a checkpoint's ema.safetensors: loss and top-1 equal the run's own epoch-end evaluation "
        "of its average (eval_ema_*), not of its trained weights; one line where none is kept"),
    "eval --json": effect(
        f"{ORACLE}::test_eval_held_out_matches_a_plain_torch_evaluation",
        "the JSON fields are compared with the oracle's numbers"),
    "eval --mistakes": effect(
        f"{ORACLE}::test_the_mistakes_file_is_plain_torchs_wrong_images_least_likely_first",
        "pandas' read of the file: plain torch's wrong images of a PNG class folder, each "
        "path, label, guess and both probabilities, the label's ascending; on 2 processes "
        "(torchrun) the same rows as on 1"),
    # -- predict ----------------------------------------------------------------------------------
    "predict RUN_OR_CHECKPOINT": effect(
        f"{ORACLE}::test_predict_is_the_softmax_of_plain_torch_logits",
        "probabilities equal softmax of plain-torch logits, for a run and a trained-with-flip "
        "run"),
    "predict IMAGES_OR_FOLDERS": effect(
        "test_commands.py::test_predict_table_and_json_lines",
        "a file given twice plus a folder: one row per distinct image, recursively"),
    "predict --top-k": effect(
        "test_commands.py::test_predict_table_and_json_lines",
        "3 predictions per row; the table header has top-1 top-2 for 2"),
    "predict --batch-size": effect(
        f"{ORACLE}::test_predict_is_the_softmax_of_plain_torch_logits",
        "batches of 3 give the same lines, and the probe counts ceil(8/3) forward calls"),
    "predict --mixed-precision": effect(
        f"{ORACLE}::test_predict_runs_in_the_precision_the_run_evaluated_in",
        "bf16: the softmax of plain torch's bf16-autocast logits; no: of the fp32 ones; auto: "
        "as the run ran where bf16 is native, else fp32; with an .onnx model, one line"),
    "predict --ema": effect(
        "test_commands.py::test_a_checkpoints_ema_weights_through_eval_export_and_predict",
        "the checkpoint's EMA weights: the same lines as predict of export --ema"),
    "predict --read-timeout": effect(
        "test_stuck_reads.py::test_training_and_eval_stop_in_one_line_and_touch_no_checkpoint",
        "a FIFO given as the image: exit 75 after the 3 s given, the one line naming it"),
    "predict --json": effect(
        "test_commands.py::test_predict_table_and_json_lines",
        "one JSON object per image with its ranked classes"),
    "predict --csv": effect(
        "test_predict_csv.py::test_the_csv_holds_each_images_top1_as_predict_shows_it",
        "pandas' read_csv of the file: each image's path inside the folder and its top-1 as "
        "predict --json ranks it; as --train-labels, eval of the folder scores 100%; an "
        "unreadable image, or a stuck read's exit 75, leaves an earlier file byte-equal and "
        "no partial file"),
    "predict --csv-image": effect(
        "test_predict_csv.py::test_kaggle_ids_and_header",
        "name: img01.png, stem: img01 (pandas); ids two images share: one line each form"),
    "predict --csv-header": effect(
        "test_predict_csv.py::test_kaggle_ids_and_header",
        "id,label: pandas reads those columns; wrong counts and names: one line each"),
    "predict --csv-probabilities": effect(
        "test_predict_csv.py::test_the_probability_csv_is_every_class_in_the_models_order",
        "one column per class name in the model's order, each within 1e-6 of predict --json's "
        "probability, rows summing to 1"),
    "predict --csv-top-k": effect(
        "test_predict_csv.py::test_the_top_k_csv_names_the_k_best_classes_best_first",
        "each cell the 3 best classes, space-separated, as predict --json ranks them and as "
        "numpy sorts the probability CSV's columns; 50 of 10 classes: every class; a class "
        "name with a space refused"),
    # -- export -----------------------------------------------------------------------------------
    "export RUN_OR_CHECKPOINT": effect(
        "test_commands.py::test_export_of_a_checkpoint_is_a_model_eval_and_predict_accept",
        "tensors equal the run's final weights read with safetensors"),
    "export --output-dir": effect(
        "test_commands.py::test_export_of_a_checkpoint_is_a_model_eval_and_predict_accept",
        "exactly model.safetensors, config.json and README.md in the folder given; a folder "
        "holding an export is refused"),
    "export --ema": effect(
        "test_commands.py::test_a_checkpoints_ema_weights_through_eval_export_and_predict",
        "model.safetensors holds ema.safetensors' tensors exactly; config.json says weights: ema"),
    "export --format": effect(
        "test_export_formats.py::test_onnx_runtime_agrees_with_predict",
        "onnx: model.onnx in ONNX Runtime on real held-out images, preprocessed from "
        "preprocessing.json with numpy, gives predict's probabilities within 1e-4 (timm, "
        "transformers: the tests beside it)"),
    # -- plot -------------------------------------------------------------------------------------
    "plot RUN_DIR": effect(
        "test_commands.py::test_plot_command_writes_the_pngs",
        "three PNGs of 800x600 that PIL opens"),
    "plot --output-dir": effect(
        "test_commands.py::test_plot_command_writes_the_pngs",
        "every PNG lands in the folder given and none in the run's plots/"),
    # -- launch -----------------------------------------------------------------------------------
    "launch --config_file": effect(
        "test_launchers.py::test_launch_dry_run_through_the_console_entry_point",
        "the printed command is exactly accelerate launch with that file"),
    "launch --elastic": effect(
        "test_launchers.py::test_launch_dry_run_through_the_console_entry_point",
        "the elastic YAML's settings become the exact launcher flags and variables"),
    "launch --dry-run": effect(
        "test_launchers.py::test_launch_dry_run_through_the_console_entry_point",
        "one line printed and no run folder created"),
    # -- check-data -------------------------------------------------------------------------------
    "check-data --data-dir": effect(
        "test_check_data.py::test_a_clean_folder_exits_0_with_the_table",
        "per-class counts and size statistics equal what the test wrote"),
    "check-data --dataset": effect(
        f"{EFFECTS}::test_dataset_names_a_local_parquet_folder",
        "classes and counts of the parquet files, as pyarrow reads them"),
    "check-data --image-column": effect(
        f"{EFFECTS}::test_columns_chosen_by_flag_reach_training_check_data_eval_and_shard",
        "nothing unreadable and the truth column's counts"),
    "check-data --label-column": effect(
        f"{EFFECTS}::test_columns_chosen_by_flag_reach_training_check_data_eval_and_shard",
        "class counts of the truth column"),
    "check-data --val-labels": effect(
        f"{EFFECTS}::test_val_labels_alike_in_training_and_check_data",
        "held-out class counts are those of the label file the test wrote"),
    "check-data --train-labels": effect(
        "test_train_labels.py::test_train_labels_alike_in_training_check_data_and_eval",
        "class counts are the label file's (pandas' value_counts)"),
    "check-data --class-depth": effect(
        f"{EFFECTS}::test_class_depth_alike_in_training_and_check_data",
        "the top folder names the class: the counts the test wrote"),
    "shard --class-depth": effect(
        f"{EFFECTS}::test_class_depth_alike_in_training_and_check_data",
        "the top folder names the class: index.json's classes and the .cls members tarfile "
        "reads are the counts the test wrote"),
    "check-data --workers": effect(
        "test_check_data.py::test_problems_exit_1_and_are_all_named_in_the_json",
        "1 and 2 workers find exactly the planted problems"),
    "check-data --read-timeout": effect(
        "test_stuck_reads.py::test_check_data_stops_in_one_line_at_a_read_that_never_returns",
        "a FIFO under an image's name: exit 75 after the 3 s given, the one line naming it"),
    "check-data --json": effect(
        "test_check_data.py::test_problems_exit_1_and_are_all_named_in_the_json",
        "one JSON object naming exactly the problems the test planted"),
    # -- shard ------------------------------------------------------------------------------------
    "shard --data-dir": effect(
        f"{STREAM}::test_shard_round_trip_image_folder",
        "decoded shards are pixel- and label-equal to the PNGs written"),
    "shard --dataset": effect(
        f"{STREAM}::test_shard_round_trip_synthetic_and_parquet",
        "synthetic shards equal synthetic.splits(200) pixel for pixel"),
    "shard --synthetic-train-size": effect(
        f"{STREAM}::test_shard_round_trip_synthetic_and_parquet",
        "200 training samples in 24-sample shards: [24]*8 + [8]"),
    "shard --output": effect(
        f"{STREAM}::test_shard_round_trip_image_folder", "index.json and tars read back from it"),
    "shard --shard-size": effect(
        f"{STREAM}::test_shard_round_trip_synthetic_and_parquet",
        "every tar within 40 KB plus tar padding, and as many as the bytes need"),
    "shard --samples-per-shard": effect(
        f"{STREAM}::test_shard_round_trip_synthetic_and_parquet",
        "24 per shard: [24]*8 + [8], by hand"),
    "shard --val-fraction": effect(
        f"{STREAM}::test_shard_round_trip_image_folder",
        "validation shards equal the 0.25 carve that training makes of the same folder"),
    "shard --val-stratify": effect(
        f"{STREAM}::test_shard_carves_class_by_class_with_val_stratify",
        "12 + 4 images at 0.25: validation shards hold 3 and 1 (by hand), training's carve"),
    "shard --train-labels": effect(
        f"{STREAM}::test_shard_reads_label_files_as_training_does",
        "the training shards' labels are the file's (cat, dog, ... written by the test)"),
    "shard --val-labels": effect(
        f"{STREAM}::test_shard_reads_label_files_as_training_does",
        "the validation shards' labels are the file's (dog, cat, ...)"),
    "shard --image-column": effect(
        f"{EFFECTS}::test_columns_chosen_by_flag_reach_training_check_data_eval_and_shard",
        "the shards hold the photo column's pixels exactly"),
    "shard --label-column": effect(
        f"{EFFECTS}::test_columns_chosen_by_flag_reach_training_check_data_eval_and_shard",
        "the shards' labels are the truth column's"),
    "shard --max-side": effect(
        "test_shard_max_side.py::test_a_wide_jpeg_is_resized_to_the_side_and_stays_a_jpeg",
        "1200x800 stored 500x333, the bytes of PIL's Lanczos resize of the file saved at "
        "quality 95; a PNG blended over white by hand, exactly; a small file byte for byte"),
    "shard --read-timeout": effect(
        "test_stuck_reads.py::test_shard_stops_in_one_line_and_its_next_start_finishes",
        "a FIFO under an image's name: exit 75 after the 3 s given, no --output folder"),
    "shard --no-progress": effect(
        f"{EFFECTS}::test_shard_progress_line_or_none",
        "the progress line on stderr without it, an empty stderr with it"),
}
