"""qlab.probes: statistics against direct computation, hook hygiene, probe(), the gradient audit, and
the recorded gradients against torch's own full backward hooks."""

import math

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

from qlab import quantize as Q
from qlab.probes import STATS, GradientAudit, ProbeSet, block_stats, probe, tensor_stats, what_if_stats


def small_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def test_tensor_stats_equal_direct_float64_computation():
    x = torch.tensor([0.0, -3.0, 0.25, 0.0, 5.0, -(2.0**-10)])
    s = tensor_stats(x)
    x64 = x.double()
    assert (s["min"], s["max"], s["amax"]) == (-3.0, 5.0, 5.0)  # exact
    assert s["zero_fraction"] == 2 / 6
    assert s["dynamic_range"] == math.log2(5.0) + 10  # log2(5) − log2(2^-10)
    assert s["mean"] == pytest.approx(x64.mean().item(), rel=1e-15)
    assert s["std"] == pytest.approx(math.sqrt(((x64 - x64.mean()) ** 2).mean().item()), rel=1e-14)
    assert s["l1"] == pytest.approx(8.25 + 2.0**-10, rel=1e-15)
    assert s["l2"] == pytest.approx(math.sqrt(9 + 0.0625 + 25 + 2.0**-20), rel=1e-15)
    assert math.isnan(tensor_stats(torch.zeros(3))["dynamic_range"])


def test_what_if_counts_underflow_and_saturation_by_hand():
    # MXFP8 FLOOR on one block: amax 480 → X = 1, so 480 saturates to 448 and 2^-11 (below e4m3's
    # smallest subnormal 2^-9, under X = 1) flushes to zero; the other 30 zeros are not underflow
    x = torch.zeros(32)
    x[0], x[1] = 480.0, 2.0**-11
    stats = what_if_stats(x, "mxfp8")
    assert stats["underflow_fraction"] == 1 / 32 and stats["saturation_fraction"] == 1 / 32
    expected_mse = ((480.0 - 448.0) ** 2 + (2.0**-11) ** 2) / 32
    assert stats["qdq_mse"] == pytest.approx(expected_mse, rel=1e-15)
    assert stats["sqnr_db"] == pytest.approx(Q.sqnr_db(x, Q.qdq(x, "mxfp8")), rel=1e-15)


def test_recorded_statistics_equal_statistics_of_the_same_tensors():
    model = small_model()
    x = torch.randn(5, 8)
    with ProbeSet(model, modules=["0"], roles=("input", "output", "param_grad")) as probes:
        model(x).sum().backward()
        probes.record_param_grads()
    frame = probes.to_frame().set_index(["module", "role", "stat"]).value
    assert frame["0", "input", "amax"] == x.abs().max().item()
    assert frame["0", "output", "l2"] == pytest.approx(
        torch.linalg.vector_norm(model[0](x).double()).item(), rel=1e-12
    )
    assert frame["0.weight", "param_grad", "max"] == model[0].weight.grad.max().item()


def test_hooks_are_removed_on_exit_and_change_nothing():
    def run(with_probes):
        model = small_model(seed=3)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
        if with_probes:
            with ProbeSet(model, what_if={"nv": "nvfp4"}):
                y = model(x)
                y.sum().backward()
        else:
            y = model(x)
            y.sum().backward()
        return model, y, [p.grad for p in model.parameters()]

    model, y_probed, grads_probed = run(True)
    _, y_plain, grads_plain = run(False)
    assert torch.equal(y_probed, y_plain) and all(
        torch.equal(a, b) for a, b in zip(grads_probed, grads_plain)
    )
    assert all(not m._forward_hooks and not m._backward_hooks for m in model.modules())
    assert all(not p._backward_hooks for p in model.parameters())


def test_probe_records_into_the_active_set_with_the_step_and_is_a_no_op_otherwise():
    probe(torch.ones(3), "nobody listens")  # no active set: nothing happens, nothing raises
    probes = ProbeSet(small_model(), stats=("l1",))
    with probes:
        probes.step()
        probe(torch.ones(3), "inside backward")
    probe(torch.ones(3), "after exit")
    frame = probes.to_frame()
    assert frame[["step", "module", "role", "stat", "value"]].values.tolist() == [
        [1, "inside backward", "probe", "l1", 3.0]
    ]


def test_sampling_every_n_steps_between_start_and_end():
    probes = ProbeSet(small_model(), stats=("amax",), every=3, start=2, end=9)
    with probes:
        for _ in range(12):
            probe(torch.ones(1), "x")
            probes.step()
    assert sorted(probes.to_frame().step.tolist()) == [2, 5, 8]


def test_setting_the_step_counter_moves_sampling_with_it():
    """A resumed run sets ``current_step`` (qlab.train does); which steps record follows the new value
    at once, hooks included, and a step that is not an int ≥ 0 is refused by name."""
    model = small_model()
    probes = ProbeSet(model, roles=("output",), stats=("amax",), every=5, start=5)
    with probes:
        model(torch.ones(1, 8))  # step 0 lies before start: no hooks, no records
        assert not model[0]._forward_hooks
        probes.current_step = 10
        assert model[0]._forward_hooks
        model(torch.ones(1, 8))
        probes.current_step = 11
        probe(torch.ones(1), "x")
        model(torch.ones(1, 8))
    assert set(probes.to_frame().step) == {10}
    for bad in (-1, 2.5, "3"):
        with pytest.raises((TypeError, ValueError), match="current_step"):
            probes.current_step = bad


