"""What a start records once it is known good: the logs opened (a resumed run's cut back to its
checkpoint), config.yaml with the facts it resolved, the elastic job's marker, the trackers,
and the start-up summary.  A failed start writes none of it.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist

from accel_train.data.class_weights import describe_weights
from accel_train.data.sources import ArraySource
from accel_train.run import distributed
from accel_train.run.report import records_text, summary
from accel_train.run.resume import record_elastic_job, set_aside_newer
from accel_train.run.rundir import write_run_config
from accel_train.train.precision import precision_name


def resolved_facts(accelerator, config, plan, data, net, loaders, speed, precision: str,
                   cuda_math: Optional[str], host_memory: Optional[str],
                   network_choice: Optional[str],
                   known_total: Optional[int], class_weights=None) -> dict:
    """What this start really runs, for config.yaml's `resolved` and the summary.
    `known_total`: the run's length, None while a time budget is to fit it (then recorded when
    it does); `class_weights`: --class-weight's, one a class, or None."""
    return {"precision_used": precision_name(precision),
            "precision_requested": config.mixed_precision,
            "channels_last": speed.channels_last, "speed_choice": speed.how,
            "speed_timings": speed.timings,
            "device": str(accelerator.device), "cpu_threads": torch.get_num_threads(),
            # this process's share of its machine's cores, beside the ranks there (the loader
            # workers' default and a hand-started rank's threads follow it)
            "cpu_cores": round(distributed.process_cores(1), 2),
            "distributed_type": str(accelerator.distributed_type), "cuda_math": cuda_math,
            "host_memory": host_memory,
            "world_size": accelerator.num_processes, "global_batch": loaders.global_batch,
            "steps_per_epoch": loaders.steps_per_epoch, "total_steps": known_total,
            "max_steps": config.max_steps,
            "data": data.description, "data_from_program": data.from_program,
            "train_samples": len(data.train), "eval_samples": len(data.held_out),
            "test_samples": len(data.test) if data.test is not None else 0,
            "sample_subset": data.sample_subset,  # the rule of a sample limit that cut a split
            "labels": data.labels,  # a metadata file's, where one gave them
            "num_workers": loaders.num_workers, "train_loader": loaders.choice,
            "held_out_batches": loaders.held_out_batches,
            "jpeg_decoding": loaders.decoding,
            "data_in_memory": isinstance(data.train, ArraySource),
            # the training photos decoded once on the device (--data-on-device)
            "photos_held": bool(loaders.photos_held),
            "photos_held_seconds": loaders.train.held.seconds if loaders.photos_held else None,
            # resized, cropped and flipped on the device rather than in the loader
            "placed_on_device": loaders.train.finish.places,
            "sync_bn": net.sync_bn, "model": net.spec.__dict__, "whitened_stem": net.whitened,
            "pretrained": net.weights,
            "network_choice": network_choice, "trainable_parameters": net.num_trainable,
            "class_weights": None if class_weights is None else
            {"weights": [round(float(w), 6) for w in class_weights],
             "summary": describe_weights(class_weights, data.class_names)},
            "launcher": distributed.launcher_facts(),
            "output_dir": str(plan.output_dir), "checkpoint_dir": str(plan.checkpoint_dir),
            "checkpoint_minutes": config.checkpoint_minutes}


def open_records(accelerator, plan, config, speed, state, metrics, report, paths, facts: dict,
                 data_description: str, learning_rate_change: Optional[tuple[float, float]],
                 warnings: list[Optional[str]]) -> None:
    """The start is good: open the logs, record the run, say what will run."""
    is_main = accelerator.is_main_process
    if plan.resume is not None:  # reads metrics.jsonl: a damaged one stops before any write
        metrics.truncate_after(state.step)  # the steps after it are about to be redone
    if plan.resume_from is not None and is_main:
        # Only now that every part has loaded: that future is about to be redone (resume.py).
        set_aside_newer(plan.checkpoint_dir, state.step, report.warn)
    report.open_log(paths.logs, accelerator.process_index, distributed.describe_process())
    if plan.resume_from is None and plan.resume is not None:
        report.say("no valid checkpoint found: starting from scratch")
    elif plan.resume_from is not None:
        metrics.write({"type": "resume", "step": state.step, "from": str(plan.resume_from),
                       "world_size": accelerator.num_processes,
                       "previous_world_size": plan.previous.world_size,
                       "accumulation_steps": config.accumulation_steps})
        report.say(f"resumed from {plan.resume_from} at step {state.step} (epoch "
                   f"{state.epoch + 1}, {state.samples_in_epoch} samples into it)")
        if plan.accumulation_change is not None:
            report.say(plan.accumulation_change)
        if learning_rate_change is not None:
            before, now = learning_rate_change
            report.say(f"--learning-rate {now:g} (the checkpoint's run had {before:g}): the "
                       f"schedule goes on from step {state.step}, scaled")
    if is_main:
        # What auto chose is recorded as the option: `--config config.yaml` repeats the run
        # exactly instead of timing the machine again (speed_choice says it was auto's).
        chosen = dataclasses.replace(config, mixed_precision=speed.precision,
                                     channels_last=speed.channels_last,
                                     decode_on_device={True: "always", False: "never"}.get(
                                         state.decoded_on_device, config.decode_on_device),
                                     host_decode_share=state.host_decode_share
                                     if state.host_decode_share is not None
                                     else config.host_decode_share,
                                     data_on_device={True: "always", False: "never"}.get(
                                         state.photos_held, config.data_on_device))
        write_run_config(plan.output_dir, chosen, facts, resumed=plan.resume_from is not None)
        record_elastic_job(plan.output_dir, plan.env.run_id)
    if config.report_to:
        accelerator.init_trackers("accel_train", config={
            k: v for k, v in config.to_dict().items() if isinstance(v, (int, float, str, bool))})
    for text in filter(None, warnings):
        report.warn(text)
    backend = dist.get_backend() if accelerator.num_processes > 1 else None
    report.say(summary(facts, data_description, config.accumulation_steps, backend,
                       records_text(paths, config.report_to, config.plots)))

