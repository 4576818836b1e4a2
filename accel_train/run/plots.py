"""PNG curves of a run, from its metrics.jsonl: what `--plots` writes at the end of training and
what `accel-train plot RUN_DIR` writes on demand.

  loss_lr.png      training loss (and held-out loss at epoch ends) and learning rate vs step
  accuracy.png     running train top-1 and held-out top-1/top-5 vs epoch (and the mean
                   per-class top-1 when the run picks by it), the best epoch by --eval-metric
  throughput.png   images per second and the share of time spent waiting for data vs step

Drawn on matplotlib Figure objects, without pyplot: they need no display (servers, CI,
launched workers), and a program that calls fit() keeps its own backend and open figures
(matplotlib.use would close them) and pays no pyplot import.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

from accel_train.base.readers import read_yaml
from accel_train.run.rundir import PLOTS_DIR, run_paths  # noqa: F401  (PLOTS_DIR: named in messages)
from accel_train.run.track import read_metrics
from accel_train.train.selection import best_of, describe, rank

_FIGURE_SIZE = (8, 6)


def _read_config(run_dir: Path) -> dict:
    config_path = run_paths(run_dir).config
    if not config_path.is_file():
        return {}
    return read_yaml(config_path, "run_config")


def eval_metric_of(config: dict) -> str:
    """The --eval-metric the run picked its best by (a run from before the option: top-1)."""
    return (config.get("train") or {}).get("eval_metric") or "top1"


def _run_name(run_dir: Path, resolved: dict) -> str:
    """The second title line: which run, and what it trained, so a PNG alone says what it is."""
    name = f"run {run_dir.resolve().name}"
    model = (resolved.get("model") or {}).get("model_name")
    return f"{name}: {model}, global batch {resolved.get('global_batch')}" if model else name


def _steps_per_epoch(resolved: dict, epochs: list[dict]) -> Optional[float]:
    """From the run's config.yaml; else from the first full epoch's record."""
    if resolved.get("steps_per_epoch"):
        return float(resolved["steps_per_epoch"])
    full = [e for e in epochs if e.get("epoch_time") is not None and e.get("step")]
    return full[0]["step"] / full[0]["epoch"] if full else None


def _title(ax, text: str, run_name: str):
    ax.set_title(f"{text}\n{run_name}", fontsize=11)


def _mark_resumes(axes, resumes: list[dict], scale: float = 1.0):
    """A dashed line where the run was resumed: a jump in a curve there is explained."""
    for number, record in enumerate(resumes):
        for ax in axes:
            ax.axvline(record["step"] / scale, color="grey", linestyle="--", linewidth=1,
                       label="resumed" if number == 0 and ax is axes[0] else None)


def _style(ax, xlabel: Optional[str], ylabel: str):
    if xlabel:
        ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="best", fontsize=9)


def _marker(count: int) -> str:
    """Markers when there are few points, so a short run's single point is still visible."""
    return "o" if count <= 30 else ""


def _figure():
    # imported here: a run with --no-plots, or one that has not finished, never loads matplotlib
    from matplotlib.figure import Figure

    return Figure(figsize=_FIGURE_SIZE)


def _save(fig, path: Path):
    fig.tight_layout()
    fig.savefig(path, dpi=100)  # the Agg renderer chosen by the file's suffix


def _step_figure(path: Path, title: str, run_name: str, resumes, labels: tuple[str, str],
                 draw):
    """Two panels against the optimizer step: `draw(top_axes, bottom_axes)` fills them."""
    fig = _figure()
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    draw(top, bottom)
    _mark_resumes([top, bottom], resumes)
    _title(top, title, run_name)
    _style(top, None, labels[0])
    _style(bottom, "optimizer step", labels[1])
    _save(fig, path)


def _plot_loss_lr(train, epochs, resumes, run_name, path: Path):
    steps, marker = [r["step"] for r in train], _marker(len(train))

    def draw(loss_ax, lr_ax):
        loss_ax.plot(steps, [r["loss"] for r in train], marker=marker, markersize=3,
                     label="train loss (mean over each logged window)")
        evals = [e for e in epochs if e.get("eval_loss") is not None]
        if evals:
            loss_ax.plot([e["step"] for e in evals], [e["eval_loss"] for e in evals],
                         marker="s", linestyle="--", label="held-out loss (epoch end)")
        lr_ax.plot(steps, [r["lr"] for r in train], color="tab:green", marker=marker,
                   markersize=3)
        lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))

    _step_figure(path, "Loss and learning rate", run_name, resumes,
                 ("cross-entropy loss", "learning rate"), draw)