def test_grad_input_is_recorded_when_autograd_grad_asks_for_the_input_only():
    """The tap's gradient is read by a hook on its own node, which runs whenever the gradient goes on
    to the input: ``torch.autograd.grad(loss, x)`` records grad_input as ``backward()`` does."""
    model = small_model()
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(4), requires_grad=True)
    with ProbeSet(model, modules=["0"], roles=("grad_input",), stats=("l2",)) as probes:
        (grad_x,) = torch.autograd.grad(model(x).square().sum(), x)
    got = probes.to_frame().value.tolist()
    assert got == pytest.approx([torch.linalg.vector_norm(grad_x.double()).item()], rel=1e-12)


def test_a_forward_without_gradients_taps_nothing_and_reentrant_checkpointing_records_grad_input():
    """Under no_grad the input's tap has no node: the forward must run and record no grad_input. With
    reentrant checkpointing (a first forward under no_grad, then a recomputation with gradients) the
    recomputation's tap records the gradient into the module, as torch's full backward hook sees it."""
    from torch.utils.checkpoint import checkpoint

    model = small_model()
    with ProbeSet(model, modules=["0"], roles=("grad_input",), stats=("l2",)) as probes:
        with torch.no_grad():
            model(torch.randn(2, 8, requires_grad=True))
    assert probes.to_frame().empty

    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(3)
            self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

        def forward(self, x):
            return self.c(checkpoint(self.b, self.a(x), use_reentrant=True))

    net = Checkpointed()
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(6))
    seen = []
    handle = net.b.register_full_backward_hook(lambda _, gi, go: seen.append(gi[0].clone()))
    net(x).square().sum().backward()
    handle.remove()
    with ProbeSet(net, modules=["b"], roles=("grad_input",), stats=("l2",)) as probes:
        net(x).square().sum().backward()
    got = probes.to_frame().value.tolist()
    assert got == pytest.approx([torch.linalg.vector_norm(seen[0].double()).item()], rel=1e-12)


def test_param_grads_carry_the_rank_when_distributed_starts_after_the_set(monkeypatch):
    """The rank is read once a step for the hooks' records, and again by record_param_grads: a set made
    before torch.distributed started still files param_grad under the rank it has by then."""
    from qlab import probes as probes_module

    model = small_model()
    model(torch.randn(2, 8)).sum().backward()
    probes = ProbeSet(model, modules=["0"], roles=("param_grad",), stats=("l2",), ranks=[1])
    monkeypatch.setattr(probes_module, "_rank", lambda: 1)  # as if init_process_group ran just now
    probes.record_param_grads()
    frame = probes.to_frame()
    assert len(frame) == 2 and set(frame["rank"]) == {1}


def test_string_columns_have_the_dtype_pandas_gives_strings():
    """module, role and stat are built from their distinct values; the frame must hold what a frame
    built from plain Python strings holds, dtype included (object, or pandas 3's str)."""
    model = small_model()
    with ProbeSet(model, modules=["0", "2"], roles=("input", "output"), stats=("amax", "l1")) as probes:
        model(torch.randn(2, 8, generator=torch.Generator().manual_seed(5)))
    frame = probes.to_frame()
    rows = frame.values.tolist()
    plain = pd.DataFrame(rows, columns=frame.columns)
    pd.testing.assert_frame_equal(frame, plain)
    assert [row[2:5] for row in rows[:4]] == [
        ["0", "input", "amax"], ["0", "input", "l1"], ["0", "output", "amax"], ["0", "output", "l1"]
    ]  # fmt: skip


def test_audit_explains_grad_scaler_accumulation_and_clipping():
    model = small_model(seed=5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    microbatches = 4
    with GradientAudit(model) as audit:
        for i in range(microbatches):
            x = torch.randn(6, 8, generator=torch.Generator().manual_seed(i))
            scaler.scale(model(x).pow(2).mean() / microbatches).backward()
    scaler.unscale_(optimizer)
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.05)
    coefficient = min(1.0, 0.05 / (total.item() + 1e-6))  # what clip_grad_norm_ multiplied by
    assert coefficient < 1  # clipping really happened
    report = audit.report(loss_scale=scaler.get_scale(), clip_coefficient=coefficient, tolerance=1e-5)
    assert len(report) == 4 and not report.flagged.any()
    # float32 gradients against a float64 prediction: a few float32 ulps
    assert (report.unexplained < 1e-5).all()
    assert report.explained_ratio.iloc[0] == pytest.approx(2.0**16 / coefficient)


