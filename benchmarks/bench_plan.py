"""Per-layer format plans on the packaged models: what each score costs, how well the estimate ranks
the layers, and what the plan does on text it was not chosen on (qlab.advisor, qlab.plan).

For each model: measured, approximated and hierarchical scores of every Linear-like layer in each
format, over the same calibration batches (windows of Shakespeare's training plays), each timed in this
run, with the loss evaluations each made; Spearman's ρ between each cheaper score and the measured one
over the quantized (layer, format) rows, with a percentile bootstrap interval over layers; plans at
each effective-bits budget from each score, with the layers the bootstrap over batches leaves undecided;
and each plan's held-out check on windows of the held-out plays
(``advisor.held_out_check``: the plan's loss minus the float model's, every layer in the cheapest
format's, and the first-and-last-layers rule's at the same budget, paired by batch, Holm over the
three). An encoder gets measured scores only: its hidden-state error against the float model, and that
error's gradient, are zero at the float model, so the second-order estimate is zero for every layer.
The hierarchical score measures each block whole, then the ``--expand`` most sensitive blocks layer by
layer (``advisor.hierarchical_scores``).

Appends to ``benchmarks/results/bench_plan.csv`` (one row per model × score × budget), with the machine.

    python benchmarks/bench_plan.py                       # smollm2-135m and minilm-l6
    python benchmarks/bench_plan.py --models minilm-l6 --batches 2
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from timing import add_results_argument, record

from qlab import advisor, models, plan

FORMATS = ["nvfp4", "mxfp8", "bf16"]
BOOTSTRAP_DRAWS = 2000  # layer resamples behind Spearman's interval


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2-135m,minilm-l6", help="comma-separated packaged models")
    parser.add_argument("--budgets", default="4.5,5.0,6.0", help="effective bits per weight element")
    parser.add_argument("--batches", type=int, default=3, help="calibration batches (2 windows each)")
    parser.add_argument("--held-out", type=int, default=8, help="held-out batches for the check")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per window")
    parser.add_argument("--expand", type=int, default=6, help="hierarchical: blocks measured layer by layer")
    add_results_argument(parser)
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for name in args.models.split(","):
        model, tokenizer, kind = models.load_any(name)
        calibration = models.shakespeare_batches(tokenizer, 2, args.tokens, args.batches, split="train")
        held_out = models.shakespeare_batches(tokenizer, 2, args.tokens, args.held_out, split="val")
        if kind == models.CAUSAL_LM:
            calibration_loss = held_out_loss = advisor.causal_lm_loss
        else:  # an encoder: the hidden-state error against the float model on the same batches
            calibration_loss = advisor.hidden_state_error(model, calibration)
            held_out_loss = advisor.hidden_state_error(model, held_out)
        tables, seconds = {}, {}
        scores = {kind: advisor.score_function(kind, expand=args.expand) for kind in plan.SCORE_KINDS}
        if (
            kind == models.ENCODER
        ):  # its hidden-state error and that error's gradient are 0 at the float model
            del scores["approximated"]
        for kind_name, score in scores.items():
            start = time.perf_counter()
            tables[kind_name] = score(model, calibration, FORMATS, loss_fn=calibration_loss)
            seconds[kind_name] = time.perf_counter() - start
        for kind_name, table in tables.items():
            rho = rho_low = rho_high = float("nan")
            if kind_name != "measured":  # how this score ranks the pairs against the measured one
                rho, rho_low, rho_high = plan.score_agreement(
                    tables["measured"], table, draws=BOOTSTRAP_DRAWS
                )
            evaluations = table.attrs.get("evaluations", table.attrs.get("evaluations_flat", np.nan))
            for budget in (float(b) for b in args.budgets.split(",")):
                chosen = plan.make_plan(table, effective_bits=budget, model=name)
                check = advisor.held_out_check(model, chosen, table, held_out, loss_fn=held_out_loss)
                undecided = int(plan.stability(table, effective_bits=budget, draws=100).undecided.sum())
                held = {}
                for row, short in zip(check.itertuples(), ("float", "cheapest", "ends_first")):
                    name_ = f"held_out_vs_{short}"
                    held |= {name_: row.mean, f"{name_}_low": row.low, f"{name_}_high": row.high,
                             f"{name_}_p_holm": row.p_holm}  # fmt: skip
                counts = {f: sum(v == f for v in chosen.layers.values()) for f in FORMATS}
                rows.append(dict(
                    model=name, score=kind_name, effective_bits=budget,
                    reached_bits=round(chosen.reached_bits, 4),
                    layers=len(chosen.layers), **{f"layers_{f}": counts[f] for f in FORMATS},
                    calibration_batches=args.batches, tokens=args.tokens, held_out_batches=args.held_out,
                    seconds=round(seconds[kind_name], 2),
                    measured_over_this=round(seconds["measured"] / seconds[kind_name], 1),
                    evaluations=evaluations, expand=args.expand if kind_name == "hierarchical" else "",
                    spearman=round(rho, 3), spearman_low=round(rho_low, 3), spearman_high=round(rho_high, 3),
                    undecided_layers=undecided, **held,
                ))  # fmt: skip
                print(rows[-1])
    path = record("bench_plan", rows, args.results)
    print(f"appended {len(rows)} rows to {path}" if path else "recorded nothing (--results '')")


if __name__ == "__main__":
    main()
