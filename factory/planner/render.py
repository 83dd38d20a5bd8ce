"""Plans and experiments as Markdown: the value + reason table (with the predicted wall time)
and the experiment card.

The card (what it trains, on which data, with which plan) is shown in the Dagster UI as asset
metadata and written to ``docs/experiments/<name>.md`` by ``factory plan --write-card``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from factory.experiments import Experiment, list_experiments, sweep_points
from factory.planner.plan import Plan
from factory.planner.timing import duration
from factory.recipes import Recipe, load_recipe


def _cell(value: Any) -> str:
    if isinstance(value, float):
        text = f"{value:.4g}"
    elif isinstance(value, list | tuple):
        text = ", ".join(map(str, value)) or "(none)"
    elif value is None:
        text = "-"
    else:
        text = str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def plan_table(plan: Plan) -> str:
    """A Markdown table: key, value, rule, reason; overridden values in bold and marked."""
    lines = ["| key | value | rule | reason |", "|---|---|---|---|"]
    for key, d in plan.decisions.items():
        value = f"**{_cell(d.value)}** (override)" if d.overridden else _cell(d.value)
        lines.append(f"| {key} | {value} | {d.rule} | {_cell(d.reason)} |")
    if plan.memory:
        mem = plan.memory.as_gib()
        lines.append("")
        lines.append(f"Estimated peak memory per device: **{mem['total']:.2f} GiB** of "
                     f"{plan.memory_budget / 2**30:.1f} GiB usable (weights {mem['weights']:.2f}"
                     f", adapters+grads+optimizer "
                     f"{mem['adapters'] + mem['gradients'] + mem['optimizer']:.2f}, activations "
                     f"{mem['activations']:.2f}, logits {mem['logits']:.2f}, overhead "
                     f"{mem['overhead']:.2f}"
                     + (f", kept by the CPU allocator {mem['retained']:.2f}"
                        if mem["retained"] else "") + ").")
    if plan.mix:
        lines += ["", mix_table(plan)]
    if plan.estimates:
        lines.append(wall_time(plan))
    for note in plan.notes:
        lines.append(f"- note: {note}")
    return "\n".join(lines)


def mix_table(plan: Plan) -> str:
    """The mixture's sources (``data.mix``): share of the samples drawn, rows, samples drawn
    over the run and the effective epochs of each."""
    lines = ["| source | weight | share | rows | samples drawn | effective epochs |",
             "|---|---|---|---|---|---|"]
    for m in plan.mix:
        rows = "?" if m["rows"] is None else str(m["rows"])
        epochs = "?" if m["epochs"] is None else f"{m['epochs']:.3g}"
        lines.append(f"| {_cell(m['source'])} | {m['weight']:g} | {m['share']:.1%} | {rows} | "
                     f"~{m['samples']} | {epochs} |")
    return "\n".join(lines)


def wall_time(plan: Plan) -> str:
    """The predicted wall time of a planned run, split into training and evals."""
    e = plan.estimates
    shared = plan["gpu"] == "CPU"
    evals = (f"evals {duration(e['evals_seconds'])} ({e['num_evals']:.0f} of ~"
             f"{duration(e['eval_seconds'])}, the first ~{duration(e['first_eval_seconds'])}"
             + (", on the training cores" if shared else
                ", on their own devices: only the last one lengthens the run") + ")")
    share = (f"{e['eval_share']:.0%} of the wall" if shared
             else f"{e['eval_share']:.0%} of the device time and {e['eval_wall_share']:.0%} "
                  "of the wall")
    source = plan.decisions.get("time_model")
    return (f"Predicted wall time: **{duration(e['wall_seconds'])}**: training "
            f"{duration(e['train_seconds'])} (~{e['steps']:.0f} steps of "
            f"~{e['step_seconds']:.3g} s), {evals}; evals take {share} (budget "
            f"{e['eval_budget_share']:.0%}); time constants: "
            f"{source.value if source else 'defaults'}.")


def wall_summary(plan: Plan) -> str:
    """One line: the predicted wall time and its split."""
    e = plan.estimates
    return (f"predicted wall {duration(e['wall_seconds'])}: training "
            f"{duration(e['train_seconds'])} + evals {duration(e['evals_seconds'])} "
            f"({e['num_evals']:.0f} evals)")


NO_PROFILE = "Not planned yet: the dataset has no profile (materialize `dataset_profile`)."


def experiment_card(experiment: Experiment, recipe: Recipe, plans: Sequence[Plan],
                    error: str | None = None, no_plan: str = NO_PROFILE) -> str:
    """The experiment card: what it trains, on which data, with which plan."""
    data = experiment.data
    arch = recipe.architecture
    out = [f"# Experiment `{experiment.name}`", ""]
    if experiment.raw.get("description"):
        out += [str(experiment.raw["description"]), ""]
    out += [
        f"Source: `{experiment.path.name}` · recipe `{recipe.name}` · "
        f"schedule `{experiment.schedule or 'none'}` · retrain on new samples: "
        f"{'yes' if experiment.retrain_on_new_samples else 'no'}", "",
        "## What it trains", "",
        f"- Base model: `{recipe.base_model_id}` ({arch.num_parameters / 1e9:.2f} B parameters, "
        f"{arch.num_layers} layers, context {arch.max_context})",
        f"- LoRA on {', '.join(recipe.lora_target_modules)} (recipe rank {recipe.lora_rank})"
        + ("; the embedding rows of "
           + ", ".join(f"`{token}`" for token, _ in arch.untrained_tokens)
           + " train with it (a base model's untrained turn tokens)"
           if arch.untrained_tokens else ""),
        f"- Judge: `{experiment.eval.judge if experiment.eval.judge != 'embedded' else recipe.judge_model}`"
        f", rubric `{json.dumps(experiment.eval.rubric) if isinstance(experiment.eval.rubric, dict) else experiment.eval.rubric}`",
        "", "## On which data", "",
        f"- Samples where `{data.where}`",
        f"- Eval fraction {data.eval_fraction:g}, max {data.max_tokens} tokens, near-duplicate "
        f"threshold {data.near_dup_threshold:g}, decontamination {data.decontam_ngram}-grams",
        f"- Dropped by policy: {', '.join(data.drop) or 'nothing'}"
        + (f"; judge threshold {data.judge_threshold:g}" if data.judge_threshold is not None
           else ""),
    ]
    if data.mix:
        out.append("- Mixture (relative weights): "
                   + ", ".join(f"`{m.source}` {m.weight:g}" for m in data.mix))
    if data.balance is not None and data.balance.auto:
        out.append(f"- Traffic balanced by {data.balance.by} where skewed (the planner's "
                   f"default; `balance: none` draws it as it is)")
    elif data.balance is not None:
        out.append(f"- Traffic balanced by {data.balance.by}: each drawn by count ** "
                   f"{data.balance.alpha:g} (samples of no known {data.balance.by} at their "
                   f"own share)")
    if experiment.overrides:
        out += ["", "## Overrides", "",
                *[f"- `{k}`: {_cell(v)}" for k, v in experiment.overrides.items()]]
    points = sweep_points(experiment)
    if experiment.sweep:
        out += ["", f"## Sweep ({len(points)} runs)", "",
                *[f"- `{k}`: {', '.join(_cell(v) for v in vs)}"
                  for k, vs in experiment.sweep.items()]]
    out += ["", "## Plan", ""]
    if error:
        out += [f"Not planned: {error}"]
    elif not plans:
        out += [no_plan]
    else:
        out += [plan_table(plans[0])]
        if len(plans) > 1:
            out += ["", "### Sweep runs", "", comparison_table([p.to_dict() for p in plans])]
    return "\n".join(out) + "\n"


COMPARE_KEYS = ("learning_rate", "lora_rank", "effective_batch_size", "micro_batch_size",
                "grad_accum_steps", "max_seq_len", "gradient_checkpointing")


def comparison_table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown comparison of a sweep's runs: plan values, final loss, best eval score."""
    head = ["run", *COMPARE_KEYS, "peak GiB", "final loss", "best eval"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        values = r.get("values", {})
        cells = [r["run_key"], *[_cell(values.get(k)) for k in COMPARE_KEYS],
                 _cell((r.get("memory_gib") or {}).get("total")),
                 _cell(r.get("final_loss")), _cell(r.get("best_eval_score"))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def committed_cards(experiments_dir: Path) -> dict[str, str]:
    """The card of every experiment file in ``experiments_dir``, from the file alone.

    These are the cards committed under ``docs/experiments/`` (``make cards`` writes them, a
    test holds them equal to the files): what each file trains and on which data. The plan
    needs a dataset profile, so it lives in the ``training_plan`` asset's metadata and in
    ``factory plan NAME --card``, not in the committed card.
    """
    no_plan = ("Planned from the dataset's profile when the data exists: the `training_plan` "
               "asset's metadata in Dagster, or `factory plan {name}`.")
    return {f"{e.name}.md": experiment_card(e, load_recipe(e.recipe), [],
                                            no_plan=no_plan.format(name=e.name))
            for e in list_experiments(experiments_dir)}


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m factory.planner.render EXPERIMENTS_DIR CARDS_DIR``: rewrite the cards."""
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print("usage: python -m factory.planner.render EXPERIMENTS_DIR CARDS_DIR",
              file=sys.stderr)
        return 2
    out = Path(args[1])
    out.mkdir(parents=True, exist_ok=True)
    for name, text in committed_cards(Path(args[0])).items():
        (out / name).write_text(text, encoding="utf-8")
        print(out / name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