def test_audit_flags_an_injected_scale_bug():
    weight = nn.Parameter(torch.randn(3, 5))
    model = nn.Module()
    model.weight = weight
    audit = GradientAudit(model, hook_parameters=False)

    class DoubledBackward(torch.autograd.Function):  # a custom backward that mis-scales its weight gradient
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return x @ w.T

        @staticmethod
        def backward(ctx, dy):
            x, w = ctx.saved_tensors
            audit.observe("weight", dy.T @ x)  # what a probe inside backward sees
            return dy @ w, 2.0 * dy.T @ x  # ...and the bug: twice that goes to autograd

    with audit:
        DoubledBackward.apply(torch.randn(4, 5), weight).sum().backward()
    report = audit.report()
    # final = 2g, predicted = g: unexplained ‖2g − g‖ / ‖2g‖ = 1/2, far beyond the tolerance
    assert report.flagged.all() and report.unexplained.iloc[0] == pytest.approx(0.5, rel=1e-12)


def test_stats_names_are_the_documented_ones():
    assert set(tensor_stats(torch.ones(2))) == set(STATS)


def _ddp_audit_worker(rank, world_size, init_file, result_file):
    import gc

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        torch.manual_seed(0)  # the same initial weights on both ranks
        model = DistributedDataParallel(small_model(seed=7))
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        with GradientAudit(model.module) as audit:
            for micro in range(2):  # each rank its own data, two micro-batches
                x = torch.randn(6, 8, generator=torch.Generator().manual_seed(100 * rank + micro))
                scaler.scale(model(x).pow(2).mean() / 2).backward()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler.unscale_(optimizer)
        report = audit.report(loss_scale=scaler.get_scale(), tolerance=1e-5)
        if rank == 0:
            report.to_csv(result_file, index=False)
        # every all-reduce finished and DDP's reducer freed while the group lives: freed after
        # destroy_process_group, gloo's teardown can deadlock on the GIL (seen once under load)
        dist.barrier()
        del model, optimizer
        gc.collect()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_audit_explains_two_rank_gloo_ddp_averaging(tmp_path):
    import pandas as pd
    import torch.multiprocessing as mp

    result = tmp_path / "report.csv"
    mp.spawn(_ddp_audit_worker, args=(2, str(tmp_path / "init"), str(result)), nprocs=2, join=True)
    report = pd.read_csv(result)
    # DDP averages the ranks' summed micro-batch gradients: world_size 2 and the loss scale explain it
    assert len(report) == 4 and (report.world_size == 2).all() and not report.flagged.any()
    assert (report.unexplained < 1e-5).all()


def test_hooks_exist_only_on_sampled_steps():
    model = small_model()
    probes = ProbeSet(model, every=2)
    with probes:
        assert model[0]._forward_hooks  # step 0 is sampled
        probes.step()
        assert not any(m._forward_hooks or m._backward_hooks for m in model.modules())
        assert not any(p._backward_hooks for p in model.parameters())
        probes.step()
        assert model[0]._forward_hooks
    assert not model[0]._forward_hooks


def test_log2_histogram_counts_binades_by_hand():
    from qlab.probes import log2_histogram

    h = log2_histogram(torch.tensor([0.0, 1.0, 1.5, -3.0, 2.0**-50, 2.0**30]), low=-2, high=4)
    # 1 and 1.5 in [2^0, 2^1); -3 in [2^1, 2^2); 0 and 2^-50 below 2^-2; 2^30 at or above 2^4
    assert (h["hist/2^0"], h["hist/2^1"], h["hist/below"], h["hist/above"]) == (2.0, 1.0, 2.0, 1.0)
    assert sum(h.values()) == 6


def test_log2_histogram_reads_each_value_in_its_own_precision_and_bins_inf_above():
    # bins against math.frexp of each value (Python floats are float64): inf at or above, NaN nowhere
    from qlab.probes import log2_histogram

    wide = torch.tensor([1e300, 1e-300, 1 - 2.0**-30, -(2.0**-1074), 3.0], dtype=torch.float64)
    h = log2_histogram(wide, low=-1100, high=1100)
    for value in wide.tolist():
        assert h[f"hist/2^{math.frexp(abs(value))[1] - 1}"] >= 1, value
    assert (h["hist/2^996"], h["hist/2^-997"], h["hist/2^-1"], h["hist/2^-1074"]) == (1.0, 1.0, 1.0, 1.0)
    special = log2_histogram(torch.tensor([math.inf, -math.inf, math.nan, 0.0, 1.0]), low=-2, high=4)
    assert (special["hist/above"], special["hist/below"], special["hist/2^0"]) == (2.0, 1.0, 1.0)
    assert special["hist/2^-1"] == 0 and sum(special.values()) == 4  # the NaN is in no bin


def test_probe_set_saves_a_tidy_csv(tmp_path, monkeypatch):
    monkeypatch.setenv("QLAB_RESULTS_DIR", str(tmp_path))
    with ProbeSet(small_model(), stats=("amax",), histograms=True) as probes:
        probe(torch.tensor([4.0]), "x")
    path = probes.save("probes_test")
    text = path.read_text().splitlines()
    assert text[0] == "step,rank,module,role,stat,value" and "0,0,x,probe,amax,4" in text
    assert "0,0,x,probe,hist/2^2,1" in text