def _plot_throughput(train, resumes, run_name, path: Path):
    steps, marker = [r["step"] for r in train], _marker(len(train))

    def draw(speed_ax, wait_ax):
        speed_ax.plot(steps, [r["img_per_s"] for r in train], marker=marker, markersize=3,
                      label="all processes together")
        median = sorted(r["img_per_s"] for r in train)[len(train) // 2]
        speed_ax.axhline(median, color="tab:blue", linestyle=":", linewidth=1,
                         label=f"median {median:.0f} images/s")
        speed_ax.set_ylim(bottom=0)
        waits = [100 * r["data_wait"] for r in train]
        wait_ax.plot(steps, waits, color="tab:red", marker=marker, markersize=3)
        # Up to 10% on a fixed 0-10 scale, so that 0.5% reads as small but not as nothing and
        # runs compare at a glance; beyond that the axis follows the data up to 100%.
        wait_ax.set_ylim(0, min(101, max(10, 1.15 * max(waits))))

    _step_figure(path, "Throughput (training images per second)", run_name, resumes,
                 ("images / s", "waiting for data (%)"), draw)


def accuracy_title(final: Optional[dict]) -> str:
    """The final numbers, readable without a ruler: the raw weights', and with --model-ema the
    averaged weights' beside them (the run saves the better of the two)."""
    if not final:
        return "Accuracy"
    text = (f"Accuracy: final held-out top-1 {100 * final['eval_top1']:.1f}%, top-5 "
            f"{100 * final['eval_top5']:.1f}%")
    if final.get("eval_ema_top1") is not None:
        text += f"; EMA weights top-1 {100 * final['eval_ema_top1']:.1f}%"
    return text


def best_epoch(epochs: list[dict], metric: str) -> Optional[tuple[dict, float]]:
    """The epoch record holding the run's best held-out number by `metric` (the better of its
    raw and EMA weights', as the run saves the better) and that number; the first of equal
    ones, as the run replaces its best only by a better one.  None: nothing evaluated."""
    best, best_value, best_rank = None, None, -math.inf
    for record in epochs:
        value = best_of(metric, record.get(f"eval_{metric}"), record.get(f"eval_ema_{metric}"))
        if value is not None and rank(metric, value) > best_rank:
            best, best_value, best_rank = record, value, rank(metric, value)
    return None if best is None else (best, best_value)


def best_label(record: dict, value: float, metric: str) -> str:
    return f"best held-out {describe(metric, value)} (epoch {record['epoch']})"


def _plot_accuracy(train, epochs, resumes, steps_per_epoch, run_name, path: Path,
                   metric: str = "top1"):
    fig = _figure()
    ax = fig.subplots()
    scale = steps_per_epoch or 1.0
    with_top1 = [r for r in train if r.get("top1") is not None]
    if with_top1 and steps_per_epoch:  # runs from before train accuracy was logged have none
        ax.plot([r["step"] / scale for r in with_top1], [100 * r["top1"] for r in with_top1],
                marker=_marker(len(with_top1)), markersize=3, alpha=0.8,
                label="train top-1 (running, augmented images)")
    evals = [e for e in epochs if e.get("eval_top1") is not None]
    x = [e["step"] / scale if steps_per_epoch else e["epoch"] for e in evals]
    ax.plot(x, [100 * e["eval_top1"] for e in evals], marker="s", linewidth=2,
            label="held-out top-1")
    ax.plot(x, [100 * e["eval_top5"] for e in evals], marker="^", linestyle="--",
            label="held-out top-5")
    if metric == "mean_class_top1":  # what the run picks by: top-1 hides a neglected class
        with_mean = [(xi, e) for xi, e in zip(x, evals) if e.get("eval_mean_class_top1")
                     is not None]
        ax.plot([xi for xi, _ in with_mean], [100 * e["eval_mean_class_top1"]
                                              for _, e in with_mean],
                marker="D", linestyle="-.", label="held-out mean per-class top-1")
    with_ema = [(xi, e) for xi, e in zip(x, evals) if e.get("eval_ema_top1") is not None]
    if with_ema:  # --model-ema: the averaged weights, evaluated beside the raw ones
        ax.plot([xi for xi, _ in with_ema], [100 * e["eval_ema_top1"] for _, e in with_ema],
                marker="o", linewidth=2, label="held-out top-1, EMA weights")
    best = best_epoch(evals, metric)
    if best is not None:  # the epoch whose weights --keep-best and model.safetensors hold
        record, value = best
        ax.axvline(record["step"] / scale if steps_per_epoch else record["epoch"],
                   color="tab:green", linestyle=":", linewidth=1.5,
                   label=best_label(record, value, metric))
    ax.set_ylim(0, 101)
    ax.set_xlim(left=0)
    if steps_per_epoch:
        _mark_resumes([ax], resumes, scale)
    _title(ax, accuracy_title(evals[-1] if evals else None), run_name)
    _style(ax, "epoch", "accuracy (%)")
    _save(fig, path)


def write_plots(run_dir: Path, out_dir: Optional[Path] = None) -> list[Path]:
    """Draw the run's curves into out_dir (default <run>/plots); returns the files written.
    A run that logged nothing yet (no metrics.jsonl lines) gets no plots."""
    run_dir = Path(run_dir)
    metrics_path = run_paths(run_dir).metrics
    records = read_metrics(metrics_path) if metrics_path.is_file() else []
    train = [r for r in records if r.get("type") == "train" and r.get("loss") is not None]
    epochs = [r for r in records if r.get("type") == "epoch"]
    resumes = [r for r in records if r.get("type") == "resume"]
    if not train and not epochs:
        return []  # nothing to draw: no folder made either
    out_dir = Path(out_dir) if out_dir is not None else run_paths(run_dir).plots
    out_dir.mkdir(parents=True, exist_ok=True)
    config = _read_config(run_dir)
    resolved = config.get("resolved") or {}
    run_name = _run_name(run_dir, resolved)
    written = []
    if train:
        written.append(out_dir / "loss_lr.png")
        _plot_loss_lr(train, epochs, resumes, run_name, written[-1])
        written.append(out_dir / "throughput.png")
        _plot_throughput(train, resumes, run_name, written[-1])
    if epochs:
        written.append(out_dir / "accuracy.png")
        _plot_accuracy(train, epochs, resumes, _steps_per_epoch(resolved, epochs), run_name,
                       written[-1], eval_metric_of(config))
    return written