def test_seed_model_training_ratio_is_the_loss_scale(monkeypatch):
    from qlab import seed_model

    monkeypatch.setenv("QLAB_COMPILE", "0")  # compiling the statistics costs seconds; eager is tested below

    run = seed_model.train("corrected", "adam", 3, loss_scale=2.0**10, width=32, depth=1, tokens=8, batch=4)
    # the probe inside backward sees ×scale; param.grad is unscaled: the ratio is the scale to
    # float32 rounding
    assert ((run.ratio / run.loss_scale - 1).abs() < 1e-5).all() and (run.audit_unexplained < 1e-6).all()


# --- batched statistics: one fused reduction per shape and step ---------------------------------------


def _direct_stats(x: torch.Tensor) -> dict[str, float]:
    """STATS of one tensor computed here in float64, element by element where it matters."""
    x64 = x.double().flatten()
    magnitude = x64.abs()
    channels = x64.abs().reshape(-1, x.shape[-1] if x.dim() else 1).amax(0).sort().values
    nonzero = magnitude[magnitude > 0]
    return {
        "min": x64.min().item(),
        "max": x64.max().item(),
        "mean": x64.mean().item(),
        "std": ((x64 - x64.mean()) ** 2).mean().sqrt().item(),
        "l1": magnitude.sum().item(),
        "l2": (x64 * x64).sum().sqrt().item(),
        "amax": magnitude.max().item(),
        "dynamic_range": math.log2(magnitude.max().item()) - math.log2(nonzero.min().item()),
        "zero_fraction": (x64 == 0).double().mean().item(),
        "outlier_ratio": (channels[-1] / channels[(len(channels) - 1) // 2]).item(),
    }


@pytest.mark.parametrize("compiled", ["0", "1"])
def test_batched_statistics_equal_float64_statistics_of_each_tensor(compiled, monkeypatch):
    """Tensors of several shapes, dtypes and ranks recorded in one step, interleaved, with the batched
    reduction forced to flush mid-step (a small byte cap) and one tensor above the batching size: every
    statistic equals the float64 one of its own tensor (min/max/amax/zeros exact; sums to 1e-12, as
    the float64 summation order differs), in recording order."""
    import qlab.probes as P

    monkeypatch.setenv("QLAB_COMPILE", compiled)
    monkeypatch.setattr(P, "_FUSED_MIN_NUMEL", 1)  # every batch through torch.compile when compiled
    monkeypatch.setattr(P, "_BATCH_MAX_NUMEL", 600)  # the 24×32 tensor is reduced alone
    monkeypatch.setattr(P, "_BATCH_MAX_BYTES", 3000)  # flushes in the middle of the step
    g = torch.Generator().manual_seed(4)
    tensors = []
    for i in range(5):
        tensors.append(torch.randn(3, 4, 8, generator=g) * 10.0 ** (i - 2))  # one batch of 5
        tensors.append(torch.randn(8, generator=g).bfloat16())  # bf16 rows, stats of the bf16 values
        tensors.append(torch.randn(2, 8, generator=g).relu())  # exact zeros
    tensors += [torch.tensor(-2.5), torch.randn(24, 32, generator=g)]
    tensors[0][0, 0, :] *= 1000.0  # an outlier channel row
    probes = ProbeSet(small_model())
    with probes:
        for i, x in enumerate(tensors):
            probe(x, f"t{i}")
    frame = probes.to_frame()
    assert frame.module.drop_duplicates().tolist() == [f"t{i}" for i in range(len(tensors))]
    values = frame.set_index(["module", "stat"]).value
    for i, x in enumerate(tensors):
        expected = _direct_stats(x)
        for stat in ("min", "max", "amax", "zero_fraction"):
            assert values[f"t{i}", stat] == expected[stat], (i, stat)
        for stat in ("mean", "std", "l1", "l2", "dynamic_range", "outlier_ratio"):
            if x.dim() == 0 and stat in ("dynamic_range", "outlier_ratio"):
                continue
            assert values[f"t{i}", stat] == pytest.approx(expected[stat], rel=1e-12, abs=1e-300), (i, stat)
    assert values["t15", "std"] == 0 and values["t15", "outlier_ratio"] == 1
    assert not P._fused_failed  # the compiled reduction ran; it did not fall back to eager


def test_statistics_are_of_the_values_at_recording_time_not_after_in_place_changes(monkeypatch):
    """A Linear's output recorded, then changed in place by the inplace ReLU after it, and a parameter
    gradient recorded, then zeroed in place: the records keep the values the hooks saw."""
    monkeypatch.setenv("QLAB_COMPILE", "0")  # the staging copies are the same either way
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(inplace=True), nn.Linear(16, 4))
    x = torch.randn(64, 8)
    with torch.no_grad():
        expected_min = model[0](x).min().item()  # negative: the ReLU clears it in place afterwards
    with ProbeSet(model, modules=["0"], roles=("output", "param_grad"), stats=("min", "l2")) as probes:
        model(x).sum().backward()
        probes.record_param_grads()
        expected_l2 = torch.linalg.vector_norm(model[0].weight.grad.double()).item()
        model.zero_grad(set_to_none=False)
        probes.step()
    values = probes.to_frame().set_index(["module", "role", "stat"]).value
    assert expected_min < 0 and values["0", "output", "min"] == expected_min
    assert values["0.weight", "param_grad", "l2"] == pytest.approx(expected_l2, rel=1e-12)


def test_a_gradient_recorded_twice_is_read_twice_across_grad_scaler_unscaling(monkeypatch):
    """The same gradient tensor recorded as grad_flow (scaled, during backward) and as param_grad (after
    GradScaler.unscale_): two readings, 2¹⁰ apart. unscale_'s kernel rewrites the gradient in place
    without moving autograd's version counter, so staging must copy it at each record (no reuse)."""
    monkeypatch.setenv("QLAB_COMPILE", "0")
    model = small_model(seed=2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with ProbeSet(model, roles=("grad_flow", "param_grad"), stats=("l2", "amax")) as probes:
        scaler.scale(model(torch.randn(6, 8, generator=torch.Generator().manual_seed(0))).sum()).backward()
        scaler.unscale_(optimizer)
        probes.record_param_grads()
        probes.step()
    values = probes.to_frame().pivot_table(index=["module", "stat"], columns="role", values="value")
    assert len(values) == 8  # 4 parameters × 2 statistics
    # a power-of-two scale divides float32 exactly: the ratio is exact
    assert (values.grad_flow / values.param_grad == 2.0**10).all()


# --- statistics that SQNR hides (hand-computed tensors) ------------------------------------------------


def test_outlier_ratio_is_the_top_channel_over_the_median_channel():
    # channels are the last axis: amaxes 1, 2, 3, 100 -> lower median 2 -> ratio 50
    x = torch.tensor([[1.0, -2.0, 3.0, 100.0], [0.5, 1.0, -2.5, 7.0]])
    assert tensor_stats(x, stats="outlier_ratio") == {"outlier_ratio": 50.0}
    assert tensor_stats(torch.tensor([[0.0, 0.0, 5.0]]), stats="outlier_ratio") == {"outlier_ratio": math.inf}
    assert math.isnan(tensor_stats(torch.zeros(2, 3), stats="outlier_ratio")["outlier_ratio"])


def test_bulk_error_is_the_median_relative_error_that_outliers_cannot_hide():
    # amax 448 makes the FP8 scale 1; 1.0625 lies halfway between 1 and 1.125 and rounds to even, 1.0
    x = torch.tensor([1.0625, 1.0625, 1.0625, 448.0])
    stats = what_if_stats(x, "fp8_e4m3")
    assert stats["bulk_rel_error"] == pytest.approx(0.0625 / 1.0625, rel=1e-12)
    assert stats["sqnr_db"] > 70  # the 448 dominates the signal energy: SQNR reads "fine"
    assert stats["underflow_fraction"] == 0 and stats["saturation_fraction"] == 0


def test_flush_to_zero_is_counted_beside_sqnr():
    # one huge value sets the per-tensor scale; 1e-3 · (448 / 1e4) is below E4M3's smallest subnormal
    # (2^-9), so the three small elements flush to zero while SQNR stays high
    x = torch.tensor([1e-3, -1e-3, 1e-3, 1e4])
    stats = what_if_stats(x, "fp8_e4m3")
    assert stats["underflow_fraction"] == 0.75 and stats["bulk_rel_error"] == 1.0
    assert stats["sqnr_db"] > 100


def test_block_statistics_of_hand_made_mx_blocks():
    # MXFP8 FLOOR (OCP): scale exponent floor(log2 amax) − 8, byte + 127
    blocks = torch.zeros(4, 32)
    blocks[0, 0], blocks[0, 1:] = 1.0, 0.5  # amax 1 -> byte 119, nothing lost
    #                                          block 1: all zero -> byte 0, left out of fractions
    blocks[2, 0], blocks[2, 1] = 1.9, 1e-10  # amax 1.9 -> byte 119: 1.9·2^8 = 486.4 > 448 clips;
    #                                          1e-10·2^8 is below 2^-9: flushed
    blocks[3, :] = 2.0**-140  # amax 2^-140 -> byte 0 (exponent clamped at -127): 2^-13 < 2^-9, all flushed
    stats = block_stats(blocks.flatten(), "mxfp8")
    assert stats["scale_code/119"] == 2 and stats["scale_code/0"] == 2
    assert stats["clipped_block_fraction"] == pytest.approx(1 / 3)
    assert stats["flushed_block_fraction"] == pytest.approx(2 / 3)
    assert stats["underflow_block_fraction"] == pytest.approx(1 / 3)
    assert (stats["scale_log2_min"], stats["scale_log2_max"]) == (-127.0, -8.0)
    assert stats["worst_1/rel_error"] == 1.0 and stats["worst_1/block"] == 3.0  # the underflowed block
    expected = (1.9 - 448 / 256) / math.sqrt(1.9**2 + 1e-20)  # the clipped block, 1e-10 lost too
    assert stats["worst_2/rel_error"] == pytest.approx(expected, rel=1e-6) and stats["worst_2/block"] == 2.0


def test_block_statistics_locate_blocks_along_any_axis_and_for_nvfp4():
    # along axis 0 the layout is (column, block of 16 rows): x[32:48, 1] is row 1, block 2
    x = torch.ones(64, 3)
    x[32:48, 1] = 1e-9
    stats = block_stats(x, "nvfp4_torchao", axis=0)
    # global g = amax / (448·6) = 1/2688; a block of ones gets E4M3(1 / 6 / g) = 448 (code 0x7E = 126);
    # the tiny block's 1e-9 / 6 / g is clamped to 2^-6 (code 8), and 1e-9 / (2^-6 · g) rounds to 0
    assert stats["scale_code/126"] == 11 and stats["scale_code/8"] == 1
    assert stats["underflow_block_fraction"] == pytest.approx(1 / 12)
    assert (stats["worst_1/rel_error"], stats["worst_1/row"], stats["worst_1/block"]) == (1.0, 1.0, 2.0)
    g = torch.tensor(1.0) / 2688  # a float32 global scale (docs/reference.md §2): rounded exactly
    assert stats["scale_log2_min"] == math.log2(float(g * 2.0**-6))
    assert stats["scale_log2_max"] == math.log2(float(g * 448))
    # NVIDIA's convention has no floor: the tiny block's E4M3(1e-9 · 2688 · fl(1/6)) is 0 (code 0); it
    # underflows as before, and a zero scale is left out of the log2 statistics
    stats = block_stats(x, "nvfp4", axis=0)
    assert stats["scale_code/126"] == 11 and stats["scale_code/0"] == 1
    assert stats["underflow_block_fraction"] == pytest.approx(1 / 12)
    multiplier = torch.tensor(448.0) * (
        torch.tensor(1.0) / torch.tensor(2688.0)
    )  # fl(448 · fl(1/2688)), TE's decode
    assert stats["scale_log2_min"] == stats["scale_log2_max"] == math.log2(float(multiplier))


def test_what_if_specs_per_module_and_block_rows_in_one_probe_set():
    model = small_model()
    what_if = {"mx": ("mxfp8", "0"), "nv": ("nvfp4", ["2"]), "all": "fp8_e4m3", "bw": ("fp8_blockwise", "2")}
    probes = ProbeSet(model, modules=["0", "2"], roles=("output",), stats=("amax",), what_if=what_if,
                      block_stats=True)  # fmt: skip
    with probes:
        model(torch.randn(4, 8, generator=torch.Generator().manual_seed(0)))
    frame = probes.to_frame()
    labels = {
        module: {s.split("/")[0] for s in group.stat if "/" in s} for module, group in frame.groupby("module")
    }
    assert labels == {"0": {"mx", "all"}, "2": {"nv", "all", "bw"}}
    assert {"mx/block/clipped_block_fraction", "mx/bulk_rel_error", "bw/block/scale_log2_max"} <= set(
        frame.stat
    )
    assert not any(s.startswith("all/block/") for s in frame.stat)  # per-tensor FP8 has no blocks


def test_weight_gradients_match_the_closed_form_and_leave_grad_alone():
    # loss = mean over batches of mean((x Wᵀ − y)²): dL/dW = Σ_b 2/(n·m) (x Wᵀ − y)ᵀ x / |batches|
    from qlab.probes import gradient_agreement, weight_gradients

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2, bias=False))
    weight = model[0].weight.detach().double()
    batches = [(torch.randn(5, 3), torch.randn(5, 2)) for _ in range(2)]
    model[0].weight.grad = torch.full_like(model[0].weight, 7.0)
    grads = weight_gradients(model, batches, lambda m, b: (m(b[0]) - b[1]).square().mean())
    expected = sum(2 / 10 * (x.double() @ weight.T - y.double()).T @ x.double() for x, y in batches) / 2
    # the model computes in float32, the closed form in float64: float32 rounding, rtol 1e-5 / atol 1e-7
    assert torch.allclose(grads["0"], expected, rtol=1e-5, atol=1e-7)
    assert torch.equal(model[0].weight.grad, torch.full_like(model[0].weight, 7.0))
    table = gradient_agreement({"0": torch.tensor([1.0, 0.0])}, {"0": torch.tensor([1.0, 1.0])})
    assert table.cosine.item() == pytest.approx(2**-0.5) and table.relative_error.item() == pytest.approx(
        2**-0.5
    )


def test_gradient_agreement_of_tiny_gradients_is_their_float64_cosine():
    # F.cosine_similarity floors each norm at 1e-8: a gradient of norm 1e-11 had cosine 4e-5, not 0.99995
    from qlab.probes import gradient_agreement

    generator = torch.Generator().manual_seed(0)
    reference = torch.randn(400, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    perturbed = reference * (1 + 0.01 * torch.randn(400, generator=generator, dtype=torch.float64))
    a, b = np.array(perturbed.tolist()), np.array(reference.tolist())
    exact = float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
    for scale in (1.0, 1e-11, 1e-160):
        table = gradient_agreement({"w": perturbed * scale}, {"w": reference * scale})
        assert table.cosine.item() == pytest.approx(exact, rel=1e-12), scale
    zero = gradient_agreement({"w": torch.zeros(3)}, {"w": torch.ones(3)})
    assert math.isnan(zero.cosine.item()) and zero.relative_error.item() == 1.0


def test_weight_gradients_give_zeros_where_the_loss_does_not_reach_and_leave_buffers_alone():
    from qlab.probes import weight_gradients

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2), nn.Linear(2, 2))
    model[0].weight.requires_grad_(False)  # frozen
    before = {name: buffer.clone() for name, buffer in model.named_buffers()}
    batches = [torch.randn(6, 3) for _ in range(2)]
    grads = weight_gradients(model, batches, lambda m, x: m[2](m[1](m[0](x))).square().mean())  # skips "3"
    assert sorted(grads) == ["2", "3"] and torch.equal(grads["3"], torch.zeros(2, 2, dtype=torch.float64))
    assert grads["2"].abs().sum() > 0
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, before[name]), name
    with pytest.raises(ValueError, match=r"names must be layers whose weight requires grad; frozen: \['0'\]"):
        weight_gradients(model, batches, lambda m, x: m(x).sum(), names=["0", "2"])


# --- gradients caught by tensor hooks, against torch's full backward hooks -----------------------------


class _Residual(nn.Module):
    """y = block(x) + x, then a second use of y: the gradient into ``block`` alone differs from x's total
    gradient, and y's gradient sums two consumers."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.block = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        y = self.block(x) + x
        return self.head(y) + self.head(y * y)


def _full_hook_gradients(model, module, x):
    """grad_input[0] and grad_output[0] of ``module`` as torch's register_full_backward_hook gives them."""
    seen = {}

    def hook(_, grad_input, grad_output):
        seen["grad_input"], seen["grad_output"] = grad_input[0].clone(), grad_output[0].clone()

    handle = module.register_full_backward_hook(hook)
    model(x).square().sum().backward()
    handle.remove()
    return seen


@pytest.mark.parametrize("module_name", ["block", "head"])
def test_grad_input_and_grad_output_equal_torchs_full_backward_hook(module_name):
    """ProbeSet takes grad_input from a view of the input with a tensor hook and grad_output from a
    tensor hook on the output, not from full backward hooks (which cost +13 % of notebook 01's step);
    the values must be torch's own: the gradient into this module alone (not x's total, which the
    residual adds to), and the gradient of the output summed over its consumers (head is called twice:
    each call is recorded, as a full backward hook records each)."""
    model = _Residual()
    module = getattr(model, module_name)
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1), requires_grad=True)
    reference = []
    handle = module.register_full_backward_hook(
        lambda _, gi, go: reference.append({"grad_input": gi[0].clone(), "grad_output": go[0].clone()})
    )
    model(x).square().sum().backward()
    handle.remove()
    with ProbeSet(
        model, modules=[module_name], roles=("grad_input", "grad_output"), stats=("l2", "max")
    ) as probes:
        model(x).square().sum().backward()
    frame = probes.to_frame()
    for role in ("grad_input", "grad_output"):
        got = sorted(frame[(frame.role == role) & (frame.stat == "l2")].value)
        want = sorted(torch.linalg.vector_norm(r[role].double()).item() for r in reference)
        assert got == pytest.approx(want, rel=1e-12), role
        got_max = sorted(frame[(frame.role == role) & (frame.stat == "max")].value)
        assert got_max == sorted(r[role].max().item() for r in reference), role
    if module_name == "block":  # the residual: x's own gradient is not the one into the block
        assert torch.linalg.vector_norm(x.grad.double()).item() != pytest.approx(got[0], rel=1e-3)


def test_grad_output_is_after_the_modules_backward_pre_hooks():
    """A module's backward pre-hook may rewrite its grad_output (qlab.sparse's top-k mask does): a full
    backward hook sees the rewritten gradient, and so must the probe."""
    model = small_model()
    model[2].register_full_backward_pre_hook(lambda _, grad_output: (grad_output[0] * 0.0 + 2.0,))
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    with ProbeSet(model, modules=["2"], roles=("grad_output",), stats=("min", "max")) as probes:
        model(x).sum().backward()
    values = probes.to_frame().set_index("stat").value
    assert values["min"] == values["max"] == 2.0


def test_a_gradient_hook_left_on_a_tensor_records_nothing_after_detaching():
    """Tensor hooks set during a sampled forward stay on that forward's tensors; if backward runs only
    after the set is detached, nothing is recorded (as with no hooks at all)."""
    model = small_model()
    probes = ProbeSet(model, roles=("grad_input", "grad_output"), stats=("l2",)).attach()
    loss = model(torch.randn(2, 8, requires_grad=True)).sum()
    probes.detach()
    loss.backward()
    assert probes.to_frame().empty


def test_statistics_and_what_if_records_keep_recording_order_in_the_frame():
    """Statistics are turned into frame rows a table at a time and what-if values a row each; the frame
    keeps recording order (each record's statistics, then its what-if values), its column types, and
    ``records`` gives the same rows as tuples."""
    model = small_model()
    with ProbeSet(
        model, modules=["0", "2"], roles=("output",), stats=("amax", "l2"), what_if={"m": "mxfp8"}
    ) as probes:
        model(torch.randn(4, 8, generator=torch.Generator().manual_seed(3)))
        probes.step()
        model(torch.randn(4, 8, generator=torch.Generator().manual_seed(4)))
    frame = probes.to_frame()
    per_record = [
        "amax",
        "l2",
        *(
            f"m/{stat}"
            for stat in ("underflow_fraction", "saturation_fraction", "bulk_rel_error", "qdq_mse", "sqnr_db")
        ),
    ]
    assert frame.stat.tolist() == per_record * 4
    assert frame.module.tolist() == [m for m in ["0", "2", "0", "2"] for _ in per_record]
    assert frame.step.tolist() == [s for s in [0, 0, 1, 1] for _ in per_record]
    assert str(frame.step.dtype) == "int64" and str(frame.value.dtype) == "float64"
    assert probes.records == list(frame.itertuples(index=False, name=None))


@pytest.mark.parametrize("enabled", [True, False])
def test_reading_records_leaves_the_garbage_collector_as_it_was(enabled):
    import gc

    probes = ProbeSet(small_model(), stats=("l1",))
    with probes:
        probe(torch.ones(3), "x")
    was = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        assert probes.to_frame().value.tolist() == [3.0]
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()


def test_values_stay_with_their_records_across_kernel_rows_device_vectors_and_what_ifs():
    """Records of three kinds interleaved: float32 tensors (a row of the C kernel's table), bf16 and
    empty tensors (vectors of the batched torch reduction) and what-if rows for the names matching
    "w*": each statistic must be its own tensor's, in recording order, across two reads."""
    generator = torch.Generator().manual_seed(9)
    tensors = {
        "a": torch.randn(3, 5, generator=generator),
        "w1": torch.randn(4, 32, generator=generator) * 100,
        "b16": torch.randn(6, 8, generator=generator).bfloat16(),
        "empty": torch.empty(0, 4),
        "c": torch.randn(2, 7, generator=generator) - 3,
        "w2": torch.randn(2, 32, generator=generator) * 1e-3,
        "d": torch.randn(5, generator=generator),
    }
    probes = ProbeSet(small_model(), stats=("amax", "l2", "mean"), what_if={"m": ("mxfp8", ["w*"])})
    frames = []
    with probes:
        for name, x in list(tensors.items())[:4]:
            probe(x, name)
        frames.append(probes.to_frame())
        for name, x in list(tensors.items())[4:]:
            probe(x, name)
    frame = probes.to_frame()
    assert frame.iloc[: len(frames[0])].equals(frames[0])  # a second read appends, keeps the first
    assert frame.module.drop_duplicates().tolist() == list(tensors)
    values = frame.set_index(["module", "stat"]).value
    for name, x in tensors.items():
        if x.numel() == 0:
            assert all(math.isnan(values[name, stat]) for stat in ("amax", "l2", "mean"))
            continue
        x64 = x.double()
        assert values[name, "amax"] == x64.abs().max().item(), name
        assert values[name, "l2"] == pytest.approx(torch.linalg.vector_norm(x64).item(), rel=1e-12), name
        assert values[name, "mean"] == pytest.approx(x64.mean().item(), rel=1e-12), name
        assert ("m/sqnr_db" in frame[frame.module == name].stat.values) == name.startswith("w"), name
    for name in ("w1", "w2"):
        assert values[name, "m/sqnr_db"] == pytest.approx(
            Q.sqnr_db(tensors[name], Q.qdq(tensors[name], "mxfp8"))
        )


def test_probe_records_only_into_sets_that_ask_for_the_probe_role():
    with (
        ProbeSet(small_model(), roles=("param_grad",), stats=("l1",)) as without,
        ProbeSet(small_model(), roles=("probe",), stats=("l1",)) as with_probe,
    ):
        probe(torch.ones(3), "inside backward")
    assert without.to_frame().empty
    assert with_probe.to_frame().value.tolist() == [3.0]


class _TwoOutputs(nn.Module):
    """Returns (a detached summary, the activation): the first output takes no gradient."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(4)
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        y = self.linear(x)
        return y.detach().sum(), y


def test_grad_output_of_a_tuple_output_is_its_first_output_that_takes_a_gradient():
    """A full backward hook's first non-None grad_output: here the second output's gradient."""
    module = _TwoOutputs()
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(2))
    reference = []
    handle = module.register_full_backward_hook(
        lambda _, gi, go: reference.append(next(g for g in go if g is not None).clone())
    )
    module(x)[1].pow(3).sum().backward()
    handle.remove()
    with ProbeSet(module, modules=[_TwoOutputs], roles=("grad_output",), stats=("l2",)) as probes:
        module(x)[1].pow(3).sum().backward()
    got = probes.to_frame().value.tolist()
    assert got == pytest.approx([torch.linalg.vector_norm(reference[0].double()).item()], rel=1e-12)


def test_an_audit_that_observed_nothing_says_so():
    """No hook entered and no observe call: an empty table would read as "everything explained"."""
    model = small_model()
    with pytest.raises(ValueError, match="observed no gradient"):
        GradientAudit(model).report()
    audit = GradientAudit(model, hook_parameters=False)
    audit.observe("0.weight", torch.ones(16, 8))
    with pytest.raises(ValueError, match="has a .grad"):  # observed, but backward never reached .grad
        audit.report()
    with pytest.raises(ValueError, match="closest"):
        audit.observe("0.wieght", torch.ones(16, 8))
    with pytest.raises(ValueError, match=r"shape \(16, 8\)"):
        audit.observe("0.weight", torch.ones(8))
